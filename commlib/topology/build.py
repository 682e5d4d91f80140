"""One builder for every source: CPUs, the PCI tree, GPUs, NICs, NVLinks, C2C.

Readers (NCCL XML, ``nvidia-smi topo -m``, JSON) and live sources (sysfs, NVML) describe devices
and call the builder; the builder derives the typed, weighted links, so that a GPU read from any
source gets the same links for the same facts.

Node attributes hold what the source said (``pci``/``gpu``/``cpu``/``nets`` attribute dicts in
NCCL's vocabulary) so that writers can reproduce it; the links are derived from them.
"""

from __future__ import annotations

import networkx as nx

from .model import (LINK_TYPES, LOC_BW, Diagnostic, Topology, cpu_bw, net_bw, nvlink_bw,
                    nvlink_gen, pci_bw, pci_gen)

GPU_TCLASS, NVS_TCLASS, CPU_TCLASS = "0x030200", "0x068000", "0x068001"


def is_invisible_busid(busid: str) -> bool:
    """NVML reports an NVLink peer it cannot see (an NVSwitch in a VM) as ``FFFFFFFF:FF:FF.0``;
    NCCL writes ``fffffff:ffff:ff``."""
    b = (busid or "").lower().replace(":", "").replace(".", "")
    return not b or set(b) <= {"f"} or b.startswith("ffffffff")


def norm_busid(busid: str) -> str:
    """``00000000:1A:00.0`` (NVML) and ``0000:1a:00.0`` (sysfs/NCCL) -> ``0000:1a:00.0``."""
    b = (busid or "").strip().lower()
    parts = b.split(":")
    if len(parts) == 3 and len(parts[0]) > 4:
        parts[0] = parts[0][-4:]
    return ":".join(parts)


class Builder:
    def __init__(self, source: str, host: int = 0):
        self.g = nx.Graph()
        self.host = host
        self.source = source
        self.gpus: list[str] = []
        self.nics: list[str] = []
        self.notes: list[Diagnostic] = []
        self._busids: dict[str, str] = {}

    # -- nodes -------------------------------------------------------------------------------------
    def _add(self, node: str, **attrs) -> str:
        self.g.add_node(node, host=self.host, **attrs)
        busid = (attrs.get("pci") or {}).get("busid")
        if busid:
            self._busids.setdefault(norm_busid(busid), node)
        return node

    def by_busid(self, busid: str) -> str | None:
        return self._busids.get(norm_busid(busid))

    def cpu(self, cpu_attrs: dict, numaid: int | None = None) -> str:
        k = sum(1 for _n, d in self.g.nodes(data=True) if d["kind"] == "CPU")
        if numaid is None:
            try:
                numaid = int(cpu_attrs.get("numaid", -1))
            except ValueError:
                numaid = -1
        return self._add(f"CPU{k}", kind="CPU", parent=None, numaid=numaid, cpu=dict(cpu_attrs))

    def pci(self, parent: str, pci_attrs: dict, hostbridge: bool = False, **extra) -> str:
        busid = pci_attrs.get("busid") or f"synthetic:{self.g.number_of_nodes()}"
        node = self._add(f"PCI/{busid}", kind="PCI", parent=parent, pci=dict(pci_attrs),
                         hostbridge=hostbridge, **extra)
        self._uplink(node, parent, pci_attrs)
        return node

    def gpu(self, parent: str, pci_attrs: dict, gpu_attrs: dict | None = None, index: int | None = None,
            **extra) -> str:
        node = f"GPU{len(self.gpus) if index is None else index}"
        sm = None
        if gpu_attrs and gpu_attrs.get("sm"):
            sm = int(gpu_attrs["sm"])
        self._add(node, kind="GPU", parent=parent, pci=dict(pci_attrs),
                  gpu=None if gpu_attrs is None else dict(gpu_attrs), sm=sm, nvlinks=[], c2c=[], **extra)
        self.gpus.append(node)
        self._uplink(node, parent, pci_attrs)
        return node

    def nic(self, parent: str, pci_attrs: dict | None, nets: list[dict], has_nic: bool = True,
            index: int | None = None, **extra) -> str:
        node = f"NIC{len(self.nics) if index is None else index}"
        speed = max((net_bw(n.get("speed")) for n in nets), default=None)
        name = next((n.get("name") for n in nets if n.get("name")), None)
        self._add(node, kind="NIC", parent=parent, pci=None if pci_attrs is None else dict(pci_attrs),
                  nets=[dict(n) for n in nets], has_nic=has_nic, bw=speed, name=name, **extra)
        self.nics.append(node)
        if pci_attrs is None:
            self._link(node, parent, "PCI", LOC_BW)
        else:
            self._uplink(node, parent, pci_attrs)
        return node

    # -- links -------------------------------------------------------------------------------------
    def _link(self, a: str, b: str, type_: str, bw: float, **attrs) -> None:
        self.g.add_edge(a, b, type=type_, bw=round(float(bw), 3), latency=LINK_TYPES[type_], **attrs)

    def _uplink(self, node: str, parent: str, pci_attrs: dict) -> None:
        speed, width = pci_attrs.get("link_speed"), pci_attrs.get("link_width")
        self._link(node, parent, "PCI", pci_bw(speed, width), gen=pci_gen(speed),
                   width=int(width) if str(width or "").isdigit() else None)

    def nvlink(self, gpu: str, target: str, count: int, tclass: str) -> None:
        """Record one ``<nvlink>`` of ``gpu`` (target bus id, link count, target class)."""
        self.g.nodes[gpu]["nvlinks"].append({"target": target, "count": int(count), "tclass": tclass})

    def c2c(self, gpu: str, attrs: dict) -> None:
        self.g.nodes[gpu]["c2c"].append(dict(attrs))

    def pcilink(self, pci_node: str, target: str) -> None:
        self.g.nodes[pci_node].setdefault("pcilinks", []).append(target)

    def note(self, code: str, message: str) -> None:
        self.notes.append(Diagnostic(code, message))

    # -- finish ------------------------------------------------------------------------------------
    def _resolve_links(self) -> None:
        g = self.g
        for gpu in self.gpus:
            d = g.nodes[gpu]
            per = nvlink_bw(d["sm"])
            for link in d["nvlinks"]:
                tclass, target = link["tclass"], link["target"]
                peer = None
                if tclass == CPU_TCLASS:
                    peer = self._cpu_above(gpu)
                elif tclass == GPU_TCLASS and not is_invisible_busid(target):
                    peer = self.by_busid(target)
                    if peer is None:
                        self.note("nvlink-peer-missing",
                                  f"{gpu} has an NVLink to GPU {target}, which this source does not list")
                        continue
                    if peer == gpu:
                        self.note("nvlink-self", f"{gpu} lists an NVLink ({link['count']} links) to its own "
                                  f"bus id {target}: ignored for paths (a VM exposing a single GPU?)")
                else:  # an NVSwitch, visible or not (NCCL folds all switches into one NVS node)
                    peer = "NVS"
                    if peer not in g:
                        self._add("NVS", kind="NVS", parent=None)
                    if is_invisible_busid(target):
                        d.setdefault("invisible_nvlinks", 0)
                        d["invisible_nvlinks"] += link["count"]
                if g.has_edge(gpu, peer):
                    e = g.edges[gpu, peer]
                    if peer == "NVS" or g.nodes[peer]["kind"] == "CPU":
                        e["count"] += link["count"]
                    else:
                        e["count"] = min(e["count"], link["count"])
                    e["bw"] = round(e["count"] * per, 3)
                else:
                    self._link(gpu, peer, "NVL", link["count"] * per, count=link["count"],
                               gen=nvlink_gen(d["sm"]))
            for c in d["c2c"]:
                cpu = self._cpu_above(gpu)
                bw = float(c.get("bw", 0)) * int(c.get("count", 1)) / 1000.0
                self._link(gpu, cpu, "C2C", bw, count=int(c.get("count", 1)))
        for node, d in list(g.nodes(data=True)):
            for target in d.get("pcilinks", []):
                peer = self.by_busid(target)
                if peer is not None:
                    self._link(node, peer, "LOC", LOC_BW)

    def _cpu_above(self, node: str) -> str:
        g = self.g
        while g.nodes[node].get("parent") is not None:
            node = g.nodes[node]["parent"]
        return node

    def finish(self, hosts: list[str] | None = None) -> Topology:
        self.gpus.sort(key=lambda n: int(n[3:]))
        self.nics.sort(key=lambda n: int(n[3:]))
        self._resolve_links()
        cpus = [n for n, d in self.g.nodes(data=True) if d["kind"] == "CPU"]
        for i, a in enumerate(cpus):
            for b in cpus[i + 1:]:
                bw = min(self._cpu_bw(a), self._cpu_bw(b))
                self._link(a, b, "SYS", bw)
        return Topology(self.g, list(self.gpus), list(self.nics), hosts or ["localhost"], self.source,
                        list(self.notes))

    def _cpu_bw(self, cpu: str) -> float:
        attrs = self.g.nodes[cpu].get("cpu") or {}
        return cpu_bw(attrs.get("vendor"), attrs.get("modelid"), attrs.get("arch"))


def cpulist_to_mask(cpulist: str) -> str:
    """``0-19,40-59`` -> NCCL's affinity mask ``000000ff,fff00000,000fffff``."""
    cpus = parse_cpulist(cpulist)
    if not cpus:
        return ""
    value = sum(1 << c for c in cpus)
    words = max(1, (max(cpus) // 32) + 1)
    return ",".join(f"{(value >> (32 * i)) & 0xFFFFFFFF:08x}" for i in reversed(range(words)))


def mask_to_cpulist(mask: str) -> str:
    try:
        value = int((mask or "").replace(",", ""), 16)
    except ValueError:
        return ""
    cpus = [i for i in range(value.bit_length()) if value >> i & 1]
    return format_cpulist(cpus)


def parse_cpulist(text: str) -> list[int]:
    out: list[int] = []
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return []
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def format_cpulist(cpus: list[int]) -> str:
    parts, start, prev = [], None, None
    for c in sorted(cpus) + [None]:
        if start is None:
            start = prev = c
        elif c is not None and c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = c
    return ",".join(parts)
