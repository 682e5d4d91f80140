"""Recursive doubling: log2(p) exchanges with rank ^ 2^k.

all_reduce swaps the whole buffer at each step: the latency optimum for small messages. Both
partners reduce the same pair of operands, so every rank ends with bitwise identical results.
all_gather swaps the block gathered so far, which doubles at each step.

Non-power-of-two sizes fold the extra ranks in first and out at the end (see ``_fold``), for
all_gather too: the core rank that stands for ranks 2i and 2i+1 owns their two adjacent blocks.
That costs two extra steps, where the Bruck variant would need none; the fold keeps one code path
and the blocks in place (Bruck ends rotated and needs a local shift).
"""

from __future__ import annotations

import torch

from ..kernels import reduce_
from . import _fold
from .costs import doubling_shape, halving
from .registry import chunk_bounds, register_algorithm


def all_gather_steps(ctx, flat, bounds, me, rem):
    """log2(p2) steps among the p2 core ranks (``me`` is this rank's new rank, see ``_fold``):
    new rank k starts owning chunk k of ``flat`` (``bounds`` has p2 + 1 entries) and every core
    rank ends owning them all. Rabenseifner's second half."""
    p2 = len(bounds) - 1
    width = 1
    while width < p2:
        partner = me ^ width
        peer = _fold.real_rank(partner, rem)
        mine, theirs = (me // width) * width, (partner // width) * width
        yield [ctx.isend(flat[bounds[mine]:bounds[mine + width]], peer),
               ctx.irecv(flat[bounds[theirs]:bounds[theirs + width]], peer)]
        width *= 2


def _all_reduce_cost(p, n, link):
    """log2(p2) whole-buffer exchanges and reductions, plus the fold's two steps."""
    p2, k, f = doubling_shape(p)
    return k * (link.step(n) + n * link.gamma) + f * (2 * link.step(n) + n * link.gamma)


def _all_gather_cost(p, n, link):
    """Doubling blocks n/p2 ... n/2, plus the fold's block in and whole buffer out."""
    p2, k, f = doubling_shape(p)
    return halving(k, n, link) + f * (link.step(n / p) + link.step(n))


def all_reduce_steps(ctx, buf, parts: int = 1):
    """The doubling all-reduce with each exchange cut into ``parts`` chunks, all posted at once,
    each reduced as soon as it has arrived and this rank's copy of it has left (one chunk: plain
    recursive doubling; more: ``pipelined_doubling``)."""
    flat = buf.view(-1)
    p2, rem = _fold.shape(ctx.size)
    yield from _fold.fold_in(ctx, flat, rem)
    me = _fold.new_rank(ctx.rank, rem)
    if me >= 0:
        tmp = torch.empty_like(flat)
        bounds = chunk_bounds(flat.numel(), parts)
        chunks = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        mask = 1
        while mask < p2:
            peer = _fold.real_rank(me ^ mask, rem)
            sends = [ctx.isend(flat[c], peer) for c in chunks]
            recvs = [ctx.irecv(tmp[c], peer) for c in chunks]
            for c, send, recv in zip(chunks, sends, recvs):
                yield [send, recv]  # its copy has left: the chunk may be overwritten
                reduce_(flat[c], tmp[c], ctx.op)  # IEEE + and * commute: both get the same bits
            mask <<= 1
    yield from _fold.fold_out(ctx, flat, rem)


@register_algorithm("recursive_doubling", "all_reduce", cost=_all_reduce_cost, prices_native=True,
                    shares_host_link=True)
def all_reduce(ctx, buf):
    yield from all_reduce_steps(ctx, buf)


@register_algorithm("recursive_doubling", "all_gather", cost=_all_gather_cost, prices_native=True,
                    shares_host_link=True)
def all_gather(ctx, out, inp):
    n, r = inp.numel(), ctx.rank
    flat, mine = out.view(-1), inp.view(-1)
    p2, rem = _fold.shape(ctx.size)
    me = _fold.new_rank(r, rem)
    flat[r * n:(r + 1) * n].copy_(mine)
    if me < 0:  # fold in: no reduction, the odd partner just places our block next to its own
        yield [ctx.isend(mine, r + 1)]
    elif r < 2 * rem:
        yield [ctx.irecv(flat[(r - 1) * n:r * n], r - 1)]
    if me >= 0:
        bounds = [_fold.first_rank(k, rem) * n for k in range(p2 + 1)]
        yield from all_gather_steps(ctx, flat, bounds, me, rem)
    yield from _fold.fold_out(ctx, flat, rem)
