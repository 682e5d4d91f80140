"""Local math that algorithms run between communication steps.

The torch implementation here defines the semantics (which op, which accumulation dtype, how AVG
divides). The compiled kernels match it bit for bit: the per-element math of ``csrc/reduce_math.h``
is shared by the CPU shared-memory path (``csrc/shm/reduce.c``, tested against these functions in
tests/test_kernels.py) and the CUDA kernels (``csrc/kernels.cu``, ``csrc/cuda_ipc.cu``).
"""

from __future__ import annotations

import torch

from ..ops import ReduceOp, accumulation_dtype

__all__ = ["reduce_", "finish_avg_", "reduce_many", "cast_"]


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


def reduce_many(out: torch.Tensor, srcs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """``out = srcs[0] op srcs[1] op ...`` in list order (rank order), the semantics of the one-shot
    and two-shot reductions: float16/bfloat16 are accumulated in float32 and rounded once; AVG
    is the SUM divided by ``len(srcs)`` in the accumulation dtype before that rounding; integer
    SUM/PRODUCT wrap. Returns ``out``."""
    acc = srcs[0].to(accumulation_dtype(srcs[0].dtype), copy=True)
    for src in srcs[1:]:
        reduce_(acc, src.to(acc.dtype), op)
    if op is ReduceOp.AVG:
        finish_avg_(acc, len(srcs))
    return out.copy_(acc)


def cast_(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Convert ``src`` into ``out``'s dtype: round to nearest even (float32 -> float16/bfloat16),
    exact in the other direction. NaN stays NaN (its payload is not specified)."""
    return out.copy_(src)
