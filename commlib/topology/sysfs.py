"""Linux sysfs source: NUMA nodes and CPUs, the PCI tree, GPUs, NICs and their network ports.

Reads ``/sys/devices/system/node/node*/cpulist``, ``/sys/bus/pci/devices/*`` (``class``,
``vendor``, ``device``, ``numa_node``, ``max_link_speed``/``max_link_width`` as NCCL does, plus the
``current_*`` values for diagnostics; the tree comes from each device's real path under
``/sys/devices/pciDDDD:BB``), ``/sys/class/net/*`` and ``/sys/class/infiniband/*/ports/*``.
Every PCI function becomes a node, so a GPU-less machine is still described as it is.
"""

from __future__ import annotations

import glob
import os
import platform
import re

from .build import Builder, cpulist_to_mask, format_cpulist
from .source_registry import SourceUnavailable, register_source

NVIDIA = "0x10de"


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _cpu_info(root: str) -> dict:
    info = {"arch": platform.machine() or ""}
    text = _read(os.path.join(os.path.dirname(root.rstrip("/")) or "/", "proc/cpuinfo")) if root != "/sys" \
        else _read("/proc/cpuinfo")
    for key, attr in (("vendor_id", "vendor"), ("cpu family", "familyid"), ("model", "modelid"),
                      ("model name", "model_name")):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text, flags=re.M)
        if m:
            info[attr] = m.group(1).strip()
    return info


def _ib_ports(root: str) -> dict[str, list[dict]]:
    """PCI bus id -> its InfiniBand/RoCE ports (name, port, rate in Mb/s, state, link layer)."""
    out: dict[str, list[dict]] = {}
    for dev in sorted(glob.glob(os.path.join(root, "class/infiniband/*"))):
        bdf = os.path.basename(os.path.realpath(os.path.join(dev, "device")))
        for port in sorted(glob.glob(os.path.join(dev, "ports/*"))):
            rate = _read(os.path.join(port, "rate"))
            m = re.match(r"([0-9.]+)\s*Gb", rate)
            out.setdefault(bdf, []).append({
                "name": os.path.basename(dev), "port": os.path.basename(port),
                "speed": str(int(float(m.group(1)) * 1000)) if m else "0",
                "state": _read(os.path.join(port, "state")),
                "link_layer": _read(os.path.join(port, "link_layer")),
            })
    return out


def _netdevs(root: str) -> dict[str, list[dict]]:
    """PCI bus id -> network interfaces on it (virtio-net sits one level below its PCI function)."""
    out: dict[str, list[dict]] = {}
    for net in sorted(glob.glob(os.path.join(root, "class/net/*"))):
        real = os.path.realpath(net)
        bdfs = re.findall(r"/([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f])(?=/)", real)
        if not bdfs:
            continue  # virtual (lo, bridges, ifb)
        speed = _read(os.path.join(net, "speed"), "-1")
        out.setdefault(bdfs[-1], []).append({
            "name": os.path.basename(net), "port": "1",
            "speed": speed if speed.lstrip("-").isdigit() and int(speed) > 0 else "0",
            "state": _read(os.path.join(net, "operstate")),
        })
    return out


@register_source("sysfs")
def read_sysfs(b: Builder, root: str = "/sys") -> None:
    """Linux sysfs: NUMA nodes, the PCI tree, GPUs, NICs and their ports."""
    pci_dir = os.path.join(root, "bus/pci/devices")
    node_dirs = sorted(glob.glob(os.path.join(root, "devices/system/node/node[0-9]*")),
                       key=lambda p: int(p.rsplit("node", 1)[1]))
    if not os.path.isdir(pci_dir) and not node_dirs:
        raise SourceUnavailable(f"no {pci_dir} and no NUMA nodes under {root}/devices/system/node")
    info = _cpu_info(root)
    cpu_of: dict[int, str] = {}
    numa_ids = [int(p.rsplit("node", 1)[1]) for p in node_dirs]
    if not numa_ids:
        online = _read(os.path.join(root, "devices/system/cpu/online")) or format_cpulist(
            sorted(os.sched_getaffinity(0)))
        numa_ids, lists = [-1], [online]
    else:
        lists = [_read(os.path.join(p, "cpulist")) for p in node_dirs]
    for numa, cpulist in zip(numa_ids, lists):
        attrs = {"numaid": str(numa), "affinity": cpulist_to_mask(cpulist), **info}
        cpu_of[numa] = b.cpu(attrs, numa)
        b.g.nodes[cpu_of[numa]]["cpulist"] = cpulist
    first_cpu = cpu_of[numa_ids[0]]
    ib, nets = _ib_ports(root), _netdevs(root)
    devices = []
    for dev in sorted(os.listdir(pci_dir)) if os.path.isdir(pci_dir) else []:
        real = os.path.realpath(os.path.join(pci_dir, dev))
        chain = re.findall(r"/(pci[0-9a-f]{4}:[0-9a-f]{2}|[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f])(?=/|$)",
                           real)
        devices.append((len(chain), chain, dev))
    numa_unknown = []
    for _depth, chain, dev in sorted(devices):
        d = os.path.join(pci_dir, dev)
        numa = int(_read(os.path.join(d, "numa_node"), "-1") or -1)
        if numa < 0:
            numa_unknown.append(dev)
        cpu = cpu_of.get(numa, first_cpu)
        parent = cpu
        if chain and chain[0].startswith("pci"):
            rc = f"PCI/{chain[0]}"
            if rc not in b.g:
                b.pci(cpu, {"busid": chain[0], "class": "0x060000"}, hostbridge=True)
            parent = rc
        for anc in chain[1:-1]:
            node = b.by_busid(anc)
            if node is not None:
                parent = node
        attrs = {"busid": dev}
        for key in ("class", "vendor", "device", "subsystem_vendor", "subsystem_device"):
            attrs[key] = _read(os.path.join(d, key))
        speed, width = _read(os.path.join(d, "max_link_speed")), _read(os.path.join(d, "max_link_width"))
        if speed:
            attrs["link_speed"], attrs["link_width"] = speed, width
        extra = {"numa_node": numa, "current_link_speed": _read(os.path.join(d, "current_link_speed")),
                 "current_link_width": _read(os.path.join(d, "current_link_width")),
                 "driver": os.path.basename(os.path.realpath(os.path.join(d, "driver"))) if
                 os.path.exists(os.path.join(d, "driver")) else ""}
        cls = attrs["class"].lower()
        if cls.startswith("0x03") and attrs["vendor"].lower() == NVIDIA:
            b.gpu(parent, attrs, None, **extra)
        elif cls.startswith("0x02"):
            ports = ib.get(dev, []) or nets.get(dev, [])
            ports = [dict(p, dev=str(len(b.nics))) for p in ports]
            b.nic(parent, attrs, ports, has_nic=bool(ports), **extra)
        else:
            b.pci(parent, attrs, **extra)
    if numa_unknown:
        b.note("numa-unknown", f"{len(numa_unknown)} PCI device(s) report numa_node -1 (usual in VMs): "
               f"placed under CPU/NUMA node {numa_ids[0]}")
