"""In-job calibration: a new group whose shape the tuning file does not know times its own
all-reduce algorithms, once, and keeps the result (what is measured and how it becomes the model:
:mod:`commlib.tuning.probe`; switched by ``COMMLIB_AUTOTUNE``).

Collective over the group, right after the group is built (``commlib.init``, ``new_group``,
``Mesh``), on every member: the decision to probe and its budget are rank 0's, agreed with the
model, and every later decision (repetitions, which algorithms stay, when to stop) is made from
times all-reduced to their maximum, so every rank takes the same path. Rank 0 saves the entry in
the tuning file (a failure to write is logged, not raised: the job keeps its measured model).
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from ..algorithms.registry import Call
from ..ops import ReduceOp
from ..tuning.calibration import make_entry, put_entry, table_for, tuning_path
from ..tuning.probe import ROUNDS, SIZES, describe, merge, repetitions, ring_link, still_racing
from ..tuning.selector import GroupModel, eligible
from .collectives import all_reduce
from .groups import GROUP_HOOKS

__all__ = ["autotune"]

log = logging.getLogger("commlib")


def autotune(group) -> None:
    """Probe ``group`` if its agreed model asks for it (``model.probe`` seconds > 0), then
    replace the model with the measured one. Collective over the group's members."""
    model = group.model if group.backend is not None else None
    if model is None or not model.probe or model.table is None or group.size < 2:
        return
    start = time.perf_counter()
    points = _measure(group, model.probe)
    seconds = time.perf_counter() - start
    runs = model.probed + 1
    if model.probed:  # earlier jobs' probes, agreed with the model: the minimum of them all
        previous = model.table.curves.get("all_reduce", {})
        points = merge({a: dict(zip(c.sizes, c.times)) for a, c in previous.items()}, points)
    base = model.table.link
    link = ring_link(points.get("ring", {}), group.size, base) or base
    cores = os.cpu_count() or 1
    how = describe(group.size, cores, points, seconds,
                   link if "ring" in points else None, runs)
    probe = {"how": how, "seconds": round(seconds, 3), "cores": cores, "runs": runs}
    entry = make_entry({"shm": link}, {"all_reduce": points}, probe)
    backend, key = group.backend.name, model.key
    table = table_for({"groups": {key: entry}}, backend, group.size)
    group.resources.model = GroupModel(table, f"{how} (entry {key})", model.gpu, 0.0, key, runs)
    group.resources.choices.clear()  # choices made during the probe, from the old model
    log.info("group %s: %s", group.name, how)
    if group.rank == 0:
        try:
            put_entry(tuning_path(), key, entry)
        except OSError as exc:
            log.warning("commlib: could not save the probed entry %s in %s (%s); this job uses "
                        "it, the next one probes again", key, tuning_path(), exc)


def _agreed(group, values: list[float]) -> list[float]:
    """Every rank's ``values``, element-wise maximum over the group (the slowest rank's)."""
    t = torch.tensor(values, dtype=torch.float64)
    all_reduce(t, ReduceOp.MAX, group=group, algorithm="native")
    return t.tolist()


def _loop(group, buf, name: str, reps: int) -> float:
    """Seconds per call of ``reps`` calls, after one untimed call: it lines the ranks up (a loop
    of one or two calls timed from unaligned starts measured up to 3x the call on 4 ranks
    sharing 2 cores) and leaves the caches in this algorithm's state."""
    all_reduce(buf, group=group, algorithm=name)
    start = time.perf_counter()
    for _ in range(reps):
        all_reduce(buf, group=group, algorithm=name)
    return (time.perf_counter() - start) / reps


def _measure(group, budget: float) -> dict[str, dict[int, float]]:
    """{algorithm: {nbytes: seconds}}: the medians over rounds of the slowest rank's time per
    call, size by size, until the agreed time spent passes ``budget``."""
    points: dict[str, dict[int, float]] = {}
    racing: list[str] | None = None
    spent = 0.0
    for nbytes in SIZES:
        call = Call("all_reduce", nbytes, "cpu", torch.float32, ReduceOp.SUM)
        names = [a for a in eligible(group.resources, call) if racing is None or a in racing]
        if not names:
            break
        buf = torch.zeros(max(1, nbytes // 4))  # zeros: sums of zeros stay finite
        first = _agreed(group, [_loop(group, buf, a, 1) for a in names])  # warm-up, agreed
        reps = [repetitions(t) for t in first]
        rounds = [_agreed(group, [_loop(group, buf, a, r) for a, r in zip(names, reps)])
                  for _ in range(ROUNDS)]
        times = {a: statistics.median(col) for a, col in zip(names, zip(*rounds))}
        for a, t in times.items():
            points.setdefault(a, {})[nbytes] = t
        # every loop is its calls and one untimed call before them
        spent += 2 * sum(first) + sum(t * (r + 1) * ROUNDS for t, r in zip(times.values(), reps))
        racing = still_racing(times, nbytes)
        if spent > budget:
            break
    return points


GROUP_HOOKS.append(autotune)
