"""The 2-D layout of activations on an (r, c) mesh, shared by the 2D layers.

Rank (i, j) of a ``commlib.Mesh`` of shape (r, c) holds block i of dim 0 (split in r) and block j
of the last dim (split in c): a global ``(N, ..., H)`` tensor is held as ``(N/r, ..., H/c)``.
The *row group* of (i, j) is the c ranks (i, 0..c-1) (``mesh.group(1)``), its *column group* the
r ranks (0..r-1, j) (``mesh.group(0)``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from commlib.api.groups import Mesh
from commlib.errors import CommTypeError, arg_error

from . import _traffic

__all__ = ["Grid", "grid_of", "divisible", "split_2d", "gather_2d", "gather_blocks", "assemble"]


class Grid(NamedTuple):
    mesh: Mesh
    r: int
    c: int
    i: int  # this rank's mesh row
    j: int  # this rank's mesh column
    row: object  # Group: the c ranks of row i
    col: object  # Group: the r ranks of column j
    whole: object  # Group: the mesh's r * c ranks


def grid_of(fn: str, mesh) -> Grid:
    if not isinstance(mesh, Mesh):
        raise arg_error(fn, "mesh", type(mesh).__name__, "must be a commlib.Mesh",
                        "pass commlib.Mesh((r, c)) (r * c ranks)", CommTypeError)
    if mesh.ndim != 2:
        raise arg_error(fn, "mesh", mesh, f"is {mesh.ndim}-dimensional; 2D layers need a 2-dimensional mesh",
                        "pass a mesh of shape (r, c), e.g. commlib.Mesh((2, 2)); "
                        "(1, p) or (p, 1) for one dimension")
    r, c = mesh.shape
    i, j = mesh.coords
    return Grid(mesh, r, c, i, j, mesh.group(1), mesh.group(0), mesh.parent)


def divisible(fn: str, arg: str, what: str, size: int, parts: int, why: str) -> None:
    """``size`` (of ``what``) must split into ``parts`` equal blocks."""
    if size % parts:
        raise arg_error(fn, arg, size if not isinstance(size, torch.Tensor) else "<tensor>",
                        f"{what} has size {size}, not a multiple of {parts} ({why})",
                        f"make {what} a multiple of {parts} (e.g. {size + (-size) % parts}), "
                        f"padding it and masking the padding, or use a mesh that divides it")


def _check_local(fn: str, arg: str, x: torch.Tensor, grid: Grid) -> None:
    if not isinstance(x, torch.Tensor):
        raise arg_error(fn, arg, type(x).__name__, "must be a torch.Tensor",
                        "pass this rank's block", CommTypeError)
    if x.dim() < 2:
        raise arg_error(fn, arg, f"<tensor shape={tuple(x.shape)}>",
                        "must have at least 2 dimensions (rows first, features last)",
                        "pass a tensor of shape (N, ..., H)")


def split_2d(x: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's block of ``x`` (the same global ``(N, ..., H)`` tensor on every rank): rows
    block i of dim 0 and block j of the last dim, a differentiable view (``x.grad`` gets this
    block's gradient). Dim 0 must divide by r and the last dim by c."""
    fn = "nn.functional.split_2d"
    grid = grid_of(fn, mesh)
    _check_local(fn, "x", x, grid)
    n, h = x.shape[0], x.shape[-1]
    divisible(fn, "x", "dimension 0", n, grid.r, f"split over the mesh's {grid.r} rows")
    divisible(fn, "x", f"the last dimension ({x.dim() - 1})", h, grid.c,
              f"split over the mesh's {grid.c} columns")
    return x.narrow(0, grid.i * (n // grid.r), n // grid.r).narrow(
        -1, grid.j * (h // grid.c), h // grid.c)


def _coords(grid: Grid) -> list[tuple[int, int]]:
    """Mesh coordinates of each rank of ``grid.whole``, by group rank."""
    out = [(0, 0)] * grid.whole.size
    for pos, q in enumerate(grid.mesh.order):
        out[q] = divmod(pos, grid.c)
    return out


def gather_blocks(t: torch.Tensor, grid: Grid) -> dict[tuple[int, int], torch.Tensor]:
    """Every rank's ``t`` (the same shape everywhere), keyed by its mesh coordinates."""
    t = t.detach().contiguous()
    stacked = t.new_empty((grid.whole.size,) + tuple(t.shape))
    _traffic.all_gather(stacked, t, grid.whole)
    return {rc: stacked[q] for q, rc in enumerate(_coords(grid))}


def assemble(blocks: dict, r: int, c: int) -> torch.Tensor:
    """The global tensor from its (i, j) blocks: rows along dim 0, columns along the last."""
    return torch.cat([torch.cat([blocks[(i, j)] for j in range(c)], -1) for i in range(r)], 0)


class _Gather2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid):
        ctx.grid = grid
        return assemble(gather_blocks(x, grid), grid.r, grid.c)

    @staticmethod
    def backward(ctx, g):
        grid = ctx.grid
        n, h = g.shape[0] // grid.r, g.shape[-1] // grid.c
        # every rank's loss adds to the total: this block's gradient is the sum over ranks of
        # their gradient's (i, j) block: one reduce-scatter with blocks in group-rank order
        parts = torch.stack([g.narrow(0, i * n, n).narrow(-1, j * h, h) for i, j in _coords(grid)])
        out = parts.new_empty(parts.shape[1:])
        _traffic.reduce_scatter(out, parts, grid.whole)
        return out, None


def gather_2d(x_local: torch.Tensor, mesh) -> torch.Tensor:
    """The global tensor on every rank from each rank's ``(N/r, ..., H/c)`` block (collective over
    the mesh). Differentiable with the 2D layers' convention: each rank's loss is its own term of
    a total that is their sum, so a block's gradient is the sum over ranks of that block of their
    gradients (a loss computed alike on every rank therefore counts ``r * c`` times: divide it,
    or compute it on one rank)."""
    fn = "nn.functional.gather_2d"
    grid = grid_of(fn, mesh)
    _check_local(fn, "x_local", x_local, grid)
    return _Gather2D.apply(x_local, grid)

