"""The plan cache of the latency path.

A blocking ``all_reduce`` on the same tensor, op and group as a previous call (the training-loop
case) skips argument checks, algorithm choice and buffer preparation: the first call validates
everything and stores a plan (a pre-bound engine call); later calls check in a few attribute
reads that the plan still describes the tensor (same object, same memory, same size, still
contiguous) and run it. Measured on this machine kind, the full path costs ~3 µs of Python per
call and the planned one ~1 µs, against a 1.4 µs engine call at 8 B.

Plans hold the tensor only weakly and the engine's view of its memory without an owner, so a
plan never keeps memory alive; a dead or replaced tensor simply misses. ``commlib.finalize()``
clears the cache.
"""

from __future__ import annotations

import weakref

__all__ = ["PLANS", "remember", "clear"]

# id(tensor) -> (weakref, op, group argument, algorithm argument, data_ptr, numel, Group, post)
PLANS: dict[int, tuple] = {}
_LIMIT = 64


def remember(tensor, op, group_arg, algorithm, group, post) -> None:
    if len(PLANS) >= _LIMIT:
        PLANS.clear()
    PLANS[id(tensor)] = (weakref.ref(tensor), op, group_arg, algorithm, tensor.data_ptr(),
                         tensor.numel(), group, post)


def clear() -> None:
    PLANS.clear()
