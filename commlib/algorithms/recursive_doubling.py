"""Recursive doubling all-reduce: log2(p) exchanges of the whole buffer with rank ^ 2^k.

The latency optimum for small messages (log2 p steps), moving the whole buffer at each step.
Non-power-of-two sizes fold the extra ranks in first (see ``_fold``). Both partners reduce the
same pair of operands at each step, so every rank ends with bitwise identical results.
"""

from __future__ import annotations

import torch

from ..kernels import reduce_
from . import _fold, register_algorithm


@register_algorithm("recursive_doubling", "all_reduce")
def all_reduce(ctx, buf):
    flat = buf.view(-1)
    p2, rem = _fold.shape(ctx.size)
    yield from _fold.fold_in(ctx, flat, rem)
    me = _fold.new_rank(ctx.rank, rem)
    if me >= 0:
        tmp = torch.empty_like(flat)
        mask = 1
        while mask < p2:
            peer = _fold.real_rank(me ^ mask, rem)
            yield [ctx.isend(flat, peer), ctx.irecv(tmp, peer)]
            reduce_(flat, tmp, ctx.op)  # IEEE + and * commute: both partners get the same bits
            mask <<= 1
    yield from _fold.fold_out(ctx, flat, rem)
