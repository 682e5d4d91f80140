"""A toy all-reduce registered from a test file, as a user (or a new commlib algorithm) would:
one file, one ``register_algorithm`` with its cost and eligibility, nothing else touched.

``toy_pairwise``: every rank sends its whole buffer to every other rank and reduces what arrives
in rank order (so every rank gets bitwise the same result). Its cost claims to beat everything
(a tenth of a microsecond), so that the selector picks it; its eligibility refuses groups of more
than ``MAX_RANKS`` ranks, which shows the rule at work. ``RUNS`` counts its calls."""

import torch

from commlib.algorithms import register_algorithm
from commlib.kernels import reduce_

MAX_RANKS = 3
RUNS = []


def _cost(p, n, link):
    return 1e-7


def _eligible(res, call):
    size = res.engine.size
    return None if size <= MAX_RANKS else f"{size} ranks: the toy handles at most {MAX_RANKS}"


@register_algorithm("toy_pairwise", "all_reduce", cost=_cost, eligible=_eligible)
def all_reduce(ctx, buf):
    RUNS.append(buf.numel())
    flat = buf.view(-1)
    parts = [torch.empty_like(flat) for _ in range(ctx.size)]
    handles = []
    for peer in range(ctx.size):
        if peer != ctx.rank:
            handles += [ctx.irecv(parts[peer], peer), ctx.isend(flat, peer)]
    yield handles
    parts[ctx.rank] = flat.clone()
    flat.copy_(parts[0])
    for part in parts[1:]:
        reduce_(flat, part, ctx.op)
