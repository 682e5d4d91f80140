"""The ``cuda_ipc`` transport: one-shot and two-shot all-reduce of CUDA tensors over CUDA IPC
buffers, for GPUs of one node (the kernels are ``csrc/cuda_ipc.cu``, loaded through CuPy
``RawModule``; the per-element math is ``csrc/reduce_math.h``, shared with the CPU path).

Everything that decides is here, in plain Python, and unit-tested without a GPU
(tests/test_cuda_ipc.py): the buffer layout, the size limits, the launch shape, and the choice
between one-shot, two-shot and the NCCL fallback. The parts that need a GPU (IPC handle exchange,
the P2P test, launches) run only where CUDA is present.

Groups get it through :class:`CudaIpcTransport`, attached when the group is created (collective;
where every rank sees a CUDA device and the ranks share a host), and ``commlib.all_reduce`` on
CUDA tensors reaches the kernels through selection: the ``cuda_ipc_oneshot`` and
``cuda_ipc_twoshot`` algorithms (commlib/algorithms/cuda_ipc.py) are eligible where
:func:`decide` names them and are compared with NCCL on the cost model.

The runtime is :class:`CudaIpcAllReduce`: created collectively by every rank of a group of GPU
ranks, it allocates its IPC buffer (torch CUDA memory), exchanges what each rank found (host,
GPU, working peer-to-peer and NVLink peers, the buffer's ``cudaIpcMemHandle``) over the group's
engine, decides once for the whole group whether the kernels may run (:func:`check_group`, the
same answer on every rank because every rank decides from the same gathered records), opens the
peers' handles, and then runs each all-reduce as one device-to-device copy of the input into the
registered buffer plus one kernel launch on torch's current stream that writes the result straight
into the caller's tensor (raw device pointers: no CuPy arrays, no host round trip). Whatever the
kernels cannot do goes to the ``fallback`` (NCCL), logged once per reason. Without CUDA the object
still constructs (every rank records "no CUDA device") and every call takes the fallback.

Rules (after vLLM's custom all-reduce, reference/collectives.md section 2.1):

* float32, float16 and bfloat16 only (half types accumulate in float32); SUM, AVG, PRODUCT, MIN,
  MAX;
* byte counts a multiple of 16, at most ``max_bytes`` (the registered buffer);
* world sizes 2, 4, 6 or 8 on one node; more than 2 GPUs need full NVLink (PCIe-only peers are
  too slow for an all-to-all read pattern);
* a real peer-to-peer copy test, not only ``cudaDeviceCanAccessPeer`` (which can lie);
* one-shot when the world size is 2, or up to 512 KiB at <= 4 GPUs, or up to 256 KiB at <= 8;
  two-shot above; anything else falls back to NCCL, saying why.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..errors import arg_error
from ..kernels import nvrtc
from ..ops import ReduceOp
from ..topology.host import host_hash
from .base import GroupFacts, Transport, refusal, register_transport

__all__ = ["MAX_RANKS", "MAX_BLOCKS", "Layout", "Decision", "layout", "decide", "launch_shape",
           "kernel_name", "load_module", "p2p_works", "PeerRecord", "pack_record",
           "unpack_record", "GroupCheck", "check_group", "peer_devices", "Plan", "Planner",
           "engine_exchange", "CudaIpcAllReduce", "CudaIpcTransport"]

log = logging.getLogger("commlib")

MAX_RANKS = 8      # CL_IPC_MAX_RANKS in csrc/cuda_ipc.cu
MAX_BLOCKS = 64    # CL_IPC_MAX_BLOCKS
SIGNAL_BYTES = 2 * MAX_BLOCKS * MAX_RANKS * 4  # sizeof(ClSignal): start and end flags
ALIGN = 256        # every area starts on a 256-byte boundary (cudaMalloc's guarantee)
THREADS = 512
BLOCK_LIMIT = 36   # vLLM's grid search on A100/A10/A30/T4/V100
DEFAULT_MAX_BYTES = 8 << 20
WORLD_SIZES = (2, 4, 6, 8)
ONESHOT_LIMITS = ((2, None), (4, 512 << 10), (8, 256 << 10))  # (max ranks, bytes limit or None)

_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_OPS = {ReduceOp.SUM: 0, ReduceOp.AVG: 0, ReduceOp.PRODUCT: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3}


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class Layout(NamedTuple):
    """Byte offsets in one rank's registered IPC allocation: the flags, the input area (peers
    read it) and the two-shot scratch area (peers read the reduced slices there)."""

    signal: int
    data: int
    tmp: int
    total: int
    max_bytes: int


def layout(max_bytes: int = DEFAULT_MAX_BYTES) -> Layout:
    if not isinstance(max_bytes, int) or max_bytes <= 0 or max_bytes % 16:
        raise arg_error("cuda_ipc.layout", "max_bytes", max_bytes,
                        "must be a positive multiple of 16", "pass e.g. 8 << 20")
    data = _round_up(SIGNAL_BYTES, ALIGN)
    tmp = data + _round_up(max_bytes, ALIGN)
    return Layout(0, data, tmp, tmp + _round_up(max_bytes, ALIGN), max_bytes)


class Decision(NamedTuple):
    """What to run for one all-reduce: ``"oneshot"``, ``"twoshot"`` or ``"nccl"``, and why."""

    algorithm: str
    reason: str


def decide(nbytes: int, dtype: torch.dtype, op: ReduceOp, world_size: int, *,
           full_nvlink: bool, p2p_ok: bool, max_bytes: int = DEFAULT_MAX_BYTES,
           contiguous: bool = True) -> Decision:
    """The pure selection rule (same inputs on every rank give the same decision)."""
    checks = (
        (p2p_ok, "peer-to-peer access failed its test between these GPUs"),
        (world_size in WORLD_SIZES, f"world size {world_size} is not one of {WORLD_SIZES}"),
        (world_size <= 2 or full_nvlink,
         f"{world_size} GPUs without full NVLink (PCIe-only peers: at most 2)"),
        (dtype in _SUFFIX, f"dtype {dtype} is not float32/float16/bfloat16"),
        (op in _OPS, f"op {op.name} has no kernel (bitwise ops)"),
        (contiguous, "the tensor is not contiguous"),
        (nbytes % 16 == 0, f"{nbytes} bytes is not a multiple of 16"),
        (nbytes <= max_bytes, f"{nbytes} bytes exceeds the registered buffer ({max_bytes})"),
    )
    for ok, why in checks:
        if not ok:
            return Decision("nccl", why)
    for ranks, limit in ONESHOT_LIMITS:
        if world_size <= ranks:
            if limit is None or nbytes < limit:
                return Decision("oneshot", f"{world_size} ranks, {nbytes} bytes: latency-bound")
            break
    return Decision("twoshot", f"{world_size} ranks, {nbytes} bytes: bandwidth-bound")


def launch_shape(nbytes: int, threads: int = THREADS, block_limit: int = BLOCK_LIMIT):
    """(blocks, threads) of a launch: one thread per 16-byte pack, at most ``block_limit``
    blocks (each block has its own flags, so at most MAX_BLOCKS)."""
    packs = max(1, nbytes // 16)
    blocks = min(block_limit, MAX_BLOCKS, (packs + threads - 1) // threads)
    return max(1, blocks), threads


def kernel_name(algorithm: str, dtype: torch.dtype) -> str:
    return f"cl_ipc_{algorithm}_{_SUFFIX[dtype]}"


def op_args(op: ReduceOp, world_size: int) -> tuple[int, int]:
    """(op code, AVG divisor or 0) for the kernels."""
    return _OPS[op], (world_size if op is ReduceOp.AVG else 0)


_CSRC = nvrtc.CSRC  # the CUDA sources (tests read them from here)


def load_module():
    """csrc/cuda_ipc.cu compiled by NVRTC through CuPy (once per process)."""
    return nvrtc.load("cuda_ipc.cu", "commlib cuda_ipc", "pip install 'commlib[cuda]', or use "
                      "backend='nccl'")


def p2p_works(dev_a: int, dev_b: int, nbytes: int = 1 << 16) -> bool:
    """A real peer-to-peer test: ``cudaDeviceCanAccessPeer`` both ways, then a copy from
    ``dev_a`` to ``dev_b`` that must arrive intact (some systems report access that does not
    work, as vLLM found)."""
    import cupy  # optional dependency (the 'cuda' extra): only GPU paths get here

    runtime = cupy.cuda.runtime
    if not (runtime.deviceCanAccessPeer(dev_a, dev_b) and runtime.deviceCanAccessPeer(dev_b, dev_a)):
        return False
    with cupy.cuda.Device(dev_a):
        src = cupy.arange(nbytes // 4, dtype=cupy.int32)
    with cupy.cuda.Device(dev_b):
        dst = cupy.zeros_like(src)
        runtime.memcpyPeer(dst.data.ptr, dev_b, src.data.ptr, dev_a, nbytes)
        cupy.cuda.Device(dev_b).synchronize()
        return bool((dst == cupy.arange(nbytes // 4, dtype=cupy.int32)).all())


# ----- what every rank publishes -------------------------------------------------------------
class PeerRecord(NamedTuple):
    """One rank's facts, gathered by every rank. ``p2p_mask`` / ``nvlink_mask``: bit j set when
    the peer-to-peer test to rank j passed / the two GPUs are joined by NVLink (this rank's own
    bit is always set). ``handle`` and ``offset``: the ``cudaIpcMemHandle`` of the allocation that
    holds this rank's IPC buffer and the buffer's byte offset in it (empty before allocation)."""

    host: int
    pid: int
    uuid: str
    p2p_mask: int = 0
    nvlink_mask: int = 0
    handle: bytes = b""
    offset: int = 0


_RECORD = struct.Struct("<qq40sQQ64sQ")
HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def pack_record(rec: PeerRecord) -> bytes:
    if len(rec.handle) not in (0, HANDLE_BYTES):
        raise arg_error("cuda_ipc.pack_record", "handle", rec.handle,
                        f"must be {HANDLE_BYTES} bytes (a cudaIpcMemHandle) or empty",
                        "pass the bytes of cudaIpcGetMemHandle")
    return _RECORD.pack(rec.host, rec.pid, rec.uuid.encode()[:40], rec.p2p_mask, rec.nvlink_mask,
                        rec.handle.ljust(HANDLE_BYTES, b"\0"), rec.offset)


def unpack_record(data: bytes) -> PeerRecord:
    host, pid, uuid, p2p, nvl, handle, offset = _RECORD.unpack(data)
    return PeerRecord(host, pid, uuid.rstrip(b"\0").decode(), p2p, nvl,
                      b"" if handle == bytes(HANDLE_BYTES) else handle, offset)


def engine_exchange(backend) -> Callable[[bytes], list[bytes]]:
    """``exchange(payload) -> [payload of rank 0, ..., rank n-1]`` through ``backend``'s native
    all-gather (payloads of equal length; host tensors where the engine takes them, else CUDA)."""
    def exchange(payload: bytes) -> list[bytes]:
        rows = backend.all_gather_rows(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return [bytes(row.tolist()) for row in rows]

    return exchange


class GroupCheck(NamedTuple):
    """Whether the kernels may run on this group at all (the same on every rank), and why not."""

    usable: bool
    reason: str
    full_nvlink: bool


def _full(mask: int, n: int) -> bool:
    return mask & ((1 << n) - 1) == (1 << n) - 1


def check_group(records: list[PeerRecord]) -> GroupCheck:
    """The group-wide rule, from the gathered records of every rank (pure). Checked in order: a
    CUDA device on every rank, one host, one GPU per rank, a working P2P test between every pair
    (each rank tested its peers; any failing pair disables the group); full NVLink is reported for
    :func:`decide` (which allows PCIe-only peers at 2 GPUs)."""
    n = len(records)
    if n > MAX_RANKS:
        return GroupCheck(False, f"{n} ranks, the kernels handle at most {MAX_RANKS}", False)
    for r, rec in enumerate(records):
        if not rec.uuid:
            return GroupCheck(False, f"rank {r} has no CUDA device (CUDA is absent there)", False)
    hosts = {rec.host for rec in records}
    if len(hosts) > 1:
        return GroupCheck(False, f"the ranks span {len(hosts)} hosts (CUDA IPC needs one)", False)
    seen: dict[str, int] = {}
    for r, rec in enumerate(records):
        if rec.uuid in seen:
            return GroupCheck(False, f"ranks {seen[rec.uuid]} and {r} share GPU {rec.uuid} "
                                     f"(CUDA IPC needs one GPU per rank)", False)
        seen[rec.uuid] = r
    for r, rec in enumerate(records):
        for j in range(n):
            if not (rec.p2p_mask >> j) & 1:
                return GroupCheck(False, f"peer-to-peer access failed its test from rank {r} to "
                                         f"rank {j}", False)
    return GroupCheck(True, "every pair passed the P2P test",
                      all(_full(rec.nvlink_mask, n) for rec in records))


def peer_devices(visible: list[str], uuids: list[str]) -> list[int | None]:
    """For each rank's GPU uuid, its device index in this process (``visible``: the uuids of this
    process's devices in index order), or None where CUDA_VISIBLE_DEVICES hides it."""
    index = {u: i for i, u in enumerate(visible)}
    return [index.get(u) for u in uuids]


# ----- plans -----------------------------------------------------------------------------------
class Plan(NamedTuple):
    """How one all-reduce runs: the decision, and for the kernels their name, grid, block, element
    count and (op code, AVG divisor)."""

    algorithm: str
    reason: str
    kernel: str | None = None
    grid: int = 0
    block: int = 0
    count: int = 0
    op_code: int = 0
    avg: int = 0


class Planner:
    """The per-call plans of one group (pure and memoized: no GPU needed)."""

    def __init__(self, world_size: int, check: GroupCheck, max_bytes: int = DEFAULT_MAX_BYTES):
        self.world_size, self.check, self.max_bytes = world_size, check, max_bytes
        self.plan = functools.lru_cache(maxsize=256)(self._plan)

    def _plan(self, count: int, dtype: torch.dtype, op: ReduceOp, contiguous: bool = True) -> Plan:
        if not self.check.usable:
            return Plan("nccl", self.check.reason)
        item = torch.empty((), dtype=dtype).element_size()
        d = decide(count * item, dtype, op, self.world_size, full_nvlink=self.check.full_nvlink,
                   p2p_ok=True, max_bytes=self.max_bytes, contiguous=contiguous)
        if d.algorithm == "nccl":
            return Plan("nccl", d.reason)
        grid, block = launch_shape(count * item)
        code, avg = op_args(op, self.world_size)
        return Plan(d.algorithm, d.reason, kernel_name(d.algorithm, dtype), grid, block, count,
                    code, avg)


# ----- the runtime -------------------------------------------------------------------------------
def _local_record(device: int | None, host: int) -> PeerRecord:
    if device is None:
        return PeerRecord(host, os.getpid(), "")
    return PeerRecord(host, os.getpid(), str(torch.cuda.get_device_properties(device).uuid))


def _visible_uuids() -> list[str]:
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _nvlink_pairs(mine: str, uuids: list[str]) -> list[bool]:
    """NVML's NVLink P2P status from GPU ``mine`` to each GPU of ``uuids`` (torch's uuid strings;
    all False without pynvml, which makes groups above 2 GPUs fall back)."""
    try:
        import pynvml  # optional dependency (the 'cuda' extra)
    except ImportError:
        return [False] * len(uuids)
    pynvml.nvmlInit()
    try:
        def handle(u):
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{u}")

        me = handle(mine)
        return [u == mine or pynvml.nvmlDeviceGetP2PStatus(
            me, handle(u), pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK
            for u in uuids]
    finally:
        pynvml.nvmlShutdown()


def _mask(bits: list[bool]) -> int:
    return sum(1 << j for j, b in enumerate(bits) if b)


class CudaIpcAllReduce:
    """All-reduce of CUDA tensors over CUDA IPC buffers for the GPU ranks of one host.

    Collective: every rank of the group constructs it, with the same ``max_bytes``. Args:
      exchange: ``exchange(payload) -> every rank's payload`` (e.g. :func:`engine_exchange`).
      rank, world_size: this rank and the group size.
      device: this rank's CUDA device index, or None where CUDA is absent.
      fallback: ``fallback(tensor, op)``, the NCCL all-reduce, for every call the kernels cannot
        run (logged once per reason).
      host: the host identity (default ``commlib.topology.host.host_hash()``).

    ``all_reduce(tensor, op)`` reduces in place on torch's current stream of the tensor's device.
    """

    def __init__(self, exchange: Callable[[bytes], list[bytes]], rank: int, world_size: int,
                 device: int | None, fallback: Callable, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 host: int | None = None):
        if host is None:
            host = host_hash()
        self.rank, self.world_size, self.device = rank, world_size, device
        self.layout = layout(max_bytes)
        self.fallback = fallback
        self._logged: set[str] = set()
        self._opened: list[int] = []
        self._flag = 0
        self._buf = None
        if device is not None and not torch.cuda.is_available():
            device = self.device = None
        # round 1: who is where; then each rank tests P2P and NVLink to the peers it can see
        first = [unpack_record(b) for b in exchange(pack_record(_local_record(device, host)))]
        mine = first[rank]
        handle, offset = b"", 0
        if device is not None:
            uuids = [r.uuid for r in first]
            p2p = [p is not None and (p == device or _p2p_ok(device, p))
                   for p in peer_devices(_visible_uuids(), uuids)]
            mine = mine._replace(p2p_mask=_mask(p2p), nvlink_mask=_mask(_nvlink_pairs(mine.uuid, uuids)))
            handle, offset = self._allocate(device)
        # round 2: the verdicts and the buffers' handles; every rank decides from the same records
        records = [unpack_record(b) for b in exchange(pack_record(
            mine._replace(handle=handle, offset=offset)))]
        self.check = check_group(records)
        self.planner = Planner(world_size, self.check, max_bytes)
        if self.check.usable:
            self._open_peers(records)
        else:
            self._release()
            log.info("cuda_ipc: kernels off for this group: %s; all-reduce uses NCCL",
                     self.check.reason)

    # ----- setup (GPU only) --------------------------------------------------------------------
    def _allocate(self, device: int) -> tuple[bytes, int]:
        """The IPC buffer: torch CUDA memory, zeroed (the flags start at 0) and synchronized
        before round 2 (a peer may write our flags as soon as it has the handle)."""
        self._buf = torch.zeros(self.layout.total, dtype=torch.uint8, device=f"cuda:{device}")
        torch.cuda.synchronize(device)
        # torch's own IPC export (what torch.multiprocessing sends): the allocation's handle and
        # this storage's offset inside the caching allocator's block
        share = self._buf.untyped_storage()._share_cuda_()
        return bytes(share[1]), int(share[3])

    def _open_peers(self, records: list[PeerRecord]) -> None:
        import cupy  # optional dependency (the 'cuda' extra): only GPU paths get here

        runtime = cupy.cuda.runtime
        bases = []
        with cupy.cuda.Device(self.device):
            for j, rec in enumerate(records):
                if j == self.rank:
                    bases.append(self._buf.data_ptr())
                    continue
                ptr = runtime.ipcOpenMemHandle(rec.handle, runtime.cudaIpcMemLazyEnablePeerAccess)
                self._opened.append(ptr)
                bases.append(ptr + rec.offset)
        lay, dev = self.layout, self._buf.device
        self._ptrs = torch.tensor([b + lay.data for b in bases], dtype=torch.int64, device=dev)
        self._tmps = torch.tensor([b + lay.tmp for b in bases], dtype=torch.int64, device=dev)
        self._sigs = torch.tensor([b + lay.signal for b in bases], dtype=torch.int64, device=dev)
        self._module = load_module()

    def _release(self) -> None:
        if self._opened:
            import cupy  # optional dependency (the 'cuda' extra): only GPU paths get here

            with cupy.cuda.Device(self.device):
                for ptr in self._opened:
                    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        self._opened = []
        self._buf = None

    def close(self) -> None:
        """Close the peers' handles and drop the buffer (after the last call completed)."""
        if self._buf is not None:
            torch.cuda.synchronize(self._buf.device)
        self._release()

    # ----- calls -------------------------------------------------------------------------------
    def plan(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Plan:
        if self.check.usable and (not tensor.is_cuda or tensor.device.index != self.device):
            return Plan("nccl", f"tensor on {tensor.device}, the buffers are on cuda:{self.device}")
        return self.planner.plan(tensor.numel(), tensor.dtype, op, tensor.is_contiguous())

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, kind: str | None = None,
                   fallback: Callable | None = None):
        """Reduce ``tensor`` in place: the kernel the plan names (or ``kind``, "oneshot" or
        "twoshot", where the plan allows the kernels at all), else ``fallback()`` (default: this
        object's ``fallback(tensor, op)``), logged once per reason."""
        p = self.plan(tensor, op)
        if p.algorithm == "nccl":
            if p.reason not in self._logged:
                self._logged.add(p.reason)
                log.info("cuda_ipc: all_reduce of %d x %s falls back to NCCL: %s",
                         tensor.numel(), tensor.dtype, p.reason)
            return fallback() if fallback is not None else self.fallback(tensor, op)
        if kind is not None and kind != p.algorithm:
            p = p._replace(algorithm=kind, kernel=kernel_name(kind, tensor.dtype))
        self._launch(p, tensor)
        return None

    def _launch(self, p: Plan, tensor: torch.Tensor) -> None:
        import cupy  # optional dependency (the 'cuda' extra); only a GPU path gets here

        # the input must sit in the registered buffer where the peers read it: one
        # device-to-device copy on the current stream (the kernel then writes the caller's tensor)
        flat = tensor.view(-1)
        lay = self.layout
        staged = self._buf[lay.data:lay.data + flat.numel() * flat.element_size()].view(flat.dtype)
        staged.copy_(flat)
        self._flag = (self._flag + 1) & 0xFFFFFFFF or 1
        fn = self._module.get_function(p.kernel)
        u64, i32 = np.uint64, np.int32
        head = (u64(self._ptrs.data_ptr()),)
        if p.algorithm == "twoshot":
            head += (u64(self._tmps.data_ptr()),)
        args = head + (u64(self._sigs.data_ptr()), u64(tensor.data_ptr()), u64(p.count),
                       i32(self.rank), i32(self.world_size), np.uint32(self._flag),
                       i32(p.op_code), i32(p.avg))
        stream = torch.cuda.current_stream(tensor.device)
        with cupy.cuda.Device(self.device), cupy.cuda.ExternalStream(stream.cuda_stream):
            fn((p.grid,), (p.block,), args)


def _p2p_ok(dev_a: int, dev_b: int) -> bool:
    try:
        return p2p_works(dev_a, dev_b)
    except Exception as exc:  # a driver error is a failed test, reported through the records
        log.info("cuda_ipc: P2P test cuda:%d -> cuda:%d raised %s", dev_a, dev_b, exc)
        return False


@register_transport("cuda_ipc")
class CudaIpcTransport(Transport):
    """CUDA IPC attached to a group: the group-wide verdict (``check``), the pure per-call rule
    (:meth:`decide`, what selection asks) and the runtime that launches the kernels
    (:class:`CudaIpcAllReduce`; None in host-side tests, where only the decisions run)."""

    def __init__(self, check: GroupCheck, world_size: int, runtime: CudaIpcAllReduce | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.check, self.world_size, self.runtime = check, world_size, runtime
        self.max_bytes = max_bytes

    @property
    def buffers(self):
        """This rank's registered IPC allocation (flags, input area, two-shot scratch)."""
        return None if self.runtime is None else self.runtime._buf

    @classmethod
    def attach(cls, engine, group_name: str, facts: GroupFacts) -> "CudaIpcTransport | str":
        """Collective over ``engine``: attached where the engine moves CUDA memory, every rank
        sees a CUDA device, the ranks share a host and :func:`check_group` passes; else why not.
        Decided from ``facts`` without communicating wherever it can be."""
        size = engine.size
        why = refusal(engine, "cuda", "cuda_ipc")
        if why is not None:
            return why
        if not all(facts.cuda_devices):
            return f"rank {facts.cuda_devices.index(0)} has no CUDA device (CUDA is absent there)"
        if not facts.one_host:
            return f"the ranks span {facts.host_count} hosts (CUDA IPC needs one)"
        if size not in WORLD_SIZES:
            return f"world size {size} is not one of {WORLD_SIZES}"
        # every rank counted a device, but this one may not be usable: the runtime's exchange then
        # tells every rank (its record has no device), and the transport is not attached
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def fallback(tensor, op):
            engine.wait([engine.all_reduce(tensor, op)])

        runtime = CudaIpcAllReduce(engine_exchange(engine), engine.rank, size, device, fallback)
        if not runtime.check.usable:
            return runtime.check.reason
        return cls(runtime.check, size, runtime)

    def decide(self, nbytes: int, dtype: torch.dtype, op: ReduceOp) -> Decision:
        """The pure rule for one all-reduce of ``nbytes`` of ``dtype`` with ``op``: "oneshot",
        "twoshot" or "nccl", and why (the same on every rank)."""
        if not self.check.usable:
            return Decision("nccl", self.check.reason)
        if dtype is None or op is None:
            return Decision("nccl", "not a reduction of a known dtype")
        return decide(nbytes, dtype, op, self.world_size, full_nvlink=self.check.full_nvlink,
                      p2p_ok=True, max_bytes=self.max_bytes)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, kind: str, fallback: Callable):
        """Run the ``kind`` kernel on ``tensor`` in place (queued on torch's current stream, so
        complete for the host as NCCL's calls are: no handles), or ``fallback()``'s handles
        where this call cannot run the kernels."""
        if self.runtime is None:
            return fallback()
        handles = self.runtime.all_reduce(tensor, op, kind, fallback)
        return [] if handles is None else handles

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
