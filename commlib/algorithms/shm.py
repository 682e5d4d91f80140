"""Collectives through the group's shared-memory segment (commlib/transports/shm.py, csrc/shm/).

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
AVG divides in the accumulation type), which the record's ``reduces_natively`` tells the API
layer (for groups with a segment), so it neither upcasts nor divides.

Costs (used when calibration has not measured their curves, priced on the table's ``shm`` link:
``α`` a flag handshake, ``β`` a copy's seconds per byte, ``γ`` a read-and-reduce's) are next to
each algorithm; the records name the ``shm`` transport, so the selector offers them only where
the group has a segment.

A blocking call runs in C to completion (``ctx.blocking``); otherwise the operation is started
and returned as the handle the poll loop and ``Work`` advance.
"""

from __future__ import annotations

import torch

from ..ops import ReduceOp
from ..transports.shm import CALL_DTYPES, DTYPE_CODES, KIND, OP_CODES, run_op
from . import native
from .registry import register_algorithm

__all__ = ["all_reduce_oneshot", "all_reduce_twoshot"]

_SUM = OP_CODES[ReduceOp.SUM]
_U8 = DTYPE_CODES[torch.uint8]
_CALL_DTYPE = {t: i for i, t in enumerate(CALL_DTYPES)}


def _call_dtype(t) -> int:
    """The dtype code of a call the ranks compare, where the data moves as bytes (255: other)."""
    return _CALL_DTYPE.get(t.dtype, 255)


def _segment(ctx, t):
    """The group's segment, or None: no segment (or a bare communicator), or a CUDA buffer. (A
    group that cannot run operations any more never gets here: the API checks before.)"""
    res = ctx.res
    seg = res.shm if res is not None else None
    if seg is None or t.is_cuda:
        return None
    return seg


def _reduction(ctx, kind: str, out, inp, count: int, name: str):
    seg = _segment(ctx, out)
    if seg is None:  # a group without a segment (one rank, several hosts): the engine's own
        fallback = native.reduce_scatter if kind == "reduce_scatter" else native.all_reduce
        return fallback(ctx, out, inp) if kind == "reduce_scatter" else fallback(ctx, out)
    avg = ctx.size if ctx.op is ReduceOp.AVG else 0
    return run_op(ctx, seg, _reduce_call(seg, kind, out, inp, count, ctx.op, avg), name)


def _reduce_call(seg, kind: str, out, inp, count: int, op, avg: int = 0):
    """The segment's C call that reduces ``count`` elements of ``inp`` into ``out`` (``avg``: the
    divisor of AVG, else 0)."""
    return seg.op(KIND[kind], inp.data_ptr(), out.data_ptr(), count, DTYPE_CODES[out.dtype],
                  OP_CODES[op], avg, 0)


def _move_call(seg, kind: str, src, dst, root: int = 0):
    """The segment's C call that moves ``src`` into ``dst`` as bytes (any dtype; the ranks still
    compare ``src``'s dtype)."""
    s, d = _bytes(src), _bytes(dst)
    return seg.op(KIND[kind], s.data_ptr(), d.data_ptr(), s.numel(), _U8, _SUM, 0, root,
                  _call_dtype(src))


def reduces_natively(res, t) -> bool:
    """Whether this algorithm reduces ``t`` itself on a group with resources ``res`` (every
    dtype, AVG included): true where it runs on a segment, false where it falls back to the
    engine."""
    return res.shm is not None and not t.is_cuda


def _prepare(kind: str):
    """``prepare(backend, out, inp, op, blocking)``: a pre-bound C call for repeated blocking calls
    on the same buffers (commlib/runtime/plans.py), or None. It holds the buffers' addresses, never
    the tensors. ``op`` is None for all_gather (bytes are moved, any dtype)."""
    def prepare(res, out, inp, op, blocking):
        seg = res.shm
        if not blocking or seg is None or seg.closed or out.is_cuda:
            return None
        if kind == "all_gather":
            return _move_call(seg, kind, inp, out)
        return _reduce_call(seg, kind, out, inp, out.numel(), op)
    return prepare


def _all_reduce(kind: str):
    def algorithm(ctx, buf):
        return _reduction(ctx, kind, buf, buf, buf.numel(), "all_reduce")

    algorithm.__name__ = algorithm.__qualname__ = f"all_reduce_{kind}"
    return algorithm


def _oneshot_cost(p, n, link):
    # copy in; reduce all p regions into the output (the first one copied)
    return link.alpha + 2 * n * link.beta + (p - 1) * n * link.gamma


def _twoshot_cost(p, n, link):
    # copy in the peers' slices; reduce own slice (own part from the input) into the output and
    # the region; copy the peers' reduced slices out
    return 2 * link.alpha + 2 * n * link.beta + (p - 1) / p * n * link.gamma


def _reduce_scatter_cost(p, n, link):
    # copy in the peers' blocks; reduce own block (own part from the input) into the output
    return link.alpha + n * link.beta + (p - 1) / p * n * link.gamma


def _all_gather_cost(p, n, link):
    return link.alpha + (1 + 1 / p) * n * link.beta


def _broadcast_cost(p, n, link):
    return link.alpha + 2 * n * link.beta


all_reduce_oneshot = register_algorithm(
    "shm_oneshot", "all_reduce", cost=_oneshot_cost, transport="shm", prepare=_prepare("oneshot"),
    reduces_natively=reduces_natively)(_all_reduce("oneshot"))
all_reduce_twoshot = register_algorithm(
    "shm_twoshot", "all_reduce", cost=_twoshot_cost, transport="shm", prepare=_prepare("twoshot"),
    reduces_natively=reduces_natively)(_all_reduce("twoshot"))


@register_algorithm("shm", "reduce_scatter", cost=_reduce_scatter_cost, transport="shm",
                    prepare=_prepare("reduce_scatter"), reduces_natively=reduces_natively)
def reduce_scatter(ctx, out, inp):
    return _reduction(ctx, "reduce_scatter", out, inp, out.numel(), "reduce_scatter_tensor")


def _bytes(t):
    return t.view(-1).view(torch.uint8)  # data movement: any dtype, as bytes


# An input that is this rank's block of the output needs no copy: the rank never writes that
# block (nothing to copy onto itself) and the peers only read it.
@register_algorithm("shm", "all_gather", cost=_all_gather_cost, transport="shm",
                    prepare=_prepare("all_gather"), gathers_in_place=reduces_natively)
def all_gather(ctx, out, inp):
    seg = _segment(ctx, out)
    if seg is None:
        return native.all_gather(ctx, out, inp)
    return run_op(ctx, seg, _move_call(seg, "all_gather", inp, out), "all_gather_into_tensor")



@register_algorithm("shm", "broadcast", cost=_broadcast_cost, transport="shm")
def broadcast(ctx, buf, root):
    seg = _segment(ctx, buf)
    if seg is None:
        return native.broadcast(ctx, buf, root)
    return run_op(ctx, seg, _move_call(seg, "broadcast", buf, buf, root), "broadcast")
