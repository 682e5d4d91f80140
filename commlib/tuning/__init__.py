"""Algorithm choice by the cost model.

For every call: predict each eligible algorithm's time with the group's calibrated α-β-γ model
(:mod:`commlib.tuning.model`; measured curves from ``bench/calibrate.py`` where present, see
:mod:`commlib.tuning.calibration`) and take the cheapest. Every rank of a group holds the same
model (rank 0's, agreed at group creation, :mod:`commlib.tuning.selector`), so every rank picks
the same algorithm. The choice is memoized per (collective, power-of-two size bucket, group) and
logged at ``COMMLIB_LOG=INFO`` with the predicted times; :func:`explain` returns the whole table.

Precedence: the call's ``algorithm=`` keyword > ``COMMLIB_ALGO`` (when the collective has that
algorithm) > the model. Groups whose engine moves only GPU memory (NCCL) use the engine's own
collective: the model's GPU link classes plan machines (``python -m commlib.tuning``), they do
not yet choose at run time.
"""

from __future__ import annotations

import logging

import torch

from .. import config
from ..algorithms import algorithm_names, get_algorithm
from ..errors import arg_error
from ..ops import accumulation_dtype
from .selector import Explanation, GroupModel, explain_group, predictions, setup

__all__ = ["select", "explain", "attach_model", "clear_cache", "Explanation"]

log = logging.getLogger("commlib")

_memo: dict[tuple, tuple] = {}


def attach_model(group) -> GroupModel | None:
    """Collective over ``group`` (called by its constructor on every member): the group's agreed
    cost model, or None where selection does not use one (one rank; GPU-only engines)."""
    backend = group.backend
    if backend is None or group.size < 2 or "cpu" not in backend.devices:
        return None
    return setup(group)


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


def _choose(collective: str, nbytes: int, group, widen: int = 1) -> tuple[str, str, list]:
    forced = config.get("algo")
    if forced is not None and get_algorithm(collective, forced) is not None:
        return forced, "COMMLIB_ALGO", []
    model = getattr(group, "model", None)
    if model is None:
        why = "one rank" if group.size == 1 else "the engine's own: no cost model for this engine"
        return "native", why, []
    preds = predictions(collective, nbytes, group, model, widen)
    if not preds:  # no formula and nothing measured (all_to_all, barrier): the engine's own
        return "native", "cost model: nothing to compare", []
    best = preds[0]
    runner = f", next {preds[1].algorithm} {preds[1].seconds * 1e6:.1f} us" if len(preds) > 1 else ""
    return best.algorithm, f"cost model: {best.seconds * 1e6:.1f} us ({best.how}){runner}", preds


def select(collective: str, nbytes: int, group, algorithm: str | None, fn: str, dtype=None):
    """The algorithm (its generator function) that runs ``collective`` of ``nbytes`` on
    ``group`` (of ``dtype``, for reductions: see :func:`widening`). Memoized per (collective,
    power-of-two size bucket, group, widening)."""
    if algorithm is not None:
        chosen = get_algorithm(collective, algorithm)
        if chosen is None:
            raise arg_error(fn, "algorithm", algorithm,
                            f"{collective} has no such algorithm",
                            f"use one of {algorithm_names(collective)} or None for automatic")
        return chosen
    widen = widening(collective, dtype, group)
    key = (collective, nbytes.bit_length(), id(group), widen)
    hit = _memo.get(key)
    if hit is None:
        name, why, _ = _choose(collective, nbytes, group, widen)
        hit = _memo[key] = (get_algorithm(collective, name), name)
        log.info("%s of %d bytes on group %s: algorithm %s (%s)", collective, nbytes, group.name,
                 name, why)
    return hit[0]


def explain(op: str, nbytes: int, group=None, dtype=None) -> Explanation:
    """The model's table for ``op`` (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``,
    ``"broadcast"``, ``"reduce"``, ...) of ``nbytes`` on ``group`` (default: world): every eligible
    algorithm's predicted time and how it was priced (``measured`` curve or ``formula``), and the
    algorithm a call would use. ``print(commlib.tuning.explain("all_reduce", 1 << 20))``.
    ``dtype``: the tensor's, for reductions: float16/bfloat16 make the algorithms that leave the
    accumulation to the engine pay a float32 copy where the engine cannot reduce them (rows
    marked ``x2 upcast``). Local: no communication."""
    from ..algorithms import COLLECTIVES
    from ..group import resolve_group

    if op not in COLLECTIVES:
        raise arg_error("tuning.explain", "op", op, f"is not one of {list(COLLECTIVES)}",
                        "pass a collective's name, e.g. 'all_reduce'")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise arg_error("tuning.explain", "nbytes", nbytes, "must be a non-negative int",
                        "pass the message size in bytes")
    g = resolve_group(group, "tuning.explain")
    widen = widening(op, dtype, g)
    name, why, _ = _choose(op, nbytes, g, widen)
    model = getattr(g, "model", None)
    if model is None:
        return Explanation(op, nbytes, g.name, g.size, "none", [], name, why)
    return explain_group(op, nbytes, g, model, name, why, widen)


def clear_cache() -> None:
    _memo.clear()
