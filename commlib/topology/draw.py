"""A picture of the graph: the PCI tree per CPU top-down, GPUs and NICs at the leaves, NVLinks as
arcs under the GPUs, NVSwitch and network rails below. SVG is written directly (no dependency);
PNG goes through matplotlib (the ``plot`` extra) with the same layout."""

from __future__ import annotations

from xml.sax.saxutils import escape

from ..errors import arg_error
from .model import Topology, TopologyError, register_operation

COLORS = {"PCI": "#888888", "NVL": "#2e9d2e", "SYS": "#c0392b", "NET": "#1f5fbf", "C2C": "#8e44ad",
          "LOC": "#bbbbbb"}
FILL = {"CPU": "#f6d7a7", "PCI": "#e8e8e8", "GPU": "#bfe6bf", "NIC": "#bcd3f2", "NVS": "#9fd39f", "NET": "#9db8e6"}
W, H, DX, DY = 78, 26, 90, 62


def layout(topo: Topology, host: int | None = None) -> tuple[dict[str, tuple[float, float]], list]:
    g = topo.graph
    keep = [n for n, d in g.nodes(data=True) if host is None or d.get("host", 0) in (host, -1)]
    kids: dict = {}
    for n in keep:
        kids.setdefault(g.nodes[n].get("parent"), []).append(n)
    pos: dict[str, tuple[float, float]] = {}
    col = [0.0]
    depth_max = [0]

    def place(n, depth):
        depth_max[0] = max(depth_max[0], depth)
        ch = kids.get(n, [])
        if not ch:
            x = col[0]
            col[0] += 1
        else:
            xs = [place(c, depth + 1) for c in ch]
            x = (xs[0] + xs[-1]) / 2
        pos[n] = (x, depth)
        return x

    roots = [n for n in kids.get(None, []) if g.nodes[n]["kind"] == "CPU"]
    for r in roots:
        place(r, 0)
        col[0] += 0.5
    extra = [n for n in kids.get(None, []) if g.nodes[n]["kind"] in ("NVS", "NET")]
    for k, n in enumerate(extra):
        below = depth_max[0] + 1.6 + 0.8 * (g.nodes[n]["kind"] == "NET")
        pos[n] = ((k + 0.5) * max(col[0], 1) / max(len(extra), 1), below)
    edges = [(a, b, d) for a, b, d in g.edges(data=True) if a in pos and b in pos and a != b]
    return pos, edges


def _label(topo, n):
    d = topo.graph.nodes[n]
    short = n.split("/")[-1] if d["kind"] != "PCI" else (d.get("pci") or {}).get("busid", n)[-7:]
    if d["kind"] == "CPU":
        short = f"{n.split('/')[-1]} numa{d.get('numaid', -1)}"
    if d["kind"] == "NIC" and d.get("name"):
        short = f"{short} {d['name']}"
    return short[:14]


def to_svg(topo: Topology, host: int | None = None) -> str:
    pos, edges = layout(topo, host)
    xy = {n: (20 + x * DX + W / 2, 40 + y * DY + H / 2) for n, (x, y) in pos.items()}
    width = max((p[0] for p in xy.values()), default=0) + W + 20
    height = max((p[1] for p in xy.values()), default=0) + H + 90
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'font-family="sans-serif" font-size="10">',
           f'<text x="10" y="18" font-size="13">{escape(repr(topo))}</text>']
    for a, b, d in edges:
        (x1, y1), (x2, y2) = xy[a], xy[b]
        color, dash = COLORS.get(d["type"], "#000"), ' stroke-dasharray="5,3"' if d["type"] == "SYS" else ""
        sw = 1 + min(d.get("bw", 1), 400) / 80
        if d["type"] == "NVL" and topo.graph.nodes[a]["kind"] == topo.graph.nodes[b]["kind"] == "GPU":
            mx, my = (x1 + x2) / 2, max(y1, y2) + 30 + abs(x2 - x1) / 6
            out.append(f'<path d="M{x1:.0f},{y1 + H / 2:.0f} Q{mx:.0f},{my:.0f} {x2:.0f},{y2 + H / 2:.0f}" '
                       f'fill="none" stroke="{color}" stroke-width="{sw:.1f}"/>')
        else:
            out.append(f'<line x1="{x1:.0f}" y1="{y1:.0f}" x2="{x2:.0f}" y2="{y2:.0f}" stroke="{color}" '
                       f'stroke-width="{sw:.1f}"{dash}><title>{d["type"]} {d.get("bw")} GB/s</title></line>')
    for n, (x, y) in xy.items():
        kind = topo.graph.nodes[n]["kind"]
        out.append(f'<rect x="{x - W / 2:.0f}" y="{y - H / 2:.0f}" width="{W}" height="{H}" rx="4" '
                   f'fill="{FILL[kind]}" stroke="#333"><title>{escape(n)}</title></rect>')
        out.append(f'<text x="{x:.0f}" y="{y + 4:.0f}" text-anchor="middle">{escape(_label(topo, n))}</text>')
    ly = height - 30
    for k, (t, c) in enumerate(COLORS.items()):
        out.append(f'<line x1="{20 + k * 90}" y1="{ly}" x2="{45 + k * 90}" y2="{ly}" stroke="{c}" stroke-width="3"/>'
                   f'<text x="{50 + k * 90}" y="{ly + 4}">{t}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_png(topo: Topology, path: str, host: int | None = None) -> None:
    try:  # matplotlib is optional (the 'plot' extra), needed only for PNG: imported here, not at load
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise arg_error("Topology.draw", "path", path, "PNG needs matplotlib, which is not installed",
                        "pip install 'commlib[plot]' or write an .svg path", cls=TopologyError) from None
    pos, edges = layout(topo, host)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * (max((p[0] for p in pos.values()), default=1) + 2)),
                                    max(4, 0.8 * (max((p[1] for p in pos.values()), default=1) + 3))))
    for a, b, d in edges:
        (x1, y1), (x2, y2) = pos[a], pos[b]
        ax.plot([x1, x2], [-y1, -y2], color=COLORS.get(d["type"], "k"), lw=1 + min(d.get("bw", 1), 400) / 80,
                ls="--" if d["type"] == "SYS" else "-", zorder=1)
    for n, (x, y) in pos.items():
        kind = topo.graph.nodes[n]["kind"]
        ax.text(x, -y, _label(topo, n), ha="center", va="center", fontsize=7, zorder=2,
                bbox=dict(boxstyle="round", fc=FILL[kind], ec="#333"))
    ax.set_title(repr(topo), fontsize=8)
    ax.axis("off")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


@register_operation("draw")
def draw(topo: Topology, path: str, host: int | None = None) -> str:
    """Write the picture to ``path`` (``.svg`` or ``.png``); returns the path."""
    p = str(path)
    if p.endswith(".svg"):
        with open(p, "w") as f:
            f.write(to_svg(topo, host))
    elif p.endswith(".png"):
        to_png(topo, p, host)
    else:
        raise arg_error("Topology.draw", "path", p, "must end in .svg or .png", "name the file e.g. topo.svg",
                        cls=TopologyError)
    return p
