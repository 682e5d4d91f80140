"""SUMMA on an (r, c) mesh (van de Geijn & Watts 1997; Optimus, Xu et al. 2021): the linear layer
``y = x W^T`` with ``x`` in the 2-D layout (rank (i, j): rows block i, features block j) and
the weight held as blocks too, so that nothing is replicated.

Write ``B = W^T`` (in x out). Rank (i, j) holds ``x[i, j]`` (T/r x in/c) and ``B[i, j]``
(in/r x out/c: ``W``'s rows block j, columns block i, kept in ``nn.Linear``'s (out, in) order),
and computes ``y[i, j] = sum_k x[i, k] B[k, j]`` over the contraction dim cut in L *panels* of
in/L, L a multiple of lcm(r, c) (by default lcm(r, c) itself, ``_panels.summa_panels``): panel p
of x lives on the row's rank ``p // (L/c)``, panel p of B on the column's rank ``p // (L/r)``.
Per panel:

* forward ``C = AB``: broadcast x's panel along the row, B's along the column, ``y += x_p B_p``;
* backward ``dA = dC B^T``: the same broadcast of B's panel, ``dC B_p^T``, *reduced* along the
  row to the panel's owner; ``dB = A^T dC``: the broadcast of x's panel, ``x_p^T dC``, reduced
  along the column to its owner. One loop does both, re-broadcasting the panels rather than
  keeping them from the forward (activation memory stays one block).

Overlap: panel p+1's broadcasts are posted (asynchronously) before panel p's GEMMs and advance while
they run (commlib's progress thread); the backward's reductions are posted as soon as a panel's
partial is computed and drained one panel behind, so at most two panels of partials are alive. The
backward computes a panel's dW partial before its dx partial: that one needs only x's panel, so W's
may still be arriving, and dW's reduction then travels during the dx GEMM. A rank that owns a panel
broadcasts it from its own block without a copy when the block is one panel (the default L = lcm(r,
c) on a square mesh), and reduces into its gradient block directly; finer panels (``panels=``) cost
the owner one copy of its slice.

Precision: float32 and float64 compute as they are; bfloat16 and float16 panels are multiplied in
float32 and accumulated over panels in float32 (the output is rounded once); the backward's
partials are reduced in the input dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _traffic
from ._grid import Grid
from ._panels import summa_panels

__all__ = ["Panels", "panels_of", "linear_2d"]

_LOW = (torch.bfloat16, torch.float16)


class Panels(NamedTuple):
    count: int  # L = lcm(r, c)
    width: int  # in / L
    a_per: int  # panels per block of x's features (L / c)
    b_per: int  # panels per block of W's input features (L / r)

    def a_owner(self, p: int) -> tuple[int, int]:
        """(column of the row that holds x's panel p, offset in its block)."""
        return p // self.a_per, (p % self.a_per) * self.width

    def b_owner(self, p: int) -> tuple[int, int]:
        """(row of the column that holds W's panel p, offset in its block)."""
        return p // self.b_per, (p % self.b_per) * self.width


def panels_of(r: int, c: int, in_features: int, count: int | None = None) -> Panels:
    """``count`` panels (a multiple of lcm(r, c) dividing ``in_features``), by default
    ``_panels.summa_panels``'s, the rule the planner prices."""
    count = summa_panels(r, c, in_features, count)
    return Panels(count, in_features // count, count // c, count // r)


def _post(x2, w, grid: Grid, pn: Panels, p: int, async_op: bool):
    """Broadcast panel p of x along the row and of W along the column: (x_p, its works, W_p,
    its works)."""
    (ja, oa), (ib, ob), k = pn.a_owner(p), pn.b_owner(p), pn.width
    if grid.j == ja:
        a = x2 if pn.a_per == 1 else x2[:, oa:oa + k].contiguous()
    else:
        a = x2.new_empty((x2.shape[0], k))
    if grid.i == ib:
        b = w if pn.b_per == 1 else w[:, ob:ob + k].contiguous()
    else:
        b = w.new_empty((w.shape[0], k))
    wa = _traffic.broadcast(a, ja, grid.row, async_op)
    wb = _traffic.broadcast(b, ib, grid.col, async_op)
    return a, [wa] if wa else [], b, [wb] if wb else []


def _wait(works: list) -> None:
    while works:
        works.pop(0).wait()


def _panels(x2, w, grid: Grid, pn: Panels, overlap: bool):
    """Yield ``(p, x_p, W_p, W_p's works)`` for every panel in order: x_p has arrived, W_p has
    once the caller ``_wait``s its works (the backward needs x_p first); with ``overlap``
    panel p+1's broadcasts travel while the caller works on panel p."""
    pending = _post(x2, w, grid, pn, 0, overlap)
    for p in range(pn.count):
        a, a_works, b, b_works = pending
        if overlap and p + 1 < pn.count:
            pending = _post(x2, w, grid, pn, p + 1, True)
        _wait(a_works)
        yield p, a, b, b_works
        _wait(b_works)  # if the caller did not need W_p: never left in flight
        if not overlap and p + 1 < pn.count:
            pending = _post(x2, w, grid, pn, p + 1, False)


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b``, in float32 for the low-precision dtypes (then rounded into ``out``'s dtype)."""
    if a.dtype in _LOW:
        prod = torch.mm(a.float(), b.float())
        return prod if out is None else out.copy_(prod)
    return torch.mm(a, b, out=out)


def summa_forward(x2: torch.Tensor, w: torch.Tensor, grid: Grid, pn: Panels,
                  overlap: bool) -> torch.Tensor:
    """``x2`` (T/r, in/c) times the dense ``W^T``'s (i, j) block: (T/r, out/c) in x's dtype."""
    acc = None
    for _, a, b, b_works in _panels(x2, w, grid, pn, overlap):
        _wait(b_works)
        if acc is None:
            acc = _mm(a, b.t())  # float32 for the low-precision dtypes: accumulated there
        elif a.dtype in _LOW:
            acc.addmm_(a.float(), b.float().t())
        else:
            acc.addmm_(a, b.t())
    return acc.to(x2.dtype)


class _Reductions:
    """The backward's reductions in flight: each lands in a buffer that the panel's owner then
    copies into its gradient block (unless the buffer *is* the block)."""

    def __init__(self):
        self.items: list = []

    def post(self, buf, dest, root: int, g, overlap: bool) -> None:
        work = _traffic.reduce(buf, root, g, overlap)
        self.items.append((work, buf, dest if g.rank == root else None))

    def drain(self, keep: int = 0) -> None:
        while len(self.items) > keep:
            work, buf, dest = self.items.pop(0)
            if work is not None:
                work.wait()
            if dest is not None and dest.data_ptr() != buf.data_ptr():
                dest.copy_(buf)


def summa_backward(dy2, x2, w, grid: Grid, pn: Panels, overlap: bool, need_dx: bool,
                   need_dw: bool):
    """Gradients of ``summa_forward`` for ``dy2`` (T/r, out/c): this rank's blocks of ``dx``
    (T/r, in/c) and ``dW`` (out/c, in/r), or None where not needed."""
    dx = torch.empty_like(x2) if need_dx else None
    dw = torch.empty_like(w) if need_dw else None
    k = pn.width
    reductions = _Reductions()
    for p, a, b, b_works in _panels(x2, w, grid, pn, overlap):
        posted = 0
        # dW before dx: it needs x's panel (along the row) while W's (along the column) may still
        # travel, and its reduction, posted first, travels during the dx GEMM. On a mesh from
        # Mesh.from_topology the column is the group that crosses hosts: its reduction is the
        # slow one, and it is no longer the layer's exposed tail (measured in the docs).
        if need_dw:  # (x_p^T dC)^T = dC^T x_p, summed along the column into W's panel owner
            ib, ob = pn.b_owner(p)
            mine = grid.i == ib
            part = dw if mine and pn.b_per == 1 else w.new_empty((w.shape[0], k))
            _mm(dy2.t(), a, out=part)
            reductions.post(part, dw[:, ob:ob + k] if mine else None, ib, grid.col, overlap)
            posted += 1
        if need_dx:  # dC B_p^T, summed along the row into the owner of x's panel p
            _wait(b_works)
            ja, oa = pn.a_owner(p)
            mine = grid.j == ja
            buf = dx if mine and pn.a_per == 1 else x2.new_empty((x2.shape[0], k))
            _mm(dy2, b, out=buf)
            reductions.post(buf, dx[:, oa:oa + k] if mine else None, ja, grid.row, overlap)
            posted += 1
        reductions.drain(keep=posted)  # the previous panel's are done (or nearly): bounded memory
    reductions.drain()
    return dx, dw


class _Linear2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, grid, overlap, pn):
        x2 = x.detach().reshape(-1, x.shape[-1]).contiguous()
        y = summa_forward(x2, weight.detach(), grid, pn, overlap)
        if bias is not None:
            y += bias.detach()
        ctx.save_for_backward(x2, weight)
        ctx.args = (grid, pn, overlap, bias is not None, tuple(x.shape))
        return y.view(tuple(x.shape[:-1]) + (weight.shape[0],))

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        grid, pn, overlap, has_bias, shape = ctx.args
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        db = work = None
        if has_bias and ctx.needs_input_grad[2]:
            # the bias block is replicated on the column: each row's tokens add their part
            db = dy2.sum(0, dtype=torch.float32).to(dy2.dtype) if dy2.dtype in _LOW else dy2.sum(0)
            work = _traffic.all_reduce(db, grid.col, overlap)
        dx, dw = summa_backward(dy2, x2, weight.detach(), grid, pn, overlap,
                                ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        if work is not None:
            work.wait()
        return (None if dx is None else dx.view(shape)), dw, db, None, None, None


def linear_2d(x: torch.Tensor, weight: torch.Tensor, bias, grid: Grid, overlap: bool,
              pn: Panels):
    return _Linear2D.apply(x, weight, bias, grid, overlap, pn)
