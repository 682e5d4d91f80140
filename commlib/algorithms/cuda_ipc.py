"""All-reduce of CUDA tensors through the group's CUDA IPC transport (commlib/transports/cuda_ipc.py,
csrc/cuda_ipc.cu): ``cuda_ipc_oneshot`` (every rank reads every peer's input and reduces: the
latency algorithm) and ``cuda_ipc_twoshot`` (a reduce-scatter then an all-gather through the
peers' scratch areas: the bandwidth algorithm), after vLLM's custom all-reduce.

The kernels' rules (dtypes, ops, alignment, the registered buffer's size, world sizes, NVLink, and
which of the two fits the size) are the transport's pure :func:`~commlib.transports.cuda_ipc.decide`;
each record is eligible exactly where that rule names it, so the selector compares it with the
engine's own all-reduce (NCCL) on the cost model, and where neither is eligible the call runs on
NCCL with the reason logged. Costs are priced on the table's ``cuda_ipc`` link (``α``: a launch
and a flag handshake; ``β``: a peer read over NVLink per byte).
"""

from __future__ import annotations

from ..kernels import finish_avg_
from ..ops import ReduceOp
from . import native
from .registry import register_algorithm

__all__ = ["all_reduce_oneshot", "all_reduce_twoshot"]

_CUDA = frozenset({"cuda"})


def _eligible(kind: str):
    def eligible(res, call) -> str | None:
        decision = res.transports["cuda_ipc"].decide(call.nbytes, call.dtype, call.op)
        if decision.algorithm != kind:
            return decision.reason if decision.algorithm == "nccl" else f"{decision.algorithm}: {decision.reason}"
        return None

    return eligible


def _reduces_natively(res, t) -> bool:
    # float16/bfloat16 accumulate in float32 inside the kernels, and AVG divides there
    return t.is_cuda and res.transports.get("cuda_ipc") is not None


def _engine(ctx, buf):
    """The engine's own all-reduce, for a CUDA call on a group with the transport that the kernels
    cannot run (forced where the rule says no): the API left AVG to this algorithm
    (``reduces_natively``), so it divides here."""
    if ctx.op is not ReduceOp.AVG:
        return native.all_reduce(ctx, buf)
    ctx.backend.wait(native.all_reduce(ctx._replace(op=ReduceOp.SUM), buf))
    finish_avg_(buf, ctx.size)
    return []


def _run(kind: str):
    def all_reduce(ctx, buf):
        ipc = ctx.res.transports.get("cuda_ipc") if ctx.res is not None else None
        if ipc is None or not buf.is_cuda:  # forced where it cannot run: the engine's own (and
            return native.all_reduce(ctx, buf)  # not reducing natively here: the API divides)
        return ipc.all_reduce(buf, ctx.op, kind, lambda: _engine(ctx, buf))

    all_reduce.__name__ = all_reduce.__qualname__ = f"all_reduce_{kind}"
    return all_reduce


# The input's staging copy runs at the GPU's memory bandwidth, an order above NVLink's: left out.
def _oneshot_cost(p, n, link):
    # read and reduce every peer's copy (the peers' reads run at once)
    return link.alpha + (p - 1) * n * link.beta


def _twoshot_cost(p, n, link):
    # reduce own slice from every peer (a reduce-scatter), then read the peers' reduced slices
    return 2 * link.alpha + 2 * (p - 1) / p * n * link.beta


all_reduce_oneshot = register_algorithm(
    "cuda_ipc_oneshot", "all_reduce", cost=_oneshot_cost, transport="cuda_ipc", devices=_CUDA,
    eligible=_eligible("oneshot"), reduces_natively=_reduces_natively)(_run("oneshot"))
all_reduce_twoshot = register_algorithm(
    "cuda_ipc_twoshot", "all_reduce", cost=_twoshot_cost, transport="cuda_ipc", devices=_CUDA,
    eligible=_eligible("twoshot"), reduces_natively=_reduces_natively)(_run("twoshot"))
