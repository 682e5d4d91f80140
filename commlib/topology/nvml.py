"""NVML source (nvidia-ml-py, imported lazily): GPUs, NVLinks, P2P status, NUMA, PCIe state.

Querying (``_query``) is separate from building (``apply_records``) so that the building logic can
be checked on recorded NVML values on machines without a GPU. A record per GPU::

    {"busid": "00000000:A4:00.0", "sm": 90, "numa": 0, "pcie_max": (5, 16), "pcie_cur": (5, 16),
     "nvlinks": [{"link": 0, "remote_busid": "00000000:F5:00.0", "remote_type": 2}, ...]}

plus ``"p2p": {(i, j): status}`` (NVML_P2P_STATUS_*: 0 OK, 1 chipset, 2 GPU, 3 IOH topology,
4 disabled by regkey, 5 not supported).
"""

from __future__ import annotations

from .build import CPU_TCLASS, GPU_TCLASS, NVS_TCLASS, Builder, is_invisible_busid, norm_busid
from .source_registry import SourceUnavailable, register_source

REMOTE_TCLASS = {0: GPU_TCLASS, 1: CPU_TCLASS, 2: NVS_TCLASS}  # NVML_NVLINK_DEVICE_TYPE_{GPU,IBMNPU,SWITCH}
P2P_STATUS = {0: "OK", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
              4: "disabled by regkey", 5: "not supported"}
PCIE_SPEED = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe",
              5: "32.0 GT/s PCIe", 6: "64.0 GT/s PCIe"}
MAX_LINKS = 18


def _query() -> dict:
    try:  # nvidia-ml-py is optional (the 'cuda' extra): imported when the source runs, not at load
        import pynvml
    except ImportError:
        raise SourceUnavailable("nvidia-ml-py is not installed (pip install 'commlib[cuda]')") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise SourceUnavailable(f"NVML cannot start here ({exc})") from None
    try:
        gpus, handles = [], []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            handles.append(h)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            rec = {"busid": pynvml.nvmlDeviceGetPciInfo(h).busId, "sm": major * 10 + minor, "nvlinks": []}
            for key, fn in (("numa", "nvmlDeviceGetNumaNodeId"),):
                try:
                    rec[key] = getattr(pynvml, fn)(h)
                except Exception:
                    rec[key] = -1
            try:
                rec["pcie_max"] = (pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
                                   pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
                rec["pcie_cur"] = (pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                                   pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
            except Exception:
                pass
            for link in range(MAX_LINKS):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
                    try:
                        rtype = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
                    except Exception:
                        rtype = 0xFF
                except Exception:
                    continue
                rec["nvlinks"].append({"link": link, "remote_busid": remote, "remote_type": rtype})
            gpus.append(rec)
        p2p = {}
        for i, a in enumerate(handles):
            for j, c in enumerate(handles):
                if i != j:
                    try:
                        p2p[(i, j)] = pynvml.nvmlDeviceGetP2PStatus(a, c, pynvml.NVML_P2P_CAPS_INDEX_READ)
                    except Exception:
                        pass
        return {"gpus": gpus, "p2p": p2p}
    finally:
        pynvml.nvmlShutdown()


def _b(x):
    return x.decode() if isinstance(x, bytes) else x


def apply_records(b: Builder, records: dict) -> None:
    """Add NVML's GPUs to ``b`` (matching sysfs's by bus id), with NVLinks grouped per remote
    device as NCCL does (``<nvlink target count tclass>``)."""
    cpus = {d.get("numaid"): n for n, d in b.g.nodes(data=True) if d["kind"] == "CPU"}
    for k, rec in enumerate(records["gpus"]):
        busid = norm_busid(_b(rec["busid"]))
        sm = int(rec.get("sm") or 0) or None
        node = b.by_busid(busid)
        if node is None or b.g.nodes[node]["kind"] != "GPU":
            numa = int(rec.get("numa", -1))
            if numa not in cpus:
                cpus[numa] = b.cpu({"numaid": str(numa)}, numa)
            gen, width = rec.get("pcie_max", (None, 16))
            node = b.gpu(cpus[numa], {"busid": busid, "class": "0x030200",
                                      "link_speed": PCIE_SPEED.get(gen, ""), "link_width": str(width)})
        d = b.g.nodes[node]
        d["gpu"] = {"dev": str(k), "sm": str(sm or ""), "rank": str(k), "gdr": "1"}
        d["sm"] = sm
        if rec.get("pcie_cur") and rec.get("pcie_max"):
            d["pcie_nvml"] = {"max": list(rec["pcie_max"]), "cur": list(rec["pcie_cur"])}
        grouped: dict[tuple[str, str], int] = {}
        for link in rec.get("nvlinks", []):
            remote = _b(link["remote_busid"])
            tclass = REMOTE_TCLASS.get(int(link.get("remote_type", 0xFF)), NVS_TCLASS)
            if is_invisible_busid(remote):
                target, tclass = "fffffff:ffff:ff", NVS_TCLASS  # NCCL: an unseen peer is an NVSwitch
            else:
                target = norm_busid(remote)
            grouped[(target, tclass)] = grouped.get((target, tclass), 0) + 1
        for (target, tclass), count in grouped.items():
            b.nvlink(node, target, count, tclass)
    for (i, j), status in sorted(records.get("p2p", {}).items()):
        if status and i < j:
            b.note("p2p", f"GPU{i} and GPU{j}: P2P {P2P_STATUS.get(status, status)} (NVML status {status})")


@register_source("nvml")
def read_nvml(b: Builder) -> None:
    """NVML through nvidia-ml-py: GPUs, NVLinks, P2P, NUMA, PCIe generation and width."""
    apply_records(b, _query())
