"""Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling all-gather
(Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005).

all_reduce takes 2 log2(p) steps moving about 2(p-1)/p of the buffer per rank: ring's bandwidth
with log-depth latency. reduce_scatter is its first half alone. Non-power-of-two sizes fold the
extra ranks in first, sending whole buffers, as in MPICH (see ``_fold``); uneven element counts
split by ``chunk_bounds`` (chunks may be empty).
"""

from __future__ import annotations

import torch

from ..kernels import reduce_
from . import _fold
from .costs import doubling_shape, halving
from .registry import chunk_bounds, register_algorithm
from .recursive_doubling import all_gather_steps


def reduce_scatter_steps(ctx, flat, bounds, me, rem):
    """log2(p2) steps among the p2 core ranks: afterwards chunk ``me`` of ``flat`` (``bounds``
    has p2 + 1 entries) holds the reduction over every core rank's ``flat``. The highest bit
    goes first, so that the halves kept narrow down to chunk ``me``."""
    lo, width = 0, len(bounds) - 1
    while width > 1:
        half = width // 2
        partner = me ^ half
        peer = _fold.real_rank(partner, rem)
        mine, theirs = (lo, lo + half) if me < partner else (lo + half, lo)
        keep = flat[bounds[mine]:bounds[mine + half]]
        tmp = torch.empty_like(keep)
        yield [ctx.isend(flat[bounds[theirs]:bounds[theirs + half]], peer), ctx.irecv(tmp, peer)]
        reduce_(keep, tmp, ctx.op)
        lo, width = mine, half


def _all_reduce_cost(p, n, link):
    """Halving steps of n/2 ... n/p2, doubling back, and the fold's whole-buffer steps."""
    p2, k, f = doubling_shape(p)
    return (2 * halving(k, n, link) + (p2 - 1) / p2 * n * link.gamma
            + f * (2 * link.step(n) + n * link.gamma))


def _reduce_scatter_cost(p, n, link):
    p2, k, f = doubling_shape(p)
    return (halving(k, n, link) + (p2 - 1) / p2 * n * link.gamma
            + f * (link.step(n) + link.step(n / p) + n * link.gamma))


@register_algorithm("rabenseifner", "all_reduce", cost=_all_reduce_cost, prices_native=True,
                    shares_host_link=True)
def all_reduce(ctx, buf):
    flat = buf.view(-1)
    p2, rem = _fold.shape(ctx.size)
    yield from _fold.fold_in(ctx, flat, rem)
    me = _fold.new_rank(ctx.rank, rem)
    if me >= 0:
        bounds = chunk_bounds(flat.numel(), p2)
        yield from reduce_scatter_steps(ctx, flat, bounds, me, rem)
        yield from all_gather_steps(ctx, flat, bounds, me, rem)
    yield from _fold.fold_out(ctx, flat, rem)


@register_algorithm("rabenseifner", "reduce_scatter", cost=_reduce_scatter_cost, prices_native=True,
                    shares_host_link=True)
def reduce_scatter(ctx, out, inp):
    # Core rank k reduces the blocks of the ranks it stands for, first_rank(k)..real_rank(k),
    # and hands block r - 1 back to the even rank r - 1 it folded in.
    n, r = out.numel(), ctx.rank
    p2, rem = _fold.shape(ctx.size)
    me = _fold.new_rank(r, rem)
    work = inp.view(-1) if me < 0 else inp.reshape(-1).clone()  # the caller's input stays intact
    yield from _fold.fold_in(ctx, work, rem)
    if me >= 0:
        bounds = [_fold.first_rank(k, rem) * n for k in range(p2 + 1)]
        yield from reduce_scatter_steps(ctx, work, bounds, me, rem)
        out.view(-1).copy_(work[r * n:(r + 1) * n])
    yield from _fold.fold_out(ctx, out.view(-1) if me < 0 else work[(r - 1) * n:r * n], rem)
