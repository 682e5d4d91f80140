"""Ring: reduce-scatter then all-gather around the ring (Patarasuk & Yuan 2009).

Each rank sends and receives 2(p-1)/p of the buffer in 2(p-1) steps, the bandwidth optimum;
latency grows with p. Chunks come from ``chunk_bounds``, so any element count works (chunks may be
empty when there are fewer elements than ranks). Rank r ends the reduce-scatter owning chunk r.
"""

from __future__ import annotations

import torch

from ..kernels import reduce_
from .registry import chunk_bounds, register_algorithm


def _chunk(flat, bounds, i):
    return flat[bounds[i]:bounds[i + 1]]


def reduce_scatter_steps(ctx, flat, bounds):
    """p-1 steps; afterwards chunk ``ctx.rank`` of ``flat`` holds the reduction of all ranks'."""
    p, r = ctx.size, ctx.rank
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send = _chunk(flat, bounds, (r - s - 1) % p)
        into = _chunk(flat, bounds, (r - s - 2) % p)
        tmp = torch.empty_like(into)
        yield [ctx.isend(send, right), ctx.irecv(tmp, left)]
        reduce_(into, tmp, ctx.op)


def all_gather_steps(ctx, flat, bounds):
    """p-1 steps; rank r starts owning chunk r and ends with every chunk."""
    p, r = ctx.size, ctx.rank
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send = _chunk(flat, bounds, (r - s) % p)
        into = _chunk(flat, bounds, (r - s - 1) % p)
        yield [ctx.isend(send, right), ctx.irecv(into, left)]


def _all_reduce_cost(p, n, link):
    """2(p-1) steps of n/p bytes; (p-1)/p of the buffer reduced."""
    return 2 * (p - 1) * link.step(n / p) + (p - 1) / p * n * link.gamma


def _reduce_scatter_cost(p, n, link):
    return (p - 1) * link.step(n / p) + (p - 1) / p * n * link.gamma


def _all_gather_cost(p, n, link):
    return (p - 1) * link.step(n / p)


@register_algorithm("ring", "all_reduce", cost=_all_reduce_cost, prices_native=True)
def all_reduce(ctx, buf):
    flat = buf.view(-1)
    bounds = chunk_bounds(flat.numel(), ctx.size)
    yield from reduce_scatter_steps(ctx, flat, bounds)
    yield from all_gather_steps(ctx, flat, bounds)


@register_algorithm("ring", "reduce_scatter", cost=_reduce_scatter_cost, prices_native=True)
def reduce_scatter(ctx, out, inp):
    n = out.numel()
    work = inp.reshape(-1).clone()  # the caller's input stays as it was
    yield from reduce_scatter_steps(ctx, work, [i * n for i in range(ctx.size + 1)])
    out.view(-1).copy_(work[ctx.rank * n:(ctx.rank + 1) * n])


@register_algorithm("ring", "all_gather", cost=_all_gather_cost, prices_native=True)
def all_gather(ctx, out, inp):
    n = inp.numel()
    flat = out.view(-1)
    flat[ctx.rank * n:(ctx.rank + 1) * n].copy_(inp.view(-1))
    yield from all_gather_steps(ctx, flat, [i * n for i in range(ctx.size + 1)])
