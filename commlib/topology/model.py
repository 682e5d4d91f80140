"""The topology graph: typed nodes, typed links with bandwidths, and the queries on them.

A :class:`Topology` wraps a ``networkx.Graph``. Nodes are hosts' devices; each node has a ``kind``
and each link a ``type``, a bandwidth in GB/s per direction and a latency class. The bandwidth
constants are NCCL's (``src/graph/topo.h``, NCCL 2.30), so that plans made here rank links the way
NCCL does. Path classes follow NCCL's ``graph.h`` ordering, with nvidia-smi's ``NODE`` (two PCIe
host bridges of one NUMA node, which NCCL folds into PHB) kept apart when the source knows it.

Node ids: ``CPU<k>`` (k-th CPU/NUMA node of the host), ``PCI/<busid>`` (bridges, switches and other
PCI functions), ``GPU<i>`` and ``NIC<i>`` (in the source's order), ``NVS`` (the host's NVSwitch
fabric, one node as in NCCL), and in multi-host topologies ``<host>/`` prefixed ids plus ``NET``
nodes (one per rail).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

import networkx as nx

from ..errors import CommArgumentError, arg_error

__all__ = [
    "Topology", "TopologyError", "TopologyFormatError", "PATH_TYPES", "NODE_KINDS", "LINK_TYPES",
    "nvlink_bw", "pci_bw", "net_bw", "cpu_bw",
]

# --- vocabulary ----------------------------------------------------------------------------------

NODE_KINDS = ("CPU", "PCI", "GPU", "NIC", "NVS", "NET")
#: Path classes best to worst. NCCL's order (graph.h) with nvidia-smi's NODE between PHB and SYS.
PATH_TYPES = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "PHB", "NODE", "SYS", "NET")
PATH_RANK = {p: i for i, p in enumerate(PATH_TYPES)}
#: Link type -> latency class (orders of magnitude of one hop's latency).
LINK_TYPES = {
    "NVL": "nvlink (~1 us)",
    "C2C": "chip-to-chip (~1 us)",
    "PCI": "pcie (~1-2 us)",
    "LOC": "on-board (~0)",
    "SYS": "inter-socket (~1-3 us)",
    "NET": "network (~2-10 us)",
}

# NCCL bandwidth constants, GB/s per direction (topo.h).
_NVLINK_BW = {60: 18.0, 70: 20.0, 80: 20.0, 86: 12.0, 90: 20.6, 100: 40.1}
_NVLINK_GEN = {60: 1, 70: 2, 80: 3, 86: 3, 90: 4, 100: 5}
# "x GT/s" -> NCCL's kvDictPciGen value; bandwidth = width * value / 80.
_PCI_GEN = {"2.5": 15, "5": 30, "8": 60, "16": 120, "32": 240, "64": 480}
_PCI_GEN_NUMBER = {"2.5": 1, "5": 2, "8": 3, "16": 4, "32": 5, "64": 6}
LOC_BW = 5000.0


def nvlink_bw(sm: int | None) -> float:
    """Per-link NVLink bandwidth for a GPU of compute capability ``sm`` (NCCL's table)."""
    if not sm:
        return _NVLINK_BW[70]
    best = max((k for k in _NVLINK_BW if k <= sm), default=60)
    return _NVLINK_BW[best]


def nvlink_gen(sm: int | None) -> int | None:
    if not sm:
        return None
    return _NVLINK_GEN[max((k for k in _NVLINK_GEN if k <= sm), default=60)]


def _speed_key(speed: str | None) -> str | None:
    m = re.match(r"\s*([0-9.]+)", speed or "")
    if not m:
        return None
    value = float(m.group(1))
    return f"{value:g}"


def pci_bw(speed: str | None, width) -> float:
    """PCIe bandwidth as NCCL computes it: ``width * gen / 80`` (width 0 -> 16, unknown -> 60)."""
    try:
        w = int(width)
    except (TypeError, ValueError):
        w = 16
    w = w or 16
    return w * _PCI_GEN.get(_speed_key(speed), 60) / 80.0


def pci_gen(speed: str | None) -> int | None:
    return _PCI_GEN_NUMBER.get(_speed_key(speed))


def net_bw(speed_mbps) -> float:
    """NIC bandwidth from NCCL's ``speed`` attribute (Mb/s; <= 0 means 10000)."""
    try:
        s = float(speed_mbps)
    except (TypeError, ValueError):
        s = 0.0
    return (s if s > 0 else 10000.0) / 8000.0


def cpu_bw(vendor: str | None, modelid, arch: str | None = None) -> float:
    """Inter-socket bandwidth (NCCL's QPI/UPI/xGMI constants)."""
    vendor = (vendor or "").strip()
    if arch == "ppc64":
        return 32.0
    if arch == "arm64":
        return 6.0
    if vendor == "AuthenticAMD":
        return 16.0
    if vendor in ("CentaurHauls", "Shanghai"):
        return 9.0
    try:
        model = int(modelid)
    except (TypeError, ValueError):
        return 10.0  # unknown Intel: Skylake's value
    return {79: 6.0, 85: 10.0, 143: 22.0, 207: 40.0}.get(model, 10.0)


# --- errors --------------------------------------------------------------------------------------

class TopologyError(CommArgumentError):
    """A topology query or plan got an argument it cannot use."""


class TopologyFormatError(TopologyError):
    """A topology file is malformed; the message names the file and the line."""

    def __init__(self, path: str, line: int | None, problem: str, fix: str):
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"commlib.topology.load(): {where}: {problem}. Fix: {fix}")
        self.path, self.line = path, line


# --- the graph -----------------------------------------------------------------------------------

@dataclass
class Diagnostic:
    """One finding about a topology a user should know about."""
    code: str
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


@dataclass(eq=False)
class Topology:
    """A machine (or cluster) as a graph.

    ``graph`` is a ``networkx.Graph``; ``gpus``/``nics`` list node ids in the source's order
    (``gpus[i]`` is GPU i); ``hosts`` names the hosts (one entry for a single machine);
    ``source`` says where it came from; ``notes`` are diagnostics the source recorded while
    reading (assumed values, inconsistencies).
    """

    graph: nx.Graph
    gpus: list[str]
    nics: list[str]
    hosts: list[str] = field(default_factory=lambda: ["localhost"])
    source: str = ""
    notes: list[Diagnostic] = field(default_factory=list)

    # -- construction helpers ---------------------------------------------------------------------
    @property
    def cpus(self) -> list[str]:
        return [n for n, d in self.graph.nodes(data=True) if d["kind"] == "CPU"]

    def nodes(self, kind: str | None = None, host: int | None = None) -> list[str]:
        return [n for n, d in self.graph.nodes(data=True)
                if (kind is None or d["kind"] == kind) and (host is None or d.get("host", 0) == host)]

    def node(self, name) -> dict:
        return self.graph.nodes[self._id(name, "node")]

    def _id(self, name, fn: str) -> str:
        if isinstance(name, int) and not isinstance(name, bool):
            if 0 <= name < len(self.gpus):
                return self.gpus[name]
            raise arg_error(f"Topology.{fn}", "device", name, f"is not a GPU index (0..{len(self.gpus) - 1})",
                            "pass a GPU index or a node id such as 'GPU0', 'NIC1', 'CPU0'", cls=TopologyError)
        if name in self.graph:
            return name
        sample = ", ".join(list(self.graph.nodes)[:6])
        raise arg_error(f"Topology.{fn}", "device", name, "names no node of this topology",
                        f"use one of its node ids (e.g. {sample}, ...)", cls=TopologyError)

    def host_of(self, node: str) -> int:
        return self.graph.nodes[node].get("host", 0)

    def nvlinks(self) -> list[tuple[str, str, dict]]:
        """NVLink edges (GPU-GPU, GPU-NVS, GPU-CPU), each once."""
        return [(a, b, d) for a, b, d in self.graph.edges(data=True) if d["type"] == "NVL"]

    def nvlink_count(self) -> int:
        """Number of NVLink connections as the source lists them: one per ``<nvlink>`` element of
        an NCCL XML, one per ``NV#`` cell of a matrix (GPU i's row), self-links included."""
        return sum(len(self.graph.nodes[g].get("nvlinks", [])) for g in self.gpus)

    # -- tree helpers ------------------------------------------------------------------------------
    def _up(self, node: str) -> list[str]:
        """``node`` and its PCI-tree ancestors up to (and including) its CPU."""
        chain = [node]
        g = self.graph.nodes
        while g[chain[-1]].get("parent") is not None:
            chain.append(g[chain[-1]]["parent"])
        return chain

    def cpu_of(self, node) -> str | None:
        node = self._id(node, "cpu_of")
        chain = self._up(node)
        top = chain[-1]
        return top if self.graph.nodes[top]["kind"] == "CPU" else None

    def numa_of(self, node) -> int:
        cpu = self.cpu_of(node)
        return -1 if cpu is None else int(self.graph.nodes[cpu].get("numaid", -1))

    # -- queries -----------------------------------------------------------------------------------
    def path(self, a, b) -> tuple[str, list[str]]:
        """The best path between two nodes: ``(path class, [nodes])``."""
        return self._path(self._id(a, "path"), self._id(b, "path"))

    def path_type(self, a, b) -> str:
        """NCCL's path class between ``a`` and ``b`` (node ids or GPU indices): LOC, NVL, NVB, C2C,
        PIX, PXB, PHB, NODE (nvidia-smi's; NCCL reads it as PHB), SYS or NET."""
        return self.path(a, b)[0]

    def pcie_type(self, a, b) -> str:
        """The class of the PCIe/CPU path alone (what ``nvidia-smi topo -mp`` shows), ignoring NVLink."""
        a, b = self._id(a, "pcie_type"), self._id(b, "pcie_type")
        if self.host_of(a) != self.host_of(b):
            return "NET"
        return "LOC" if a == b else self._pci_path(a, b)[0]

    def bandwidth(self, a, b) -> float:
        """Bottleneck bandwidth in GB/s (per direction) of the best path between ``a`` and ``b``."""
        kind, nodes = self.path(a, b)
        if kind == "LOC":
            return LOC_BW
        return min(self.graph.edges[u, v]["bw"] for u, v in zip(nodes, nodes[1:]))

    def nvlink_peers(self, gpu) -> dict[str, int]:
        """GPUs reachable from ``gpu`` over one NVLink hop (directly or through an NVSwitch) and the
        link count on ``gpu``'s side."""
        gpu = self._id(gpu, "nvlink_peers")
        out: dict[str, int] = {}
        for nb in self.graph[gpu]:
            d = self.graph.edges[gpu, nb]
            if d["type"] != "NVL" or nb == gpu:
                continue
            kind = self.graph.nodes[nb]["kind"]
            if kind == "GPU":
                out[nb] = out.get(nb, 0) + d.get("count", 1)
            elif kind == "NVS":
                for other in self.graph[nb]:
                    if other != gpu and self.graph.nodes[other]["kind"] == "GPU":
                        out[other] = out.get(other, 0) + d.get("count", 1)
        return out

    @functools.lru_cache(maxsize=None)  # noqa: B019 (a Topology is not mutated after building)
    def _path(self, a: str, b: str) -> tuple[str, list[str]]:
        g = self.graph
        if a == b:
            return "LOC", [a]
        if self.host_of(a) != self.host_of(b):
            return "NET", self._net_path(a, b)
        ka, kb = g.nodes[a]["kind"], g.nodes[b]["kind"]
        if ka == "GPU" and kb == "GPU":
            nv = self._nvlink_path(a, b)
            if nv is not None:
                return nv
        if {ka, kb} == {"GPU", "CPU"}:
            gpu, cpu = (a, b) if ka == "GPU" else (b, a)
            for nb in g[gpu]:
                if nb == cpu and g.edges[gpu, nb]["type"] in ("C2C", "NVL"):
                    return ("C2C" if g.edges[gpu, nb]["type"] == "C2C" else "NVL"), [a, b]
        return self._pci_path(a, b)

    def _nvlink_path(self, a: str, b: str):
        g = self.graph

        def nvl(u, v):
            return g.has_edge(u, v) and g.edges[u, v]["type"] == "NVL"

        if nvl(a, b):
            return "NVL", [a, b]
        best = None
        for mid in sorted(g[a]):
            if mid in (a, b) or not (nvl(a, mid) and nvl(mid, b)):
                continue
            kind = "NVL" if g.nodes[mid]["kind"] == "NVS" else ("NVB" if g.nodes[mid]["kind"] == "GPU" else None)
            if kind is None:
                continue
            bw = min(g.edges[a, mid]["bw"], g.edges[mid, b]["bw"])
            key = (PATH_RANK[kind], -bw)
            if best is None or key < best[0]:
                best = (key, kind, [a, mid, b])
        return None if best is None else (best[1], best[2])

    def _pci_path(self, a: str, b: str) -> tuple[str, list[str]]:
        g = self.graph
        up_a, up_b = self._up(a), self._up(b)
        set_b = {n: i for i, n in enumerate(up_b)}
        lca_i = next((i for i, n in enumerate(up_a) if n in set_b), None)
        if lca_i is not None:
            lca = up_a[lca_i]
            nodes = up_a[:lca_i + 1] + list(reversed(up_b[:set_b[lca]]))
            inner = nodes[1:-1]
            if any(g.nodes[n]["kind"] == "CPU" for n in inner) or g.nodes[lca]["kind"] == "CPU":
                hbs = [n for n in inner if g.nodes[n].get("hostbridge")]
                return ("NODE" if len(hbs) >= 2 else "PHB"), nodes
            if any(g.nodes[n].get("hostbridge") for n in inner):
                return "PHB", nodes
            bridges = [n for n in inner if g.nodes[n]["kind"] in ("PCI", "NVS")]
            return ("PIX" if len(bridges) <= 1 else "PXB"), nodes
        ca, cb = up_a[-1], up_b[-1]
        if g.has_edge(ca, cb):
            return "SYS", up_a + list(reversed(up_b))
        try:
            mid = nx.shortest_path(self._cpu_graph(), ca, cb)
        except (nx.NetworkXNoPath, nx.NodeNotFound):
            return "SYS", up_a + list(reversed(up_b))
        return "SYS", up_a + mid[1:-1] + list(reversed(up_b))

    def _cpu_graph(self) -> nx.Graph:
        return self.graph.edge_subgraph(
            [(u, v) for u, v, d in self.graph.edges(data=True) if d["type"] == "SYS"])

    def _net_path(self, a: str, b: str) -> list[str]:
        """Across hosts: a -> best NIC of a's host -> NET -> NIC of b's host -> b, choosing the NIC
        pair (same rail first) with the highest bottleneck."""
        g = self.graph
        best = None
        for na in self.nodes("NIC", self.host_of(a)):
            for net in sorted(x for x in g[na] if g.nodes[x]["kind"] == "NET"):
                far = [x for x in g[net] if g.nodes[x]["kind"] == "NIC" and self.host_of(x) == self.host_of(b)]
                for nb in sorted(far):
                    left = [a] if a == na else self._path(a, na)[1]
                    right = [b] if b == nb else self._path(nb, b)[1]
                    nodes = left + [net] + right
                    bw = min(g.edges[u, v]["bw"] for u, v in zip(nodes, nodes[1:]))
                    worst = max(PATH_RANK[self._path(a, na)[0]], PATH_RANK[self._path(nb, b)[0]])
                    key = (worst, -bw, len(nodes))
                    if best is None or key < best[0]:
                        best = (key, nodes)
        if best is None:
            raise arg_error("Topology.path", "device", (a, b),
                            "the hosts of these nodes are not joined by a network link",
                            "compose the hosts with commlib.topology.compose(), which adds NICs' network links",
                            cls=TopologyError)
        return best[1]

    # -- summaries ---------------------------------------------------------------------------------
    def summary(self) -> dict:
        return {
            "hosts": len(self.hosts), "gpus": len(self.gpus), "nics": len(self.nics),
            "nvlinks": self.nvlink_count(), "cpus": len(self.cpus),
            "pci": len(self.nodes("PCI")), "nvswitch": len(self.nodes("NVS")),
        }

    def same_graph(self, other: "Topology") -> bool:
        """Same nodes, attributes, edges and device order (what a round trip must keep)."""
        return (self.gpus == other.gpus and self.nics == other.nics
                and _canon(self.graph) == _canon(other.graph))

    def __repr__(self) -> str:
        s = self.summary()
        return (f"<Topology {self.source!r}: {s['hosts']} host(s), {s['gpus']} GPU, {s['nics']} NIC, "
                f"{s['nvlinks']} NVLink, {s['cpus']} CPU/NUMA, {s['pci']} PCI>")

    # Plans, writers and drawing live in their own modules, which register them in _OPERATIONS.
    def ring(self, **kw):
        return _operation("plan_ring")(self, **kw).order

    def ring_plan(self, **kw):
        return _operation("plan_ring")(self, **kw)

    def trees(self, **kw):
        return _operation("plan_trees")(self, **kw)

    def hierarchy(self):
        return _operation("hierarchy")(self)

    def diagnose(self):
        return _operation("diagnose")(self)

    def to_nccl_xml(self, host: int = 0) -> str:
        return _operation("write_xml")(self, host)

    def to_matrix(self, host: int = 0) -> str:
        return _operation("write_matrix")(self, host)

    def to_json(self) -> str:
        return _operation("write_json")(self)

    def draw(self, path: str, host: int | None = None) -> str:
        return _operation("draw")(self, path, host)


# --- operations bound to Topology ----------------------------------------------------------------
# The modules below model (plan, diagnose, nccl_xml, matrix, formats, draw) define the plans, writers
# and the picture; each registers its function here on import, so that model imports none of them.
# commlib/topology/__init__.py imports every one, and importing any submodule runs it first.

#: operation name -> function(topo, ...): plan_ring, plan_trees, hierarchy (plan.py), diagnose,
#: write_xml (nccl_xml.py), write_matrix (matrix.py), write_json (formats.py), draw.
_OPERATIONS: dict[str, Callable] = {}


def register_operation(name: str):
    """Decorator: bind ``fn`` to the :class:`Topology` methods that call operation ``name``."""
    def deco(fn):
        _OPERATIONS[name] = fn
        return fn
    return deco


def _operation(name: str) -> Callable:
    try:
        return _OPERATIONS[name]
    except KeyError:
        raise TopologyError(f"commlib.topology: the Topology operation {name!r} is not registered (registered: "
                            f"{sorted(_OPERATIONS)}). Fix: import commlib.topology, which imports the module "
                            "that registers it") from None


def _canon(g: nx.Graph):
    nodes = sorted((n, json.dumps(d, sort_keys=True, default=str)) for n, d in g.nodes(data=True))
    edges = sorted((tuple(sorted((u, v))), json.dumps(d, sort_keys=True, default=str))
                   for u, v, d in g.edges(data=True))
    return nodes, edges


def iter_pairs(items: Iterable[str]):
    items = list(items)
    for i, a in enumerate(items):
        for b in items[i + 1:]:
            yield a, b
