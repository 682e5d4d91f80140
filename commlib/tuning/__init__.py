"""Algorithm choice by the cost model.

For every call: predict each eligible algorithm's time with the group's calibrated α-β-γ model
(:mod:`commlib.tuning.model`; measured curves from ``bench/calibrate.py`` where present, see
:mod:`commlib.tuning.calibration`) and take the cheapest. Every rank of a group holds the same
model (rank 0's, agreed at group creation by the runtime, :mod:`commlib.tuning.selector`), so
every rank picks the same algorithm. The choice is memoized per (collective, power-of-two size
bucket, group) for CPU tensors and per exact call for CUDA tensors (the CUDA IPC kernels' rule
depends on the exact size, dtype and op), and logged at ``COMMLIB_LOG=INFO`` with the predicted
times; :func:`explain_call` returns the whole table (``commlib.explain`` is the public entry).

Precedence: the call's ``algorithm=`` keyword > ``COMMLIB_ALGO`` (when the collective has that
algorithm) > the model. CUDA tensors are priced on :func:`~commlib.tuning.model.gpu_table`
(NCCL's constants): the engine's own collective against the CUDA IPC kernels where the group has
them. Nothing here communicates.
"""

from __future__ import annotations

import logging

import torch

from .. import config
from ..algorithms import registry as _registry
from ..algorithms.registry import Call, algorithm_names, get_algorithm
from ..errors import arg_error
from ..ops import accumulation_dtype
from .selector import Explanation, GroupModel, explain_group, ineligible, predictions

__all__ = ["select", "explain_call", "clear_cache", "widening", "Explanation", "GroupModel",
           "bucket_sizes"]

log = logging.getLogger("commlib")

_epoch = 0  # bumped by clear_cache: every group's memoized choices are made again


_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})


def widening(collective: str, dtype, group) -> int:
    """How many times larger the buffer is that a reduction of ``dtype`` runs on when the
    algorithm leaves accumulation to the engine: 2 for float16/bfloat16 where the engine cannot
    reduce them (they are upcast to float32), else 1."""
    backend = group.backend
    if dtype is None or collective not in _REDUCING or backend is None or dtype is torch.bool \
            or dtype in backend.native_reduce_dtypes:
        return 1
    return accumulation_dtype(dtype).itemsize // dtype.itemsize


def _choose(call: Call, group, widen: int = 1) -> tuple[str, str, list]:
    collective = call.collective
    forced = config.get("algo")
    if forced is not None and get_algorithm(collective, forced) is not None:
        return forced, "COMMLIB_ALGO", []
    model = group.model
    if model is None or model.table_for(call.device) is None:
        why = "one rank" if group.size == 1 else "the engine's own: no cost model for this engine"
        return "native", why, []
    preds = predictions(call, group.size, group.resources, model, widen)
    if not preds:  # no formula and nothing measured (all_to_all, barrier): the engine's own
        return "native", "cost model: nothing to compare", []
    best = preds[0]
    runner = f", next {preds[1].algorithm} {preds[1].seconds * 1e6:.1f} us" if len(preds) > 1 else ""
    why = f"cost model: {best.seconds * 1e6:.1f} us ({best.how}){runner}"
    if call.device != "cpu" and best.algorithm == "native":
        # say why the group's own kernels did not run (the NCCL fallback's logged reason)
        excluded = ineligible(group.resources, call)
        if excluded:
            why += "; " + "; ".join(f"{n}: {w}" for n, w in excluded.items())
    return best.algorithm, why, preds


def select(collective: str, nbytes: int, group, algorithm: str | None, fn: str, dtype=None,
           device: str = "cpu", op=None):
    """The algorithm record (:class:`commlib.algorithms.Algorithm`) that runs ``collective`` of
    ``nbytes`` on ``group`` (of ``dtype`` and ``op``, for reductions: see :func:`widening`; on
    tensors of ``device`` type). Memoized per (collective, power-of-two size bucket, group,
    widening) for CPU tensors, per exact call for others, in the group's own table (a new group
    never inherits a dead one's choices) and again after an algorithm is (un)registered."""
    if algorithm is not None:
        chosen = get_algorithm(collective, algorithm)
        if chosen is None:
            raise arg_error(fn, "algorithm", algorithm,
                            f"{collective} has no such algorithm",
                            f"use one of {algorithm_names(collective)} or None for automatic")
        return chosen
    widen = widening(collective, dtype, group)
    if device == "cpu":
        key = (collective, nbytes.bit_length(), widen, *memo_key())
    else:
        key = (collective, nbytes, widen, *memo_key(), device, dtype, op)
    memo = group.resources.choices
    hit = memo.get(key)
    if hit is None:
        call = Call(collective, nbytes, device, dtype, op)
        name, why, _ = _choose(call, group, widen)
        hit = memo[key] = get_algorithm(collective, name)
        log.info("%s of %d bytes on group %s: algorithm %s (%s)", collective, nbytes, group.name,
                 name, why)
    return hit


def explain_call(op: str, nbytes: int, group, dtype=None, device: str = "cpu",
                 reduce_op=None) -> Explanation:
    """The model's table for ``op`` of ``nbytes`` on ``group`` (checked arguments: see
    ``commlib.explain``). Local: no communication."""
    widen = widening(op, dtype, group)
    call = Call(op, nbytes, device, dtype, reduce_op)
    name, why, _ = _choose(call, group, widen)
    model = group.model
    if model is None or model.table_for(device) is None:
        return Explanation(op, nbytes, group.name, group.size, "none", [], name, why)
    return explain_group(call, group, model, name, why, widen)


def memo_key() -> tuple[int, int]:
    """What a memo of choices made from the cost model is keyed with (the algorithm registry's
    version and clear_cache's epoch), so that it is made again when either changes."""
    return _registry._version, _epoch


def clear_cache() -> None:
    """Make every memoized choice again (after changing what selection reads: the tuning file,
    a group's transports)."""
    global _epoch
    _epoch += 1



def bucket_sizes(group, grad_bytes: int, dtype=torch.float32) -> tuple[int, int, str]:
    """Gradient bucket sizes for data parallelism on ``group`` from its cost model: ``(bucket,
    first, why)`` in bytes. ``bucket`` is the smallest all-reduce that reaches 90% of the group's
    bandwidth (the chosen algorithm's predicted bytes per second, against its best from 64 KiB
    to 256 MiB): past it a bigger bucket gains nothing and starts later. ``first`` reaches 50%:
    the last layers' gradients, ready first, leave at once. At most half the gradients, so there
    are at least two buckets to overlap. Local: no communication."""
    sizes = [1 << k for k in range(16, 29)]
    rates = []
    for n in sizes:
        table = explain_call("all_reduce", n, group, dtype)
        row = next((r for r in table.rows if r.algorithm == table.chosen), None)
        if row is None or row.seconds <= 0:
            return 25 << 20, 1 << 20, "no cost model for this group: DDP's defaults (25 MB, 1 MB)"
        rates.append(n / row.seconds)
    best = max(rates)
    bucket = next(n for n, r in zip(sizes, rates) if r >= 0.9 * best)
    first = next(n for n, r in zip(sizes, rates) if r >= 0.5 * best)
    cap = max(grad_bytes // 2, 1 << 16)
    why = (f"all_reduce reaches 90% of its best rate ({best / 1e9:.2f} GB/s) at {bucket >> 10} KiB "
           f"and 50% at {first >> 10} KiB on this group")
    if bucket > cap:
        why += f"; capped at half the gradients ({cap >> 10} KiB) for two buckets at least"
    return min(bucket, cap), min(first, cap), why
