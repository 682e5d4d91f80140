"""Hierarchical all-reduce for groups that span hosts: reduce-scatter inside each host, all-reduce
of each shard across hosts, all-gather inside each host.

With ``local`` ranks on each of ``h`` hosts, every rank sends only ``1/local`` of the buffer across
the (slow) network, and the ``local`` shards cross at once: what a flat algorithm sends between
hosts, divided by the ranks per host. The intra-host stages run commlib's ring over the host's own
communicator (the engine's shared-memory path); the inter-host stage is the engine's native
all-reduce over the communicator of the ranks holding the same shard, one per "rail".

Hosts with different rank counts use one leader per host instead: a binomial reduce to the
host's first rank, the engine's all-reduce among the leaders, a binomial broadcast back. So the
algorithm runs on every layout (on one host it is a ring all-reduce; with one rank per host, the
engine's), and the cost model offers it only where it can win: two or more hosts, more than one
rank on some host.

The layout comes from every rank's host (``commlib.topology.host_hash``, so ``COMMLIB_TEST_HOST``
splits one machine into virtual hosts): all-gathered once per communicator (at group creation,
through the cost model), and the two sub-communicators are built the first time the algorithm
runs (every rank runs it at the same call, as it is the agreed choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..topology.host import host_hash
from . import Ctx, chunk_bounds, register_algorithm
from .binomial import _broadcast, _reduce
from .ring import all_gather_steps, reduce_scatter_steps

__all__ = ["HostLayout", "host_layout"]


@dataclass
class HostLayout:
    """``hosts[k]``: the ranks (of the group) on host k, hosts in order of their lowest rank."""

    hosts: list[list[int]]
    local: object | None = None  # this rank's host's communicator (a Backend), built on first use
    cross: object | None = None  # the communicator of this rank's rail across hosts

    @property
    def uniform(self) -> bool:
        return len({len(h) for h in self.hosts}) == 1

    @property
    def spans_hosts(self) -> bool:
        """Worth a hierarchical algorithm: >= 2 hosts and more than one rank on some host."""
        return len(self.hosts) > 1 and max(len(h) for h in self.hosts) > 1

    @property
    def ranks_per_host(self) -> int:
        return len(self.hosts[0])

    def communicators(self, backend):
        """The intra-host and the rail communicators (collective on first call)."""
        if self.local is None:
            rails = max(len(h) for h in self.hosts)
            self.local = backend.split_lines(self.hosts)
            self.cross = backend.split_lines([[h[i] for h in self.hosts if len(h) > i]
                                              for i in range(rails)])
        return self.local, self.cross


def host_layout(backend) -> HostLayout:
    """The group's host layout (collective on first use, cached on the backend)."""
    layout = getattr(backend, "_host_layout", None)
    if layout is not None:
        return layout
    mine = torch.tensor([host_hash()], dtype=torch.int64)
    every = torch.empty(backend.size, dtype=torch.int64)
    backend.wait([backend.all_gather(every, mine)])
    order: dict[int, list[int]] = {}
    for rank, h in enumerate(every.tolist()):
        order.setdefault(h, []).append(rank)
    layout = backend._host_layout = HostLayout(list(order.values()))
    return layout


@register_algorithm("hierarchical", "all_reduce")
def all_reduce(ctx, buf):
    layout = host_layout(ctx.backend)
    local, cross = layout.communicators(ctx.backend)
    flat = buf.view(-1)
    inner = Ctx(local, local.rank, local.size, ctx.tag, ctx.op)
    if layout.uniform:
        bounds = chunk_bounds(flat.numel(), local.size)
        yield from reduce_scatter_steps(inner, flat, bounds)
        shard = flat[bounds[local.rank]:bounds[local.rank + 1]]
        if shard.numel() and cross.size > 1:
            yield [cross.all_reduce(shard, ctx.op)]
        yield from all_gather_steps(inner, flat, bounds)
    else:  # one leader per host
        yield from _reduce(inner, flat, 0)
        if local.rank == 0:
            yield [cross.all_reduce(flat, ctx.op)]
        yield from _broadcast(inner, flat, 0)
