"""``nvidia-smi topo -m`` (and ``-mp``) text: read it into a graph, and write the matrix back.

Accepted layouts (all seen in the catalog): tab-separated as nvidia-smi prints it, or with tabs
turned into runs of spaces; NIC columns labelled ``NIC<k>`` with a ``NIC Legend`` or with device
names (``mlx5_0``); with or without ``NUMA Affinity`` and ``GPU NUMA ID``; ``-mp`` (PCIe only, no
``NV#``); the old ``SOC`` spelling of ``SYS``.

The matrix gives only the class of the path between two devices, so the reader rebuilds the
smallest PCIe tree that produces exactly those classes: devices that are PIX share a switch, PXB
groups share a switch of switches, PHB groups share a host bridge, NODE groups share a NUMA node,
and SYS separates CPUs. ``NV#`` cells become NVLinks; when every GPU reaches every other over the
same ``NV#`` and that is more links than one GPU has, they go through an NVSwitch (NVS node).
Facts the matrix does not carry (PCIe generation, NIC rate, the GPU generation when there is no
NVLink) are filled with stated defaults and listed in ``Topology.notes``.
"""

from __future__ import annotations

import re

from .build import (GPU_TCLASS, NVS_TCLASS, Builder, cpulist_to_mask, mask_to_cpulist)
from .model import Topology, TopologyFormatError, register_operation

LEVELS = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5, "SOC": 5}
TRAILING = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_NV = re.compile(r"^NV(\d+)$")
_AFFINITY = re.compile(r"^(N/A|[0-9][0-9,\-]*)$")
FIX = "paste the complete output of 'nvidia-smi topo -m' (every row has one cell per column)"


def sniff(text: str) -> bool:
    return _header_index(text.splitlines()) is not None


def _header_index(lines: list[str]):
    for i, line in enumerate(lines):
        toks = line.split()
        if toks and toks[0] == "GPU0" and line[:1] in ("\t", " ") and (len(toks) == 1 or toks[1] != "X"):
            return i
    return None


def parse(text: str, path: str) -> dict:
    """The matrix as data: ``columns``, ``cells[(row, col)]``, per-row ``trailing`` values,
    ``names`` (NIC legend), and the line of each row."""
    lines = text.splitlines()
    h = _header_index(lines)
    if h is None:
        raise TopologyFormatError(path, None, "no 'nvidia-smi topo -m' header (a line starting with "
                                  "whitespace then GPU0) found", FIX)
    header = lines[h]
    tabs = "\t" in header
    cols = [c.strip() for c in header.split("\t")[1:]] if tabs else re.split(r"\s{2,}", header.strip())
    cols = [c for c in cols if c != ""] if not tabs else cols
    devices = []
    for c in cols:
        if c in TRAILING:
            break
        devices.append(c)
    trailing_cols = [c for c in cols[len(devices):] if c]
    n = len(devices)
    cells: dict[tuple[str, str], str] = {}
    trailing: dict[str, dict] = {}
    row_line: dict[str, int] = {}
    i = h + 1
    while i < len(lines) and lines[i].strip() and not lines[i].strip().startswith("Legend"):
        line, lineno = lines[i], i + 1
        if tabs and "\t" in line:
            parts = line.split("\t")
            label, row, rest = parts[0].strip(), [p.strip() for p in parts[1:1 + n]], parts[1 + n:]
        else:
            toks = line.split()
            label, row, rest = toks[0], toks[1:1 + n], toks[1 + n:]
        if label not in devices:
            raise TopologyFormatError(path, lineno, f"row label {label!r} is not a column of the header "
                                      f"({', '.join(devices)})", FIX)
        valid = 0
        for c in row + [""]:
            if c != "X" and c not in LEVELS and not _NV.match(c):
                break
            valid += 1
        if valid < n and (valid == len(row) or _AFFINITY.match(row[valid]) or not row[valid]):
            raise TopologyFormatError(path, lineno, f"row {label!r} has {valid} cells but the header has {n} "
                                      "device columns", FIX)
        for col, cell in zip(devices, row):
            if col == label:
                if cell != "X":
                    raise TopologyFormatError(path, lineno, f"row {label!r}: the diagonal cell is {cell!r}, "
                                              "expected X", FIX)
                continue
            if cell not in LEVELS and not _NV.match(cell):
                raise TopologyFormatError(path, lineno, f"row {label!r}, column {col!r}: unknown path "
                                          f"{cell!r} (expected X, NV#, PIX, PXB, PHB, NODE or SYS)", FIX)
            if cell.startswith("NV") and not (label.startswith("GPU") and col.startswith("GPU")):
                raise TopologyFormatError(path, lineno, f"row {label!r}, column {col!r}: {cell} between "
                                          "devices that are not both GPUs", FIX)
            cell = "SYS" if cell == "SOC" else cell
            other = cells.get((col, label))
            if other is not None and other != cell:
                raise TopologyFormatError(path, lineno, f"cell ({label}, {col}) = {cell} but ({col}, {label}) "
                                          f"= {other}: the matrix must be symmetric", FIX)
            cells[(label, col)] = cell
        trailing[label] = _trailing(rest, trailing_cols, tabs)
        row_line[label] = lineno
        i += 1
    missing = [d for d in devices if d not in row_line]
    if missing:
        raise TopologyFormatError(path, h + 1, f"the header lists {', '.join(missing)} but the matrix has no "
                                  "row for them", FIX)
    names = {}
    for line in lines[i:]:
        m = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)
        if m:
            names[m.group(1)] = m.group(2)
    return {"devices": devices, "cells": cells, "trailing": trailing, "names": names, "lines": row_line,
            "trailing_cols": trailing_cols}


def _trailing(rest: list[str], cols: list[str], tabs: bool) -> dict:
    vals = [r.strip() for r in rest]
    if tabs:
        # nvidia-smi writes an empty cell before GPU NUMA ID: "cpus<TAB>numa<TAB><TAB>N/A".
        out = {}
        if "CPU Affinity" in cols and vals:
            out["CPU Affinity"] = vals[0]
        if "NUMA Affinity" in cols and len(vals) > 1:
            out["NUMA Affinity"] = vals[1]
        if "GPU NUMA ID" in cols and len(vals) > 2:
            out["GPU NUMA ID"] = vals[-1]
        return out
    return dict(zip(cols, vals))


class _Union:
    def __init__(self, items):
        self.p = {x: x for x in items}

    def find(self, x):
        while self.p[x] != x:
            self.p[x] = self.p[self.p[x]]
            x = self.p[x]
        return x

    def join(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.p[max(ra, rb, key=str)] = min(ra, rb, key=str)


def _groups(members: list[str], joined) -> list[list[str]]:
    """Single-linkage groups of ``members`` (order kept) under the predicate ``joined``."""
    u = _Union(members)
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            if joined(a, b):
                u.join(a, b)
    out: dict[str, list[str]] = {}
    for m in members:
        out.setdefault(u.find(m), []).append(m)
    return list(out.values())


def read_matrix(text: str, path: str) -> Topology:
    m = parse(text, path)
    devices, cells = m["devices"], m["cells"]
    gpus = [d for d in devices if d.startswith("GPU")]
    nics = [d for d in devices if d not in gpus]
    level = {}
    for (a, b), c in cells.items():
        if c in LEVELS:
            level[(a, b)] = LEVELS[c]

    def within(limit):
        return lambda a, b: level.get((a, b), 99) <= limit

    b = Builder(f"nvidia-smi:{path}")
    nv = {k: int(_NV.match(c).group(1)) for k, c in cells.items() if _NV.match(c)}
    sm, switched = _infer_nvlink(gpus, nv)
    pcie = {90: ("32.0 GT/s PCIe", "16"), 80: ("16.0 GT/s PCIe", "16")}.get(sm or 0, ("8 GT/s", "16"))
    b.note("assumed", f"PCIe links assumed {pcie[0]} x{pcie[1]}, inter-socket bandwidth NCCL's default; "
           "NIC rate 100 Gb/s (a topo -m matrix does not carry them)")
    if sm:
        b.note("assumed", f"GPU generation sm{sm} inferred from the NVLink counts")
    numa = {}
    for d in devices:
        v = m["trailing"][d].get("NUMA Affinity", "")
        numa[d] = int(v) if v.isdigit() else None
    domains = _groups(devices, within(4))
    domains.sort(key=lambda grp: (min((numa[d] for d in grp if numa[d] is not None), default=1 << 20),
                                  devices.index(grp[0])))
    seen_numa: dict[int, list[str]] = {}
    busid = {}
    for k, d in enumerate(gpus):
        busid[d] = f"{k + 1:04x}:00:00.0"
    for k, d in enumerate(x for x in devices if x not in gpus):
        busid[d] = f"{0x101 + k:04x}:00:00.0"
    counter = iter(range(1, 1 << 16))

    def switch(parent, hostbridge=False):
        n = next(counter)
        bus = f"ffff:{'fe' if hostbridge else 'ff'}:{n >> 8:02x}.{n & 0xff:x}" if n > 255 else \
            f"ffff:{'fe' if hostbridge else 'ff'}:{n:02x}.0"
        return b.pci(parent, {"busid": bus, "class": "0x060400", "link_speed": pcie[0], "link_width": pcie[1]},
                     hostbridge=hostbridge)

    def device(parent, d):
        attrs = {"busid": busid[d], "class": "0x030200" if d in gpus else "0x020000",
                 "link_speed": pcie[0], "link_width": pcie[1]}
        if d in gpus:
            gattrs = {"dev": str(gpus.index(d))}
            if sm:
                gattrs["sm"] = str(sm)
            b.gpu(parent, attrs, gattrs, index=gpus.index(d))
        else:
            k = nics.index(d)
            b.nic(parent, attrs, [{"name": m["names"].get(d, d), "dev": str(k), "speed": "100000"}], index=k)

    for grp in domains:
        ids = {numa[d] for d in grp if numa[d] is not None}
        numaid = ids.pop() if len(ids) == 1 else -1
        if len(ids) > 1:
            b.note("numa-inconsistent", f"{', '.join(grp)} report NUMA nodes {sorted(ids)} but no "
                   "pair of them is SYS apart: the NUMA column is not trustworthy here; NUMA set to -1")
        cpus = next((m["trailing"][d].get("CPU Affinity") for d in grp if m["trailing"][d].get("CPU Affinity")), "")
        attrs = {"numaid": str(numaid)}
        if cpus:
            attrs["affinity"] = cpulist_to_mask(cpus)
        cpu = b.cpu(attrs, numaid)
        if numaid >= 0:
            seen_numa.setdefault(numaid, []).append(cpu)
        hbs = _groups(grp, within(3))
        for hb in hbs:
            parent = switch(cpu, hostbridge=True) if len(hbs) > 1 else cpu
            for pxb in _groups(hb, within(2)):
                if len(pxb) == 1:
                    device(parent, pxb[0])
                    continue
                top = switch(parent)
                pixes = _groups(pxb, within(1))
                for pix in pixes:
                    if len(pixes) == 1:
                        for d in pix:
                            device(top, d)
                        continue
                    sw = switch(top)
                    for d in pix:
                        device(sw, d)
    topo_nodes = {g: f"GPU{k}" for k, g in enumerate(gpus)}
    for n, cpus in seen_numa.items():
        if len(cpus) > 1:
            b.note("numa-inconsistent", f"devices on NUMA node {n} are SYS apart from each other: the matrix's "
                   "NUMA column is not trustworthy here (a VM?); SYS is kept as the path class")
    for (a, c), k in nv.items():
        if switched:
            continue
        b.nvlink(topo_nodes[a], busid[c], k, GPU_TCLASS)
    if switched:
        for g in gpus:
            k = max(v for (a, _c), v in nv.items() if a == g)
            b.nvlink(topo_nodes[g], "fffffff:ffff:ff", k, NVS_TCLASS)
    topo = b.finish()
    return topo


def _infer_nvlink(gpus, nv):
    """(sm, switched): the GPU generation from per-GPU link totals, and whether the NVLinks go
    through an NVSwitch (every pair NV-connected with the same count, more links than a GPU has)."""
    if not nv:
        return None, False
    n = len(gpus)
    counts = set(nv.values())
    totals = [sum(v for (a, _c), v in nv.items() if a == g) for g in gpus]
    switched = (n >= 3 and len(nv) == n * (n - 1) and len(counts) == 1 and max(totals) > 18)
    per_gpu = counts.pop() if switched else max(totals)
    sm = 60 if per_gpu <= 4 else 70 if per_gpu <= 6 else 80 if per_gpu <= 12 else 90
    return sm, switched


@register_operation("write_matrix")
def write_matrix(topo: Topology, host: int = 0) -> str:
    """The ``nvidia-smi topo -m`` table for one host: NV# where GPUs share NVLinks, otherwise the
    PCIe path class (NODE kept where the source knows host bridges)."""
    g = topo.graph
    gpus = [x for x in topo.gpus if g.nodes[x].get("host", 0) == host]
    nics = [x for x in topo.nics if g.nodes[x].get("host", 0) == host]
    local = {x: x.split("/")[-1] for x in gpus + nics}
    head = [local[x] for x in gpus + nics]
    rows = ["\t" + "\t".join(head + ["CPU Affinity", "NUMA Affinity"])]
    for a in gpus + nics:
        peers = topo.nvlink_peers(a) if a in gpus else {}
        cells = []
        for b in gpus + nics:
            if a == b:
                cells.append(" X ")
            elif b in peers:
                cells.append(f"NV{peers[b]}")
            else:
                cells.append(topo.pcie_type(a, b))
        tail = ["", ""]
        if a in gpus:
            cpu = topo.cpu_of(a)
            attrs = g.nodes[cpu].get("cpu") or {}
            numaid = g.nodes[cpu].get("numaid", -1)
            tail = [mask_to_cpulist(attrs.get("affinity", "")), str(numaid) if numaid >= 0 else "N/A"]
        rows.append("\t".join([local[a]] + cells + tail))
    legend = ["", "Legend:", "", "  X    = Self",
              "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)",
              "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a "
              "NUMA node",
              "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
              "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)",
              "  PIX  = Connection traversing at most a single PCIe bridge",
              "  NV#  = Connection traversing a bonded set of # NVLinks"]
    if nics:
        legend += ["", "NIC Legend:", ""]
        legend += [f"  {local[n]}: {g.nodes[n].get('name') or local[n]}" for n in nics]
    return "\n".join(rows + legend) + "\n"
