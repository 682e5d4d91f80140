"""Local math that algorithms run between communication steps.

The torch implementation here defines the semantics (which op, which accumulation dtype, how AVG
divides). Later CUDA kernels in ``csrc/`` must match it.
"""

from __future__ import annotations

import torch

from ..ops import ReduceOp

__all__ = ["reduce_", "finish_avg_"]


def _sum(dst, src):
    dst.add_(src)


def _prod(dst, src):
    dst.mul_(src)


def _min(dst, src):
    torch.minimum(dst, src, out=dst)


def _max(dst, src):
    torch.maximum(dst, src, out=dst)


def _band(dst, src):
    dst.bitwise_and_(src)


def _bor(dst, src):
    dst.bitwise_or_(src)


def _bxor(dst, src):
    dst.bitwise_xor_(src)


# AVG is reduced as SUM and divided once at the end (finish_avg_), in the accumulation dtype.
_REDUCE = {
    ReduceOp.SUM: _sum,
    ReduceOp.AVG: _sum,
    ReduceOp.PRODUCT: _prod,
    ReduceOp.MIN: _min,
    ReduceOp.MAX: _max,
    ReduceOp.BAND: _band,
    ReduceOp.BOR: _bor,
    ReduceOp.BXOR: _bxor,
}


def reduce_(dst: torch.Tensor, src: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """``dst = dst (op) src`` elementwise, in place; both of the same dtype and shape."""
    _REDUCE[op](dst, src)
    return dst


def finish_avg_(buf: torch.Tensor, size: int) -> torch.Tensor:
    """Divide a SUM by the group size to finish an AVG (floating dtypes only)."""
    if size != 1:
        buf.div_(size)
    return buf
