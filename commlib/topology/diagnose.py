"""Diagnostics a user needs before trusting a plan: NUMA -1, invisible NVLink peers, PCIe links
below their maximum, NICs far from GPUs, GPUs without P2P, and what the sources noted."""

from __future__ import annotations

from .model import PATH_RANK, Diagnostic, Topology, register_operation


def _speed(text) -> float:
    try:
        return float(str(text).split()[0])
    except (ValueError, IndexError):
        return 0.0


@register_operation("diagnose")
def diagnose(topo: Topology) -> list[Diagnostic]:
    out = list(topo.notes)
    g = topo.graph
    for cpu in topo.cpus:
        if g.nodes[cpu].get("numaid", -1) < 0:
            out.append(Diagnostic("numa-unknown", f"{cpu} has NUMA id -1 (VMs and containers often hide NUMA): "
                                  "CPU affinity for GPUs and NICs cannot be trusted"))
    for gpu in topo.gpus:
        d = g.nodes[gpu]
        if d.get("invisible_nvlinks"):
            out.append(Diagnostic("nvlink-hidden", f"{gpu}: {d['invisible_nvlinks']} NVLinks go to a peer with bus "
                                  "id FFFFFFFF (hidden NVSwitch, as in VMs); modelled as one NVSwitch like NCCL"))
        nv = d.get("pcie_nvml")
        if nv and tuple(nv["cur"]) < tuple(nv["max"]):
            out.append(Diagnostic("pcie-below-max", f"{gpu}: PCIe Gen{nv['cur'][0]} x{nv['cur'][1]} now, max "
                                  f"Gen{nv['max'][0]} x{nv['max'][1]} (idle GPUs drop their link; check under load)"))
    for n, d in g.nodes(data=True):
        pci = d.get("pci") or {}
        cur_s, cur_w = d.get("current_link_speed"), d.get("current_link_width")
        if cur_s and pci.get("link_speed") and (_speed(cur_s) < _speed(pci["link_speed"]) or
                                                 (cur_w and pci.get("link_width") and
                                                  int(cur_w) < int(pci["link_width"]))):
            out.append(Diagnostic("pcie-below-max", f"{n}: PCIe link {cur_s} x{cur_w} now, max "
                                  f"{pci['link_speed']} x{pci.get('link_width')}"))
    for gpu in topo.gpus:
        local = [x for x in topo.nics if topo.host_of(x) == topo.host_of(gpu)]
        if not local:
            continue
        best = min(local, key=lambda x: (PATH_RANK[topo.path_type(gpu, x)], topo.nics.index(x)))
        kind = topo.path_type(gpu, best)
        if PATH_RANK[kind] > PATH_RANK["PXB"]:
            out.append(Diagnostic("nic-far", f"{gpu}: nearest NIC {best} is {kind} away: NCCL's default "
                                  "NCCL_NET_GDR_LEVEL=PXB turns GPUDirect RDMA off for it"))
    no_p2p = []
    for i, a in enumerate(topo.gpus):
        for b in topo.gpus[i + 1:]:
            if topo.host_of(a) == topo.host_of(b) and PATH_RANK[topo.path_type(a, b)] > PATH_RANK["PXB"]:
                no_p2p.append(f"{a}-{b} ({topo.path_type(a, b)})")
    if no_p2p:
        shown = ", ".join(no_p2p[:6]) + (f" and {len(no_p2p) - 6} more" if len(no_p2p) > 6 else "")
        out.append(Diagnostic("no-p2p", f"{len(no_p2p)} GPU pair(s) without P2P under NCCL's default "
                              f"NCCL_P2P_LEVEL=PXB (traffic goes through host memory): {shown}"))
    return out
