"""Hierarchical all-reduce for groups that span hosts: reduce-scatter inside each host, all-reduce
of each shard across hosts, all-gather inside each host.

With ``local`` ranks on each of ``h`` hosts, every rank sends only ``1/local`` of the buffer across
the (slow) network, and the ``local`` shards cross at once: what a flat algorithm sends between
hosts, divided by the ranks per host. The intra-host stages run commlib's ring over the host's own
communicator (the engine's shared-memory path); the inter-host stage is the engine's native
all-reduce over the communicator of the ranks holding the same shard, one per "rail".

The layout comes from every rank's host (``commlib.topology.host_hash``, so ``COMMLIB_TEST_HOST``
splits one machine into virtual hosts): it is all-gathered once per communicator, the first time a
selector or this algorithm asks, and the two sub-communicators are built then. It needs the same
number of ranks on every host, at least two hosts, and more than one rank per host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CommUnsupportedError
from ..topology.host import host_hash
from . import Ctx, chunk_bounds, register_algorithm
from .ring import all_gather_steps, reduce_scatter_steps

__all__ = ["HostLayout", "host_layout"]


@dataclass
class HostLayout:
    """``hosts[k]``: the ranks (of the group) on host k, hosts in order of their lowest rank."""

    hosts: list[list[int]]
    local: object | None = None  # this rank's host's communicator (a Backend)
    cross: object | None = None  # the communicator of this rank's rail across hosts

    @property
    def uniform(self) -> bool:
        sizes = {len(h) for h in self.hosts}
        return len(sizes) == 1

    @property
    def eligible(self) -> bool:
        """Can the hierarchical algorithm run: >= 2 hosts, the same >= 2 ranks on each."""
        return len(self.hosts) > 1 and self.uniform and len(self.hosts[0]) > 1

    @property
    def ranks_per_host(self) -> int:
        return len(self.hosts[0])


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
    layout = HostLayout(list(order.values()))
    if layout.eligible:
        local_n = layout.ranks_per_host
        layout.local = backend.split_lines(layout.hosts)
        layout.cross = backend.split_lines([[host[i] for host in layout.hosts] for i in range(local_n)])
    backend._host_layout = layout
    return layout


@register_algorithm("hierarchical", "all_reduce")
def all_reduce(ctx, buf):
    layout = host_layout(ctx.backend)
    if not layout.eligible:
        sizes = [len(h) for h in layout.hosts]
        raise CommUnsupportedError(
            f"commlib.all_reduce: algorithm 'hierarchical' needs at least two hosts with the same "
            f"number (>= 2) of ranks each; this group has ranks per host {sizes}. Fix: use "
            f"algorithm=None (automatic) or a flat algorithm such as 'rabenseifner'.")
    local, cross = layout.local, layout.cross
    flat = buf.view(-1)
    bounds = chunk_bounds(flat.numel(), local.size)
    inner = Ctx(local, local.rank, local.size, ctx.tag, ctx.op)
    yield from reduce_scatter_steps(inner, flat, bounds)
    shard = flat[bounds[local.rank]:bounds[local.rank + 1]]
    if shard.numel():
        yield [cross.all_reduce(shard, ctx.op)]
    yield from all_gather_steps(inner, flat, bounds)
