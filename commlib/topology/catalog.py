"""The catalog of real systems (``topology/`` at the repository root) and multi-host composition.

The catalog ships inside the package as ``commlib/topology/catalog`` (a link to the repository's
``topology/`` directory, packaged as package data), so ``load_catalog("dgx-a100")`` works from a
source tree and from an installed wheel. Each file keeps, as its first line, the public source it
was taken from.

``compose`` joins host topologies into a cluster: node ids get a ``<host>/`` prefix and NIC k of
every host is joined to rail switch ``NET/rail<k>`` (a rail-optimized fabric) with the NIC's rate.
``cluster("hgx-h100-8", 16, nics_per_host=8, nic_gbps=400)`` plans machines you do not have.
"""

from __future__ import annotations

import os
import pathlib

import networkx as nx

from ..errors import arg_error
from .build import LINK_TYPES
from .formats import load
from .model import Topology, TopologyError, net_bw

_HERE = pathlib.Path(__file__).resolve().parent


def catalog_dir() -> pathlib.Path:
    """Where the catalog lives: the packaged copy, else the repository's ``topology/``."""
    for cand in (_HERE / "catalog", _HERE.parents[1] / "topology"):
        if cand.is_dir():
            return cand
    raise TopologyError("commlib.topology.catalog_dir(): the catalog is not installed. Fix: reinstall "
                        "commlib (it ships as package data under commlib/topology/catalog)")


def catalog_names() -> list[str]:
    """System names in the catalog (file names without extension; NCCL graph files excluded)."""
    return sorted(p.name.split(".")[0] for p in catalog_dir().iterdir()
                  if p.is_file() and ".graph." not in p.name and p.suffix in (".xml", ".txt", ".json"))


def catalog_path(name: str) -> pathlib.Path:
    for p in sorted(catalog_dir().iterdir()):
        if p.name.split(".")[0] == name and ".graph." not in p.name:
            return p
    raise arg_error("topology.load_catalog", "name", name, "is not in the catalog",
                    f"use one of {catalog_names()}", cls=TopologyError)


def load_catalog(name: str) -> Topology:
    """A catalog system's topology by name (e.g. ``'dgx-a100'``)."""
    return load(catalog_path(name))


def source_line(name: str) -> str:
    return catalog_path(name).read_text().splitlines()[0]


def _add_rail_nics(topo: Topology, count: int, gbps: float) -> tuple[nx.Graph, list[str]]:
    """Replace a host's NICs by ``count`` NICs, NIC k beside GPU k (k < GPUs), as on rail-optimized
    nodes (one NIC per GPU under the GPU's PCIe switch)."""
    g = topo.graph.copy()
    g.remove_nodes_from(topo.nics)
    nics = []
    for k in range(count):
        gpu = topo.gpus[k % len(topo.gpus)] if topo.gpus else topo.cpus[0]
        parent = g.nodes[gpu].get("parent") or gpu
        node = f"NIC{k}"
        g.add_node(node, kind="NIC", host=0, parent=parent,
                   pci={"busid": f"{0x201 + k:04x}:00:00.0", "class": "0x020700", "link_speed": "32.0 GT/s PCIe",
                        "link_width": "16"},
                   nets=[{"name": f"ib{k}", "dev": str(k), "speed": str(int(gbps * 1000))}], has_nic=True,
                   bw=net_bw(gbps * 1000), name=f"ib{k}", synthetic=True)
        g.add_edge(node, parent, type="PCI", bw=48.0, latency=LINK_TYPES["PCI"], gen=5, width=16)
        nics.append(node)
    return g, nics


def compose(topos: list[Topology], names: list[str] | None = None, nics_per_host: int | None = None,
            nic_gbps: float | None = None) -> Topology:
    """Join single-host topologies into one cluster, NIC k of each host on rail k."""
    if not topos:
        raise arg_error("topology.compose", "topos", topos, "is empty", "pass at least one Topology",
                        cls=TopologyError)
    names = names or [f"{(t.hosts or ['host'])[0]}#{i}" for i, t in enumerate(topos)]
    if len(set(names)) != len(names):
        raise arg_error("topology.compose", "names", names, "must be distinct", "give every host its own name",
                        cls=TopologyError)
    g = nx.Graph()
    gpus, nics = [], []
    for h, (t, name) in enumerate(zip(topos, names)):
        if len({t.host_of(n) for n in t.graph}) > 1:
            raise arg_error("topology.compose", "topos", t, "is already a multi-host topology",
                            "compose single-host topologies", cls=TopologyError)
        if nics_per_host is not None:
            sub, local_nics = _add_rail_nics(t, nics_per_host, nic_gbps or 400)
        else:
            sub, local_nics = t.graph.copy(), list(t.nics)
            if nic_gbps:
                for n in local_nics:
                    sub.nodes[n]["bw"] = net_bw(nic_gbps * 1000)
        mapping = {n: f"{name}/{n}" for n in sub}
        sub = nx.relabel_nodes(sub, mapping)
        for _n, d in sub.nodes(data=True):
            d["host"] = h
            if d.get("parent") is not None:
                d["parent"] = mapping[d["parent"]]
        g.update(sub)
        gpus += [mapping[x] for x in t.gpus]
        nics_h = [mapping[x] for x in local_nics]
        nics += nics_h
        for k, nic in enumerate(nics_h):
            rail = f"NET/rail{k}"
            if rail not in g:
                g.add_node(rail, kind="NET", host=-1, parent=None, rail=k)
            g.add_edge(nic, rail, type="NET", bw=round(g.nodes[nic].get("bw") or net_bw(0), 3),
                       latency=LINK_TYPES["NET"], rail=k)
    src = "compose:" + ",".join(sorted({t.source for t in topos}))
    notes = [n for t in topos[:1] for n in t.notes]
    return Topology(g, gpus, nics, list(names), src, notes)


def cluster(name: str, hosts: int, nics_per_host: int | None = None, nic_gbps: float | None = None) -> Topology:
    """``hosts`` copies of catalog system ``name`` joined by a rail-optimized network."""
    if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1:
        raise arg_error("topology.cluster", "hosts", hosts, "must be a positive int", "pass e.g. 16",
                        cls=TopologyError)
    one = load_catalog(name)
    return compose([one] * hosts, [f"{name}-{i}" for i in range(hosts)], nics_per_host, nic_gbps)


def catalog_files() -> list[str]:
    return sorted(os.listdir(catalog_dir()))
