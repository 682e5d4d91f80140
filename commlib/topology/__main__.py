"""``python -m commlib.topology [FILE]``: describe this machine (or a topology file / catalog name):
the devices, the matrix, the picture, the ring and tree plans, and diagnostics."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from . import catalog_names, discover, load, load_catalog, load_graphs
from .formats import detect
from .model import TopologyError

PCI_CLASS = {"0x01": "storage", "0x02": "network", "0x03": "display/3D", "0x06": "bridge", "0x08": "system",
             "0x0c": "serial bus", "0xff": "unclassified"}


def describe(topo, picture: str | None, budget: int) -> str:
    g = topo.graph
    out = [repr(topo), f"source: {topo.source}"]
    out.append("hosts: " + ", ".join(topo.hosts))
    for cpu in topo.cpus:
        d = g.nodes[cpu]
        attrs = d.get("cpu") or {}
        cpus = d.get("cpulist") or ""
        model = attrs.get("model_name") or " ".join(x for x in (attrs.get("vendor"), attrs.get("arch")) if x)
        out.append(f"  {cpu}: NUMA {d.get('numaid', -1)}" + (f", CPUs {cpus}" if cpus else "") +
                   (f", {model}" if model else ""))
    pci = [d for _n, d in g.nodes(data=True) if d.get("pci") and d["kind"] == "PCI" and not d.get("hostbridge")]
    kinds = Counter(PCI_CLASS.get((d["pci"].get("class") or "")[:4].lower(), d["pci"].get("class") or "?")
                    for d in pci)
    out.append(f"  PCI functions: {len(pci)} other than GPUs/NICs" +
               (" (" + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) + ")" if kinds else ""))
    for nic in topo.nics:
        d = g.nodes[nic]
        nets = ", ".join(f"{n.get('name')} {int(n.get('speed') or 0) // 1000 or '?'} Gb/s "
                         f"{n.get('link_layer') or ''} {n.get('state') or ''}".strip() for n in d.get("nets", []))
        out.append(f"  {nic}: {(d.get('pci') or {}).get('busid', '')} {nets or '(no port listed)'} "
                   f"on {topo.cpu_of(nic)}")
    if topo.gpus or topo.nics:
        out += ["", "matrix (nvidia-smi topo -m style):", topo.to_matrix().split("\nLegend:")[0].rstrip()]
    out.append("")
    if topo.gpus:
        out.append("ring:  " + str(topo.ring_plan(budget=budget)))
        out.append("trees: " + str(topo.trees(budget=budget)).replace("\n", "\n       "))
        out.append("hierarchy:\n  " + str(topo.hierarchy()).replace("\n", "\n  "))
    else:
        out.append("ring/trees: no GPUs on this host, nothing to plan across GPUs (CPU ranks use the NUMA "
                   "nodes above)")
    diags = topo.diagnose()
    out.append("diagnostics:" + ("" if diags else " none"))
    out += [f"  {d}" for d in diags]
    if picture:
        topo.draw(picture)
        out.append(f"picture: {picture}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlib.topology", description=__doc__)
    ap.add_argument("file", nargs="?", help="topology file (NCCL XML, nvidia-smi topo -m, JSON) or catalog "
                    f"name ({', '.join(catalog_names())}); default: this machine")
    ap.add_argument("--picture", default="commlib-topology.svg", help="write the picture here (.svg/.png); "
                    "'none' to skip (default %(default)s)")
    ap.add_argument("--xml", action="store_true", help="print NCCL topology XML instead")
    ap.add_argument("--json", action="store_true", help="print commlib JSON instead")
    ap.add_argument("--budget", type=int, default=1 << 17, help="ring search budget in steps")
    args = ap.parse_args(argv)
    try:
        if args.file and args.file in catalog_names():
            topo = load_catalog(args.file)
        elif args.file:
            with open(args.file, errors="replace") as f:
                if detect(f.read()) == "nccl-graph":
                    for g in load_graphs(args.file):
                        print(f"graph {g.pattern} {g.attrs}")
                        for ch in g.channels:
                            print("  channel " + " -> ".join(f"{t}{d}" for t, d in ch))
                    return 0
            topo = load(args.file)
        else:
            topo = discover()
        if args.xml:
            print(topo.to_nccl_xml(), end="")
        elif args.json:
            print(topo.to_json())
        else:
            print(describe(topo, None if args.picture == "none" else args.picture, args.budget))
    except (TopologyError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
