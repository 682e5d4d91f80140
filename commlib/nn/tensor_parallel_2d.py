"""Optimus-style 2D tensor parallelism (Xu et al. 2021): layers whose weights *and* activations
are split over an (r, c) ``commlib.Mesh``, multiplied with SUMMA (``_summa.py``).

**Layout.** Rank (i, j) holds activations as blocks: rows block i of dim 0 (split in r) and
block j of the last dim (split in c); a global ``(N, ..., H)`` activation is ``(N/r, ..., H/c)``
on every rank (``commlib.nn.functional.split_2d`` / ``gather_2d``). Every layer takes and
returns that layout, so layers compose with no re-layout between them.

**Gradients.** Each rank's loss is its own term and the total loss is their sum: a block's
gradient is the same block of the dense gradient of the total, on every rank holding it (the
replicated parameter blocks, e.g. a bias along a mesh column, are summed over their replicas in
backward). ``cross_entropy_2d`` returns the mean loss of the global batch on every rank, with
the backward of that one loss. ``to_dense()`` returns the dense module with those gradients.

**Initialization.** Each rank draws the whole dense module from its default generator and keeps
its blocks: seed every rank alike. ``from_dense`` keeps the blocks of a given module.

See docs/tensor-parallel-2d.md.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from commlib.api.entry import checked_call
from commlib.errors import CommTypeError, arg_error

from . import functional as F
from ._grid import assemble, divisible, gather_blocks, grid_of
from ._summa import linear_2d, panels_of
from .tensor_parallel import _agree_on_grads, _options, _positive

__all__ = ["Linear2D", "block_param", "column_vector", "dense_params"]


def _check_block(fn: str, arg: str, x, grid, features: int, dtype) -> None:
    """``x`` is this rank's ``(N/r, ..., features/c)`` block in the layer's dtype."""
    if not isinstance(x, torch.Tensor):
        raise arg_error(fn, arg, type(x).__name__, "must be a torch.Tensor",
                        f"pass this rank's (N/{grid.r}, ..., {features // grid.c}) block",
                        CommTypeError)
    if x.dim() < 2 or x.shape[-1] != features // grid.c:
        raise arg_error(fn, arg, f"<tensor shape={tuple(x.shape)}>",
                        f"must be this rank's block (N/{grid.r}, ..., {features}/{grid.c}) with "
                        f"last dim {features // grid.c}",
                        "split the global activation with nn.functional.split_2d(x, mesh)")
    if x.dtype != dtype:
        raise arg_error(fn, arg, f"<tensor dtype={x.dtype}>", f"must have the layer's dtype {dtype}",
                        f"cast it (x.to({dtype})) or build the layer with dtype={x.dtype}",
                        CommTypeError)


def block_param(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A parameter holding a copy of ``t`` (a block of a dense module's parameter)."""
    return nn.Parameter(t.detach().clone(), requires_grad=requires_grad)


def column_vector(t: torch.Tensor, grid) -> torch.Tensor:
    """The whole vector from its blocks j, each replicated down column j (collective)."""
    blocks = gather_blocks(t, grid)
    return torch.cat([blocks[(0, j)] for j in range(grid.c)])


def dense_params(fn: str, grid, module: nn.Module, params: dict, unblock) -> nn.Module:
    """Give the dense ``module`` (built on the meta device) the unblocked ``params`` (name ->
    this rank's block, or None), with ``.grad`` where the blocks have one (agreed over the mesh):
    every 2D layer's ``to_dense``. ``unblock(name, block)`` is collective over the mesh."""
    present = {k: p for k, p in params.items() if p is not None}
    has_grad = _agree_on_grads(fn, grid.whole, list(present.values()))
    for (name, p), grad in zip(present.items(), has_grad):
        full = nn.Parameter(unblock(name, p.detach()), requires_grad=p.requires_grad)
        if grad:
            full.grad = unblock(name, p.grad)
        setattr(module, name, full)
    return module


class Linear2D(nn.Module):
    """``nn.Linear`` on an (r, c) mesh, SUMMA: input ``(N/r, ..., in/c)``, output
    ``(N/r, ..., out/c)`` (the 2-D layout). Rank (i, j) holds the weight block
    ``W[j-th out/c rows, i-th in/r columns]`` and bias block j (replicated along the column).

    Args:
        in_features: must divide by lcm(r, c) (features split in c, weight rows in r, and
            SUMMA's panels of in/lcm(r, c)).
        out_features: must divide by c.
        bias: a bias.
        mesh: a 2-D ``commlib.Mesh`` (r, c).
        overlap: post the next panel's broadcasts before the current GEMM (default True);
            False broadcasts each panel when it is needed (blocking SUMMA, for comparison).
        panels: SUMMA steps, a multiple of lcm(r, c) dividing in_features (default lcm(r, c):
            on a square mesh every block is one panel, broadcast without a copy; more panels
            deepen the pipeline at the price of smaller GEMMs and more messages, measured slower
            in docs/tensor-parallel-2d.md).
    """

    _fn = "nn.Linear2D"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, mesh,
                 overlap: bool = True, panels: int | None = None, device=None, dtype=None):
        super().__init__()
        fn = self._fn
        self.grid = grid = grid_of(fn, mesh)
        in_features = _positive(fn, "in_features", in_features)
        out_features = _positive(fn, "out_features", out_features)
        bias = F._bool(fn, "bias", bias)
        self.overlap = F._bool(fn, "overlap", overlap)
        divisible(fn, "in_features", "in_features", in_features, math.lcm(grid.r, grid.c),
                  f"features split in {grid.c}, weight rows in {grid.r}, SUMMA panels of "
                  f"in/lcm({grid.r}, {grid.c})")
        divisible(fn, "out_features", "out_features", out_features, grid.c,
                  f"split over the mesh's {grid.c} columns")
        base = math.lcm(grid.r, grid.c)
        if panels is not None:
            panels = _positive(fn, "panels", panels)
            if panels % base or in_features % panels:
                raise arg_error(fn, "panels", panels,
                                f"must be a multiple of lcm({grid.r}, {grid.c}) = {base} that "
                                f"divides in_features = {in_features}",
                                f"pass panels={base} or another such multiple, or None")
        self.panels = panels_of(grid.r, grid.c, in_features, panels)
        self.in_features, self.out_features, self.mesh = in_features, out_features, mesh
        self._load(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype))

    def _load(self, dense: nn.Linear) -> None:
        g = self.grid
        n, k = self.out_features // g.c, self.in_features // g.r
        w = dense.weight.detach()[g.j * n:(g.j + 1) * n, g.i * k:(g.i + 1) * k]
        self.weight = block_param(w, dense.weight.requires_grad)
        if dense.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = block_param(dense.bias[g.j * n:(g.j + 1) * n], dense.bias.requires_grad)

    @classmethod
    def from_dense(cls, module: nn.Linear, mesh, **options) -> "Linear2D":
        """This rank's blocks of ``module`` (the same ``nn.Linear`` on every rank; no
        communication, the parameters are copied). ``options``: ``overlap``, ``panels``."""
        fn = cls._fn + ".from_dense"
        if not isinstance(module, nn.Linear):
            raise arg_error(fn, "module", type(module).__name__, "must be a torch.nn.Linear",
                            "pass the dense layer this one replaces", CommTypeError)
        _options(fn, options, ("overlap", "panels"))
        layer = cls(module.in_features, module.out_features, module.bias is not None, mesh=mesh,
                    device="meta", dtype=module.weight.dtype, **options)
        layer._load(module)
        return layer

    def to_dense(self) -> nn.Linear:
        """The dense ``nn.Linear`` on every rank (collective over the mesh), with ``.grad`` where
        this layer's parameters have one."""
        dense = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                          device="meta", dtype=self.weight.dtype)
        return dense_params(self._fn + ".to_dense", self.grid, dense,
                            {"weight": self.weight, "bias": self.bias}, self._unblock)

    def _unblock(self, name: str, t: torch.Tensor) -> torch.Tensor:
        g = self.grid
        if name == "bias":
            return column_vector(t, g)
        # W's rows block j, columns block i: the transpose of the activations' arrangement
        blocks = gather_blocks(t, g)
        return assemble({(j, i): blk for (i, j), blk in blocks.items()}, g.c, g.r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with checked_call(self._fn, self.grid.whole) as (_, call):
            _check_block(self._fn, "x", x, self.grid, self.in_features, self.weight.dtype)
            call.update(shape=tuple(x.shape), dtype=str(x.dtype))
        return linear_2d(x, self.weight, self.bias, self.grid, self.overlap, self.panels)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mesh={self.grid.r}x{self.grid.c}, "
                f"overlap={self.overlap}, panels={self.panels.count}")
