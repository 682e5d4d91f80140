"""Delegation to the engine's own collective (MPI_Iallreduce, a torch.distributed collective,
ncclAllReduce): one step, one handle. A one-step algorithm returns its handles as a list instead
of yielding them, which spares the latency path a generator."""

from __future__ import annotations

from .registry import register_algorithm


def _prepare_all_reduce(res, out, inp, op, blocking):
    """A pre-bound engine call for repeated all-reduces of ``out`` (``inp`` is ``out``: in place;
    see commlib/runtime/plans.py)."""
    return res.engine.prepare_all_reduce(out, op, blocking)


# The engines' own collectives have no formula: calibration measures their curves, and without
# one the selector prices them as the cheapest formula (engines run one of these algorithms).
# They run on every device the engine moves.
_ANY = frozenset({"cpu", "cuda"})


@register_algorithm("native", "all_reduce", prepare=_prepare_all_reduce, devices=_ANY)
def all_reduce(ctx, buf):
    return [ctx.backend.all_reduce(buf, ctx.op, ctx.blocking)]


@register_algorithm("native", "broadcast", devices=_ANY)
def broadcast(ctx, buf, root):
    return [ctx.backend.broadcast(buf, root, ctx.blocking)]


@register_algorithm("native", "reduce", devices=_ANY)
def reduce(ctx, buf, root):
    return [ctx.backend.reduce(buf, ctx.op, root, ctx.blocking)]


@register_algorithm("native", "all_gather", devices=_ANY)
def all_gather(ctx, out, inp):
    return [ctx.backend.all_gather(out, inp, ctx.blocking)]


@register_algorithm("native", "reduce_scatter", devices=_ANY)
def reduce_scatter(ctx, out, inp):
    return [ctx.backend.reduce_scatter(out, inp, ctx.op, ctx.blocking)]


@register_algorithm("native", "all_to_all", devices=_ANY)
def all_to_all(ctx, out, inp, out_counts, in_counts):
    return [ctx.backend.all_to_all(out, inp, out_counts, in_counts, ctx.blocking)]


@register_algorithm("native", "barrier", devices=_ANY)
def barrier(ctx):
    return [ctx.backend.barrier(ctx.blocking)]
