"""The plan cache of the latency path.

A blocking ``all_reduce`` on the same tensor, op and group as a previous call (the training-loop
case) skips argument checks, algorithm choice and buffer preparation: the first call validates
everything and stores a plan (a pre-bound engine call); later calls check in a few attribute
reads that the plan still describes the tensor (same object, same memory, same size, still
contiguous) and run it. Measured on this machine kind, the full path costs ~3 µs of Python per
call and the planned one ~1 µs, against a 1.4 µs engine call at 8 B.

``reduce_scatter_tensor`` and ``all_gather_into_tensor`` have the same path, keyed by their
(output, input) pair (:func:`remember_pair`, :func:`planned_pair`).

Plans hold the tensor only weakly and the engine's view of its memory without an owner, so a
plan never keeps memory alive; a dead or replaced tensor simply misses. ``commlib.finalize()``
clears the cache.
"""

from __future__ import annotations

import weakref

__all__ = ["PLANS", "PAIRS", "remember", "remember_pair", "planned_pair", "clear", "forget"]

# id(tensor) -> (weakref, op, group argument, algorithm argument, data_ptr, numel, Group, post)
PLANS: dict[int, tuple] = {}
_LIMIT = 64


def remember(tensor, op, group_arg, algorithm, group, post) -> None:
    if len(PLANS) >= _LIMIT:
        PLANS.clear()
    PLANS[id(tensor)] = (weakref.ref(tensor), op, group_arg, algorithm, tensor.data_ptr(),
                         tensor.numel(), group, post)


# (name, id(output), id(input)) -> (output ref, input ref, op, group argument, algorithm argument,
#                                   output data_ptr, input data_ptr, output numel, input numel,
#                                   Group, post)
PAIRS: dict[tuple, tuple] = {}


def remember_pair(name: str, out, inp, op, group_arg, algorithm, group, post) -> None:
    if len(PAIRS) >= _LIMIT:
        PAIRS.clear()
    PAIRS[(name, id(out), id(inp))] = (weakref.ref(out), weakref.ref(inp), op, group_arg,
                                       algorithm, out.data_ptr(), inp.data_ptr(), out.numel(),
                                       inp.numel(), group, post)


def planned_pair(name: str, out, inp, op, group_arg, algorithm):
    """(Group, post) of the plan stored for this exact call, or None."""
    plan = PAIRS.get((name, id(out), id(inp)))
    if plan is None:
        return None
    ro, ri, pop, pgroup, palgo, pout, pinp, nout, ninp, group, post = plan
    if ro() is out and ri() is inp and pop is op and pgroup is group_arg and palgo is algorithm \
            and out.data_ptr() == pout and inp.data_ptr() == pinp and out.numel() == nout \
            and inp.numel() == ninp and out.is_contiguous() and inp.is_contiguous():
        return group, post
    return None


def clear() -> None:
    PLANS.clear()
    PAIRS.clear()


def forget(group) -> None:
    """Drop the plans of ``group``'s calls (its model changed: their algorithms were chosen by the
    old one)."""
    for cache in (PLANS, PAIRS):
        for key in [k for k, plan in cache.items() if plan[-2] is group]:
            del cache[key]
