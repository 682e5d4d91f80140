"""Delegation to the engine's own collective (MPI_Iallreduce, a torch.distributed collective,
ncclAllReduce): one step, one handle. A one-step algorithm returns its handles as a list instead
of yielding them, which spares the latency path a generator."""

from __future__ import annotations

from . import register_algorithm


@register_algorithm("native", "all_reduce")
def all_reduce(ctx, buf):
    return [ctx.backend.all_reduce(buf, ctx.op, ctx.blocking)]


def _prepare_all_reduce(backend, out, inp, op, blocking):
    """A pre-bound engine call for repeated all-reduces of ``out`` (``inp`` is ``out``: in place;
    see commlib/_plans.py)."""
    return backend.prepare_all_reduce(out, op, blocking)


all_reduce.prepare = _prepare_all_reduce


@register_algorithm("native", "broadcast")
def broadcast(ctx, buf, root):
    return [ctx.backend.broadcast(buf, root, ctx.blocking)]


@register_algorithm("native", "reduce")
def reduce(ctx, buf, root):
    return [ctx.backend.reduce(buf, ctx.op, root, ctx.blocking)]


@register_algorithm("native", "all_gather")
def all_gather(ctx, out, inp):
    return [ctx.backend.all_gather(out, inp, ctx.blocking)]


@register_algorithm("native", "reduce_scatter")
def reduce_scatter(ctx, out, inp):
    return [ctx.backend.reduce_scatter(out, inp, ctx.op, ctx.blocking)]


@register_algorithm("native", "all_to_all")
def all_to_all(ctx, out, inp, out_counts, in_counts):
    return [ctx.backend.all_to_all(out, inp, out_counts, in_counts, ctx.blocking)]


@register_algorithm("native", "barrier")
def barrier(ctx):
    return [ctx.backend.barrier(ctx.blocking)]
