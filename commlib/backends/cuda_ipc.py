"""The ``cuda_ipc`` backend: one-shot and two-shot all-reduce of CUDA tensors over CUDA IPC
buffers, for GPUs of one node (the kernels are ``csrc/cuda_ipc.cu``, loaded through CuPy
``RawModule``; the per-element math is ``csrc/reduce_math.h``, shared with the CPU path).

Everything that decides is here, in plain Python, and unit-tested without a GPU
(tests/test_cuda_ipc.py): the buffer layout, the size limits, the launch shape, and the choice
between one-shot, two-shot and the NCCL fallback. The parts that need a GPU (IPC handle exchange,
the P2P test, launches) run only where CUDA is present.

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

import logging
import pathlib
from typing import NamedTuple

import torch

from ..errors import CommBackendError, arg_error
from ..ops import ReduceOp

__all__ = ["MAX_RANKS", "MAX_BLOCKS", "Layout", "Decision", "layout", "decide", "launch_shape",
           "kernel_name", "load_module", "p2p_works"]

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
_CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"


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


_MODULE = None


def load_module():
    """csrc/cuda_ipc.cu compiled by NVRTC through CuPy (once per process)."""
    global _MODULE
    if _MODULE is None:
        try:
            import cupy
        except ImportError as exc:
            raise CommBackendError(
                f"commlib cuda_ipc: CuPy is not installed ({exc}). Fix: pip install "
                f"'commlib[cuda]', or use backend='nccl'") from exc
        source = (_CSRC / "cuda_ipc.cu").read_text()
        _MODULE = cupy.RawModule(code=source, options=("-std=c++17", f"-I{_CSRC}"))
    return _MODULE


def p2p_works(dev_a: int, dev_b: int, nbytes: int = 1 << 16) -> bool:
    """A real peer-to-peer test: ``cudaDeviceCanAccessPeer`` both ways, then a copy from
    ``dev_a`` to ``dev_b`` that must arrive intact (some systems report access that does not
    work, as vLLM found)."""
    import cupy

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
