"""Rabenseifner's all-reduce: recursive-halving reduce-scatter, then recursive-doubling
all-gather (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005).

2 log2(p) steps moving about 2(p-1)/p of the buffer per rank: ring's bandwidth with
log-depth latency. Non-power-of-two sizes fold the extra ranks in first (see ``_fold``); uneven
element counts split by ``chunk_bounds`` (chunks may be empty).
"""

from __future__ import annotations

import torch

from ..kernels import reduce_
from . import _fold, chunk_bounds, register_algorithm


@register_algorithm("rabenseifner", "all_reduce")
def all_reduce(ctx, buf):
    flat = buf.view(-1)
    p2, rem = _fold.shape(ctx.size)
    yield from _fold.fold_in(ctx, flat, rem)
    me = _fold.new_rank(ctx.rank, rem)
    if me >= 0 and p2 > 1:
        bounds = chunk_bounds(flat.numel(), p2)

        def span(first, count):  # elements of chunks [first, first + count)
            return flat[bounds[first]:bounds[first + count]]

        # Reduce-scatter by recursive halving: the highest bit first, so that rank `me` ends
        # owning chunk `me`.
        lo, width = 0, p2
        while width > 1:
            half = width // 2
            partner = me ^ half
            peer = _fold.real_rank(partner, rem)
            mine, theirs = (lo, lo + half) if me < partner else (lo + half, lo)
            keep = span(mine, half)
            tmp = torch.empty_like(keep)
            yield [ctx.isend(span(theirs, half), peer), ctx.irecv(tmp, peer)]
            reduce_(keep, tmp, ctx.op)
            lo, width = mine, half
        # All-gather by recursive doubling: swap the owned aligned block with the partner's.
        width = 1
        while width < p2:
            partner = me ^ width
            peer = _fold.real_rank(partner, rem)
            mine = (me // width) * width
            theirs = (partner // width) * width
            yield [ctx.isend(span(mine, width), peer), ctx.irecv(span(theirs, width), peer)]
            width *= 2
    yield from _fold.fold_out(ctx, flat, rem)
