"""Bytes a rank sends through the parallel layers' collectives, counted as the layers issue them.

``with commlib.nn.functional.traffic() as t: ...`` then ``t.sent`` (bytes) and ``t.by_kind``.
The count is *logical*: what the flat algorithm of each collective sends from this rank, the
convention of the closed forms in docs/tensor-parallel-2d.md, independent of the algorithm the
cost model picks (a tree broadcast forwards through inner ranks; the total is the same):

* broadcast of n bytes over g ranks: the root sends ``(g - 1) * n``, the others nothing;
* reduce: every rank but the root sends ``n``;
* all-reduce: ``2 (g - 1) n / g`` per rank (the ring's);
* all-gather of n bytes per rank: ``(g - 1) * n``; reduce-scatter of an n-byte input:
  ``(g - 1) n / g``.

A group of one rank sends nothing and runs no collective.
"""

from __future__ import annotations

import torch

import commlib
from commlib.api.traffic import Traffic, count as _count, traffic

__all__ = ["Traffic", "traffic", "broadcast", "reduce", "all_reduce", "all_gather",
           "reduce_scatter"]


def broadcast(t: torch.Tensor, root: int, g, async_op: bool = False):
    """Broadcast ``t`` in place from group rank ``root``; a Work (async) or None."""
    if g.size == 1:
        return None
    if g.rank == root:
        _count("broadcast", (g.size - 1) * t.nbytes)
    return commlib.broadcast(t, group=g, group_src=root, async_op=async_op)


def reduce(t: torch.Tensor, root: int, g, async_op: bool = False):
    """Sum ``t`` over the group into group rank ``root``'s ``t``."""
    if g.size == 1:
        return None
    if g.rank != root:
        _count("reduce", t.nbytes)
    return commlib.reduce(t, group=g, group_dst=root, async_op=async_op)


def all_reduce(t: torch.Tensor, g, async_op: bool = False, *, op=commlib.ReduceOp.SUM):
    """Reduce ``t`` over the group with ``op`` (default sum), in place."""
    if g.size == 1:
        return None
    _count("all_reduce", 2 * (g.size - 1) * t.nbytes // g.size)
    return commlib.all_reduce(t, op=op, group=g, async_op=async_op)


def all_gather(out: torch.Tensor, t: torch.Tensor, g, async_op: bool = False):
    """Every rank's ``t`` into ``out`` (``g.size`` times ``t``'s elements) in group-rank order."""
    if g.size == 1:
        out.view(t.shape).copy_(t)
        return None
    _count("all_gather", (g.size - 1) * t.nbytes)
    return commlib.all_gather_into_tensor(out, t, group=g, async_op=async_op)


def reduce_scatter(out: torch.Tensor, t: torch.Tensor, g, async_op: bool = False):
    """``t`` summed over the group, this rank's ``1 / g.size`` of it into ``out``."""
    if g.size == 1:
        out.copy_(t.view(out.shape))
        return None
    _count("reduce_scatter", (g.size - 1) * t.nbytes // g.size)
    return commlib.reduce_scatter_tensor(out, t, group=g, async_op=async_op)
