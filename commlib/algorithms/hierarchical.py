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

The layout is the group's (its resources' ``layout``, from every rank's host when the group was
created: ``commlib.topology.host_hash``, so ``COMMLIB_TEST_HOST`` splits one machine into virtual
hosts), and the two sub-communicators are built the first time the algorithm runs on a group
(every rank runs it at the same call, as it is the agreed choice), kept in the group's resources.
"""

from __future__ import annotations

from .binomial import _broadcast, _reduce
from .registry import Ctx, chunk_bounds, register_algorithm
from .ring import _all_gather_cost, _reduce_scatter_cost, all_gather_steps, reduce_scatter_steps

__all__ = ["communicators"]


def communicators(res):
    """The intra-host and the rail communicators of a group with resources ``res`` (collective
    on first call, then kept in ``res.state``)."""
    pair = res.state.get("hierarchical")
    if pair is None:
        hosts, engine = res.layout.hosts, res.engine
        rails = max(len(h) for h in hosts)
        local = engine.split_lines(hosts)
        cross = engine.split_lines([[h[i] for h in hosts if len(h) > i] for i in range(rails)])
        pair = res.state["hierarchical"] = (local, cross)
    return pair


def _all_reduce_cost(p, local, n, intra, inter, flat):
    """Intra-host ring reduce-scatter, then an all-reduce of each rank's 1/local shard among the
    p/local ranks holding the same shard on other hosts (all shards at once, each with the
    cheapest flat algorithm for its size), then the intra-host all-gather. ``flat``: the
    single-level cost formulas of all_reduce, by name."""
    hosts = p // local
    across = min(fn(hosts, n / local, inter) for fn in flat.values())
    return _reduce_scatter_cost(local, n, intra) + across + _all_gather_cost(local, n, intra)


@register_algorithm("hierarchical", "all_reduce", cost_two_level=_all_reduce_cost)
def all_reduce(ctx, buf):
    layout = ctx.res.layout
    local, cross = communicators(ctx.res)
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
