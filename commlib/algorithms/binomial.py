"""Binomial trees rooted anywhere: broadcast and reduce in ceil(log2 p) rounds, and all-reduce as
reduce to rank 0 then broadcast from it.

Ranks are renumbered relative to the root (v = (rank - root) mod p). In a broadcast, rank v
receives from v - 2^k (its lowest set bit) and forwards to v + 2^j for the lower bits; a reduce
runs the same tree upwards.
"""

from __future__ import annotations

import torch

from ..kernels import reduce_
from .costs import ceil_log2
from .registry import register_algorithm


def _broadcast(ctx, flat, root):
    p, v = ctx.size, (ctx.rank - root) % ctx.size
    mask = 1
    while mask < p:
        if v & mask:
            yield [ctx.irecv(flat, (ctx.rank - mask) % p)]
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            yield [ctx.isend(flat, (ctx.rank + mask) % p)]
        mask >>= 1


def _reduce(ctx, acc, root):
    """Reduce into ``acc`` (this rank's contribution on entry; the result at the root)."""
    p, v = ctx.size, (ctx.rank - root) % ctx.size
    tmp = None
    mask = 1
    while mask < p:
        if v & mask:
            yield [ctx.isend(acc, (ctx.rank - mask) % p)]
            return
        if v + mask < p:
            if tmp is None:
                tmp = torch.empty_like(acc)
            yield [ctx.irecv(tmp, (ctx.rank + mask) % p)]
            reduce_(acc, tmp, ctx.op)
        mask <<= 1


def _broadcast_cost(p, n, link):
    return ceil_log2(p) * link.step(n)


def _reduce_cost(p, n, link):
    return ceil_log2(p) * (link.step(n) + n * link.gamma)


def _all_reduce_cost(p, n, link):
    """A binomial reduce to rank 0, then a binomial broadcast from it."""
    return 2 * ceil_log2(p) * link.step(n) + ceil_log2(p) * n * link.gamma


@register_algorithm("binomial", "broadcast", cost=_broadcast_cost, prices_native=True)
def broadcast(ctx, buf, root):
    yield from _broadcast(ctx, buf.view(-1), root)


@register_algorithm("binomial", "reduce", cost=_reduce_cost, prices_native=True)
def reduce(ctx, buf, root):
    flat = buf.view(-1)
    # Non-root ranks keep their input: they accumulate in a copy.
    yield from _reduce(ctx, flat if ctx.rank == root else flat.clone(), root)


@register_algorithm("binomial", "all_reduce", cost=_all_reduce_cost, prices_native=True)
def all_reduce(ctx, buf):
    flat = buf.view(-1)
    yield from _reduce(ctx, flat, 0)
    yield from _broadcast(ctx, flat, 0)
