"""NCCL topology XML (``NCCL_TOPO_FILE``) and graph XML (``NCCL_GRAPH_FILE``): read and write.

The grammar is NCCL's (xml.cc handler tables, ``NCCL_TOPO_XML_VERSION`` 1)::

    system > cpu > (pci | nic);  pci > (pci | gpu | nic | pcilink);  gpu > (nvlink | c2c);  nic > net
    graphs > graph > channel > (net | gpu)

A ``<pci>`` is a GPU when its class is 0x03xxxx and a NIC when it is 0x02xxxx, with or without a
``<gpu>``/``<nic>`` child (skeleton files such as Azure's list bare PCI functions and let NCCL fill
in the rest). Elements outside the grammar are errors that name the file and line, as are XML
syntax errors (a truncated file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from xml.parsers import expat
from xml.sax.saxutils import quoteattr

from .build import CPU_TCLASS, GPU_TCLASS, NVS_TCLASS, Builder
from .model import Topology, TopologyFormatError, register_operation

#: (parent tag, child tag) pairs NCCL accepts. ``None`` is the document root.
GRAMMAR = {
    None: {"system", "graphs"},
    "system": {"cpu"},
    "cpu": {"pci", "nic"},
    "pci": {"pci", "gpu", "nic", "pcilink"},
    "gpu": {"nvlink", "c2c"},
    "nic": {"net"},
    "graphs": {"graph"},
    "graph": {"channel"},
    "channel": {"net", "gpu"},
}
FIX = "compare the file with NCCL's topology format (docs/topology.md) or dump a fresh one with NCCL_TOPO_DUMP_FILE"


@dataclass
class XEl:
    tag: str
    attrs: dict
    line: int
    children: list["XEl"] = field(default_factory=list)


def parse_tree(text: str, path: str) -> XEl:
    """Parse ``text`` into :class:`XEl` nodes carrying their line numbers; check the grammar."""
    parser = expat.ParserCreate()
    stack: list[XEl] = []
    root: list[XEl] = []

    def start(tag, attrs):
        parent = stack[-1].tag if stack else None
        line = parser.CurrentLineNumber
        if tag not in GRAMMAR.get(parent, set()):
            allowed = ", ".join(f"<{t}>" for t in sorted(GRAMMAR.get(parent, set()))) or "no elements"
            where = f"inside <{parent}>" if parent else "as the root element"
            raise TopologyFormatError(path, line, f"unknown element <{tag}> {where} (allowed: {allowed})", FIX)
        el = XEl(tag, dict(attrs), line)
        (stack[-1].children if stack else root).append(el)
        stack.append(el)

    parser.StartElementHandler = start
    parser.EndElementHandler = lambda tag: stack.pop()
    try:
        parser.Parse(text, True)
    except expat.ExpatError as exc:
        raise TopologyFormatError(path, exc.lineno, f"malformed XML: {expat.ErrorString(exc.code)} "
                                  f"(column {exc.offset + 1})",
                                  "the file is truncated or not XML; restore the complete file") from None
    if not root:
        raise TopologyFormatError(path, None, "no XML element found", FIX)
    return root[0]


def _class(attrs: dict) -> str:
    return (attrs.get("class") or "").lower()


def read_topology(text: str, path: str) -> Topology:
    root = parse_tree(text, path)
    if root.tag != "system":
        raise TopologyFormatError(path, root.line, f"<{root.tag}> is an NCCL graph file (NCCL_GRAPH_FILE), "
                                  "not a topology", "read it with commlib.topology.load_graphs()")
    if root.attrs.get("version", "1") != "1":
        raise TopologyFormatError(path, root.line, f"<system version={root.attrs.get('version')!r}>: only "
                                  "version 1 is defined", "use an NCCL_TOPO_XML_VERSION 1 file")
    b = Builder(f"nccl-xml:{path}")
    b.g.graph["system"] = dict(root.attrs)
    for cpu_el in root.children:
        cpu = b.cpu(cpu_el.attrs)
        for child in cpu_el.children:
            _read_child(b, cpu, child, path)
    return b.finish()


def _read_child(b: Builder, parent: str, el: XEl, path: str) -> None:
    if el.tag == "nic":
        b.nic(parent, None, [n.attrs for n in el.children])
        return
    if el.tag == "pcilink":
        b.pcilink(parent, el.attrs.get("target", ""))
        return
    if el.tag != "pci":
        raise TopologyFormatError(path, el.line, f"<{el.tag}> must be inside a GPU's <pci>", FIX)
    if b.by_busid(el.attrs.get("busid", "")) is not None:
        raise TopologyFormatError(path, el.line, f"bus id {el.attrs.get('busid')} appears twice",
                                  "give every <pci> a distinct busid")
    cls = _class(el.attrs)
    gpu_el = next((c for c in el.children if c.tag == "gpu"), None)
    nic_el = next((c for c in el.children if c.tag == "nic"), None)
    if cls.startswith("0x03") or gpu_el is not None:
        node = b.gpu(parent, el.attrs, None if gpu_el is None else gpu_el.attrs)
        for c in (gpu_el.children if gpu_el is not None else []):
            if c.tag == "nvlink":
                try:
                    count = int(c.attrs.get("count", "1"))
                except ValueError:
                    raise TopologyFormatError(path, c.line, f"<nvlink count={c.attrs.get('count')!r}> is not "
                                              "an integer", "write the number of links") from None
                b.nvlink(node, c.attrs.get("target", ""), count, c.attrs.get("tclass", GPU_TCLASS).lower())
            else:
                b.c2c(node, c.attrs)
        rest = [c for c in el.children if c.tag != "gpu"]
    elif cls.startswith("0x02") or nic_el is not None:
        nets = [n.attrs for n in nic_el.children] if nic_el is not None else []
        node = b.nic(parent, el.attrs, nets, has_nic=nic_el is not None)
        rest = [c for c in el.children if c.tag != "nic"]
    else:
        node = b.pci(parent, el.attrs)
        rest = el.children
    for child in rest:
        _read_child(b, node, child, path)


# --- graph files ---------------------------------------------------------------------------------

@dataclass
class NcclGraph:
    """One ``<graph>`` of an NCCL graph file: its attributes and channels (lists of
    ``("gpu"|"net", dev)``)."""
    attrs: dict
    channels: list[list[tuple[str, int]]]

    PATTERNS = {1: "BALANCED_TREE", 2: "SPLIT_TREE", 3: "TREE", 4: "RING", 5: "NVLS", 6: "COLLNET_DIRECT"}

    @property
    def pattern(self) -> str:
        return self.PATTERNS.get(int(self.attrs.get("pattern", 0)), self.attrs.get("pattern", "?"))


def read_graphs(text: str, path: str) -> list[NcclGraph]:
    root = parse_tree(text, path)
    if root.tag != "graphs":
        raise TopologyFormatError(path, root.line, f"<{root.tag}> is a topology, not an NCCL graph file",
                                  "read it with commlib.topology.load()")
    out = []
    for g in root.children:
        channels = []
        for ch in g.children:
            steps = []
            for s in ch.children:
                try:
                    steps.append((s.tag, int(s.attrs["dev"])))
                except (KeyError, ValueError):
                    raise TopologyFormatError(path, s.line, f"<{s.tag}> needs an integer dev attribute",
                                              'write e.g. <gpu dev="0"/>') from None
            channels.append(steps)
        out.append(NcclGraph(dict(g.attrs), channels))
    return out


def write_graphs(graphs: list[NcclGraph]) -> str:
    lines = ['<graphs version="1">']
    for g in graphs:
        lines.append(f"  <graph{_attrs(g.attrs)}>")
        for ch in g.channels:
            lines.append("    <channel>")
            lines += [f'      <{tag} dev="{dev}"/>' for tag, dev in ch]
            lines.append("    </channel>")
        lines.append("  </graph>")
    lines.append("</graphs>")
    return "\n".join(lines) + "\n"


# --- writer --------------------------------------------------------------------------------------

def _attrs(d: dict) -> str:
    return "".join(f" {k}={quoteattr(str(v))}" for k, v in d.items())


@register_operation("write_xml")
def write_xml(topo: Topology, host: int = 0) -> str:
    """NCCL topology XML for one host of ``topo``. PCIe host-bridge nodes (known to sysfs and
    nvidia-smi but not to NCCL) are flattened into their CPU; NVLinks and C2C are written as the
    source listed them."""
    g = topo.graph
    children: dict[str | None, list[str]] = {}
    for n, d in g.nodes(data=True):
        if d.get("host", 0) == host and d["kind"] in ("CPU", "PCI", "GPU", "NIC"):
            children.setdefault(d.get("parent"), []).append(n)
    system = dict(g.graph.get("system") or {"version": "1"})
    out = [f"<system{_attrs(system)}>"]

    def emit(node: str, depth: int) -> None:
        d = g.nodes[node]
        pad = "  " * depth
        kind = d["kind"]
        if kind == "PCI" and d.get("hostbridge"):
            for c in children.get(node, []):
                emit(c, depth)
            return
        if kind == "NIC" and d.get("pci") is None:
            out.append(f"{pad}<nic>")
            out.extend(f"{pad}  <net{_attrs(n)}/>" for n in d["nets"])
            out.append(f"{pad}</nic>")
            return
        inner: list[str] = []
        if kind == "GPU" and d.get("gpu") is not None:
            links = [f"{pad}    <nvlink{_attrs(x)}/>" for x in d["nvlinks"]]
            links += [f"{pad}    <c2c{_attrs(x)}/>" for x in d["c2c"]]
            inner.append(f"{pad}  <gpu{_attrs(d['gpu'])}" + (">" if links else "/>"))
            if links:
                inner += links + [f"{pad}  </gpu>"]
        if kind == "NIC" and d.get("has_nic"):
            inner.append(f"{pad}  <nic>")
            inner += [f"{pad}    <net{_attrs(n)}/>" for n in d["nets"]]
            inner.append(f"{pad}  </nic>")
        for t in d.get("pcilinks", []):
            inner.append(f"{pad}  <pcilink{_attrs({'target': t})}/>")
        sub_start = len(out)
        out.append("")  # placeholder for the opening tag
        out.extend(inner)
        for c in children.get(node, []):
            emit(c, depth + 1)
        has_body = len(out) > sub_start + 1
        out[sub_start] = f"{pad}<pci{_attrs(d['pci'])}" + (">" if has_body else "/>")
        if has_body:
            out.append(f"{pad}</pci>")

    for cpu in children.get(None, []):
        if g.nodes[cpu]["kind"] != "CPU":
            continue
        out.append(f"  <cpu{_attrs(g.nodes[cpu].get('cpu') or {'numaid': g.nodes[cpu]['numaid']})}>")
        for c in children.get(cpu, []):
            emit(c, 2)
        out.append("  </cpu>")
    out.append("</system>")
    return "\n".join(out) + "\n"


__all__ = ["read_topology", "read_graphs", "write_xml", "write_graphs", "NcclGraph", "parse_tree",
           "GRAMMAR", "NVS_TCLASS", "CPU_TCLASS", "GPU_TCLASS"]
