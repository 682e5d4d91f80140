"""Planning for machines you don't have: a topology graph -> the cost model's :class:`Table`.

For a GPU system (one host from the catalog, or a cluster composed of them):

* the intra-host link is the planned ring's bottleneck inside one host (``Topology.ring_plan``:
  e.g. 370.8 GB/s through an H100 NVSwitch, 240 GB/s on A100, 40 GB/s on a DGX-1's NVLink ring)
  with the per-hop latency of its path class;
* the inter-host link, for clusters, is what one rail carries (the cluster ring's bottleneck across
  a host boundary: the NIC, or its PCIe link) times the rails a host drives at once: NCCL runs one
  channel per NIC, so a flat ring crosses each host boundary on every rail together; hierarchical
  algorithms run one ring per rail, each GPU's shard on its rail.

This is how ``python -m commlib.tuning --topology hgx-h100-8 --nodes 16`` predicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CommArgumentError, arg_error
from ..topology import PATH_TYPES, Topology, cluster, compose, load_catalog
from .model import BASE_LATENCY_GPU, HOP_LATENCY_US, LinkCost, Table

__all__ = ["MachinePlan", "plan_machine"]


@dataclass
class MachinePlan:
    """A described machine and the model table derived from it."""

    name: str
    hosts: int
    gpus_per_host: int
    intra_gbps: float    # GB/s per direction of the intra-host ring
    intra_class: str     # worst path class on that ring
    rails: int           # NICs per host used at once
    rail_gbps: float     # GB/s per direction of one rail
    table: Table

    @property
    def ranks(self) -> int:
        return self.hosts * self.gpus_per_host

    def describe(self) -> str:
        text = (f"{self.hosts} x {self.name}: {self.ranks} GPUs; intra-host ring "
                f"{self.intra_gbps:.1f} GB/s ({self.intra_class})")
        if self.hosts > 1:
            text += f"; {self.rails} rails x {self.rail_gbps:.1f} GB/s between hosts"
        return text


def _link(gbps: float, path_class: str) -> LinkCost:
    return LinkCost.from_bandwidth(HOP_LATENCY_US.get(path_class, 1.0), gbps)


def plan_machine(system: str | Topology, nodes: int = 1, nics_per_host: int | None = None,
                 nic_gbps: float | None = None) -> MachinePlan:
    """The model of ``nodes`` hosts of catalog ``system`` (or a single-host :class:`Topology`)."""
    fn = "tuning.plan_machine"
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise arg_error(fn, "nodes", nodes, "must be a positive int", "pass e.g. --nodes 16")
    one = load_catalog(system) if isinstance(system, str) else system
    name = system if isinstance(system, str) else one.source
    if not one.gpus:
        raise arg_error(fn, "system", name, "has no GPUs to plan collectives for",
                        "pick a GPU system from commlib.topology.catalog_names()", CommArgumentError)
    ring = one.ring_plan()
    worst = max((h[2] for h in ring.hops), key=_class_rank, default="LOC")
    intra = _link(ring.bandwidth, worst) if len(one.gpus) > 1 else LinkCost(0.0, 0.0)
    g = len(one.gpus)
    if nodes == 1:
        return MachinePlan(name, 1, g, ring.bandwidth, worst, len(one.nics), 0.0,
                           Table(intra, local=g, base=BASE_LATENCY_GPU))
    if isinstance(system, str):
        many = cluster(system, nodes, nics_per_host, nic_gbps)
    else:
        many = compose([one] * nodes, [f"host{i}" for i in range(nodes)], nics_per_host, nic_gbps)
    rails = len([n for n in many.nics if many.host_of(n) == 0])
    if rails == 0:
        raise arg_error(fn, "nics_per_host", nics_per_host, f"leaves {name} without NICs",
                        "pass --nics-per-host N (and --nic-gbps)", CommArgumentError)
    cross = [h for h in many.ring_plan().hops if h[2] == "NET"]
    rail_gbps = min(h[3] for h in cross)
    # A flat ring's host boundary carries every rail at once, capped by the intra-host ring.
    inter = _link(min(rails * rail_gbps, ring.bandwidth), "NET")
    # The hierarchical inter stage: one ring per GPU shard, shards sharing rails when fewer.
    per_shard = _link(rail_gbps * min(rails, g) / g, "NET")
    table = Table(intra, local=g, inter=inter, base=BASE_LATENCY_GPU, shard_inter=per_shard)
    return MachinePlan(name, nodes, g, ring.bandwidth, worst, rails, rail_gbps, table)


def _class_rank(path_class: str) -> int:
    return PATH_TYPES.index(path_class) if path_class in PATH_TYPES else len(PATH_TYPES)
