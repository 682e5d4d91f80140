"""Collectives through the group's shared-memory segment (commlib/backends/shm.py, csrc/shm.c).

* ``shm_oneshot`` all_reduce: every rank copies its input into its region, then reduces every
  region in rank order. The order is the same on every rank, so the results are bitwise
  identical on all ranks. One flag step per chunk: the latency algorithm.
* ``shm_twoshot`` all_reduce: rank i reduces slice i of every region (a reduce-scatter), then
  every rank copies every reduced slice (an all-gather). Each rank reads 2x the data instead of
  n x: the bandwidth algorithm. Each element is still reduced once, in rank order, so the
  results are bitwise identical on all ranks too.
* ``shm`` reduce_scatter, all_gather, broadcast: one step per chunk.

Messages larger than a region (``COMMLIB_SHM_SLOT_BYTES``) are pipelined chunk by chunk.
A group without a segment (one rank, ranks on several hosts, COMMLIB_SHM=0) runs these names as
the engine's native collective, so that a forced algorithm works on every group. Where the group
has a segment, every dtype is reduced here directly (float16/bfloat16 accumulate in float32 and round once;
AVG divides in the accumulation type), which the ``reduces_natively`` attribute tells the API
layer (for groups with a segment), so it neither upcasts nor divides.

A blocking call runs in C to completion (``ctx.blocking``); otherwise the operation is started
and returned as the handle the poll loop and ``Work`` advance.
"""

from __future__ import annotations

import torch

from ..backends.shm import DTYPE_CODES, KIND, OP_CODES, check_usable, run_op
from ..ops import ReduceOp
from . import native, register_algorithm

__all__ = ["all_reduce_oneshot", "all_reduce_twoshot"]

_SUM = OP_CODES[ReduceOp.SUM]
_U8 = DTYPE_CODES[torch.uint8]


def _segment(ctx, t, name: str):
    """The group's segment, or None: no segment, or a CUDA buffer (cuda_ipc's business)."""
    seg = getattr(ctx.backend, "shm", None)
    if seg is None or t.is_cuda:
        return None
    check_usable(ctx.backend, name)
    return seg


def _reduction(ctx, kind: str, out, inp, count: int, name: str):
    seg = _segment(ctx, out, name)
    if seg is None:  # a group without a segment (one rank, several hosts): the engine's own
        fallback = native.reduce_scatter if kind == "reduce_scatter" else native.all_reduce
        return fallback(ctx, out, inp) if kind == "reduce_scatter" else fallback(ctx, out)
    op = ctx.op
    avg = ctx.size if op is ReduceOp.AVG else 0
    handle = seg.op(KIND[kind], inp.data_ptr(), out.data_ptr(), count, DTYPE_CODES[out.dtype],
                    OP_CODES[op], avg, 0)
    return run_op(ctx, seg, handle, name)


def reduces_natively(backend, t) -> bool:
    """Whether this algorithm reduces ``t`` itself on ``backend`` (every dtype, AVG included):
    true where it runs on a segment, false where it falls back to the engine."""
    return getattr(backend, "shm", None) is not None and not t.is_cuda


def _prepare(kind: str):
    """``prepare(backend, out, inp, op, blocking)``: a pre-bound C call for repeated blocking calls
    on the same buffers (commlib/_plans.py), or None. It holds the buffers' addresses, never the
    tensors. ``op`` is None for all_gather (bytes are moved, any dtype)."""
    def prepare(backend, out, inp, op, blocking):
        seg = getattr(backend, "shm", None)
        if not blocking or seg is None or seg.closed or out.is_cuda:
            return None
        if kind == "all_gather":
            src, dst = _bytes(inp), _bytes(out)
            return seg.op(KIND[kind], src.data_ptr(), dst.data_ptr(), src.numel(), _U8, _SUM, 0, 0)
        return seg.op(KIND[kind], inp.data_ptr(), out.data_ptr(), out.numel(),
                      DTYPE_CODES[out.dtype], OP_CODES[op], 0, 0)
    return prepare


def _all_reduce(kind: str):
    def algorithm(ctx, buf):
        return _reduction(ctx, kind, buf, buf, buf.numel(), "all_reduce")

    algorithm.prepare = _prepare(kind)
    algorithm.reduces_natively = reduces_natively
    algorithm.__name__ = algorithm.__qualname__ = f"all_reduce_{kind}"
    return algorithm


all_reduce_oneshot = register_algorithm("shm_oneshot", "all_reduce")(_all_reduce("oneshot"))
all_reduce_twoshot = register_algorithm("shm_twoshot", "all_reduce")(_all_reduce("twoshot"))


@register_algorithm("shm", "reduce_scatter")
def reduce_scatter(ctx, out, inp):
    return _reduction(ctx, "reduce_scatter", out, inp, out.numel(), "reduce_scatter_tensor")


reduce_scatter.reduces_natively = reduces_natively
reduce_scatter.prepare = _prepare("reduce_scatter")


def _bytes(t):
    return t.view(-1).view(torch.uint8)  # data movement: any dtype, as bytes


@register_algorithm("shm", "all_gather")
def all_gather(ctx, out, inp):
    seg = _segment(ctx, out, "all_gather_into_tensor")
    if seg is None:
        return native.all_gather(ctx, out, inp)
    src, dst = _bytes(inp), _bytes(out)
    handle = seg.op(KIND["all_gather"], src.data_ptr(), dst.data_ptr(), src.numel(), _U8, _SUM, 0, 0)
    return run_op(ctx, seg, handle, "all_gather_into_tensor")


all_gather.prepare = _prepare("all_gather")
# An input that is this rank's block of the output needs no copy: the rank never writes that
# block (nothing to copy onto itself) and the peers only read it.
all_gather.gathers_in_place = reduces_natively


@register_algorithm("shm", "broadcast")
def broadcast(ctx, buf, root):
    seg = _segment(ctx, buf, "broadcast")
    if seg is None:
        return native.broadcast(ctx, buf, root)
    b = _bytes(buf)
    handle = seg.op(KIND["broadcast"], b.data_ptr(), b.data_ptr(), b.numel(), _U8, _SUM, 0, root)
    return run_op(ctx, seg, handle, "broadcast")
