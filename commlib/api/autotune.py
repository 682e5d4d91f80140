"""In-job calibration: a new group whose shape the tuning file does not know times its own
all-reduce algorithms and keeps the result (what is measured and how it becomes the model:
:mod:`commlib.tuning.probe`; switched by ``COMMLIB_AUTOTUNE``), and checks it later in the job
(``COMMLIB_AUTOTUNE_RECHECK``). A group of one rank per host whose link between hosts nothing
measured times that link with a short ping-pong (:func:`_probe_net`) instead of pricing it as a
100 Gb/s NIC's: what its algorithm choices and ``ddp_bucket_mb``'s bucket sizes are made from.

Collective over the group, right after the group is built (``commlib.init``, ``new_group``,
``Mesh``) and at the checks (:class:`_Recheck`, from the group's all-reduce calls), on every
member: the decisions to probe, the budget and the check times are rank 0's, agreed with the
model, and every later decision (repetitions, which algorithms stay, when to stop) is made from
times all-reduced to their maximum, so every rank takes the same path. Rank 0 saves the entry in
the tuning file (a failure to write is logged, not raised: the job keeps its measured model).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import statistics
import time

import torch

from ..algorithms.registry import Call
from ..ops import ReduceOp
from ..tuning.calibration import make_entry, put_entry, table_for, tuning_path
from ..runtime.plans import forget
from ..tuning.probe import (CHECK_UNITS, DROP_FROM, LOOP_SECONDS, NET_REPS, NET_SIZES, ROUNDS,
                            RUNS, SIZES, check_plan, cut_short, describe, describe_net, merge,
                            net_link, repetitions, ring_link, stale, still_racing, units)
from ..tuning.selector import GroupModel, eligible, remember_net
from .collectives import all_reduce, broadcast
from .groups import GROUP_HOOKS
from .p2p import recv, send

__all__ = ["autotune"]

log = logging.getLogger("commlib")


def autotune(group) -> None:
    """Probe ``group`` if its agreed model asks for it (``model.probe`` seconds > 0), then
    replace the model with the measured one and, while fewer than RUNS probes are merged, leave
    the job's checks of it on the group's all-reduce calls (:class:`_Recheck`). Collective over
    the group's members."""
    model = group.model if group.backend is not None else None
    if model is None or model.table is None or group.size < 2:
        return
    if model.probe_net:
        _probe_net(group)
    if not model.probe:
        return
    points = _probe(group, model.probe, _points(model) if model.probed else {})
    if model.recheck and group.model.probed < RUNS:
        group.on_all_reduce = _Recheck(model.probe, model.recheck, points)


def _probe(group, budget: float, previous: dict[str, dict[int, float]]
           ) -> dict[str, dict[int, float]]:
    """Time the group's all-reduce algorithms for about ``budget`` seconds, merge the times into
    ``previous`` (earlier probes' points, agreed), make the result the group's model (the
    choices and plans made from the old one dropped), save it (rank 0) and return its points."""
    model = group.model
    start = time.perf_counter()
    points = merge(previous, _measure(group, budget))  # the minimum of all the probes
    seconds = time.perf_counter() - start
    runs = model.probed + 1
    base = model.table.link
    link = ring_link(points.get("ring", {}), group.size, base) or base
    cores = os.cpu_count() or 1
    how = describe(group.size, cores, points, seconds,
                   link if "ring" in points else None, runs)
    probe = {"how": how, "seconds": round(seconds, 3), "cores": cores, "runs": runs}
    entry = make_entry({"shm": link}, {"all_reduce": points}, probe)
    backend, key = group.backend.name, model.key
    table = table_for({"groups": {key: entry}}, backend, group.size)
    _use(group, GroupModel(table, f"{how} (entry {key})", model.gpu, 0.0, key, runs), how)
    if group.rank == 0:
        try:
            put_entry(tuning_path(), key, entry)
        except OSError as exc:
            log.warning("commlib: could not save the probed entry %s in %s (%s); this job uses "
                        "it, the next one probes again", key, tuning_path(), exc)
    return points


NAP_S = 1e-3  # the pause between polls of the ranks waiting for the link's ping-pong


def _probe_net(group) -> None:
    """Time a ping-pong between the first ranks of the group's first two hosts (NET_SIZES, the
    fastest of NET_REPS round trips at each) and price the link between hosts from it, on every
    rank: the first host's rank measures and broadcasts ``(α, β)``; where the fit fails (the time
    did not grow with the size) the defaults stay. Not saved: a calibration
    (``bench/calibrate.py``) measures the links with the curves, and a job that has one skips
    this; the job's later groups across hosts on the same engine take the link measured here
    (:func:`~commlib.tuning.selector.remember_net`) instead of probing again."""
    hosts = group.resources.layout.hosts
    me, peer = hosts[0][0], hosts[1][0]
    fit = torch.zeros(2, dtype=torch.float64)
    if group.rank in (me, peer):
        one_way = {}
        for nbytes, reps in zip(NET_SIZES, NET_REPS):
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            best = float("inf")
            for k in range(reps + 1):  # the first round trip untimed: connections, buffers
                start = time.perf_counter()
                if group.rank == me:
                    send(buf, group=group, group_dst=peer)
                    recv(buf, group=group, group_src=peer)
                else:
                    recv(buf, group=group, group_src=me)
                    send(buf, group=group, group_dst=me)
                if k:
                    best = min(best, time.perf_counter() - start)
            one_way[nbytes] = best / 2
        link = net_link(one_way, group.model.table.inter) if group.rank == me else None
        if link is not None:
            fit[0], fit[1] = link.alpha, link.beta
    # The other ranks wait asleep: spinning, they take the cores from the two timing it (tried at
    # 2 hosts x 2 ranks on 2 cores, the 4 KiB one-way time read 0.7 ms, 0.11 ms with them asleep)
    work = broadcast(fit, group=group, group_src=me, async_op=True)
    while not work.is_completed():
        time.sleep(NAP_S)
    alpha, beta = fit.tolist()
    if beta <= 0:
        log.info("group %s: the link between hosts did not time as a link; keeping the defaults",
                 group.name)
        return
    model, table = group.model, copy.copy(group.model.table)
    table.inter = dataclasses.replace(table.inter, alpha=alpha, beta=beta, curve=None)
    table.shard_inter = table.inter  # one rank per host: no other rank's shard shares it
    remember_net(group.backend.name, table.inter)
    source = f"{model.source}; {describe_net(table.inter)}"
    _use(group, dataclasses.replace(model, table=table, source=source, probe_net=False), source)


def _use(group, model: GroupModel, what: str) -> None:
    """Make ``model`` the group's, dropping the choices and plans made from the old one."""
    group.resources.model = model
    group.resources.choices.clear()
    forget(group)
    log.info("group %s: %s", group.name, what)


def _points(model) -> dict[str, dict[int, float]]:
    """The model's all-reduce curves as probe points: {algorithm: {nbytes: seconds}} (those of
    two sizes or more: the table keeps no other)."""
    curves = model.table.curves.get("all_reduce", {})
    return {a: dict(zip(c.sizes, c.times)) for a, c in curves.items()}


class _Recheck:
    """The job's checks of its probe, run by the group's all-reduce calls
    (``group.on_all_reduce``; why: :mod:`commlib.tuning.probe`). Every :data:`CHECK_UNITS` units
    of calls the ranks agree on the seconds since the probe (the slowest clock's); at each of
    ``times`` they re-time, size by size, the algorithms the choice is between (all that were
    timed, where the probes were cut short), and where one runs STALE_FACTOR times faster than
    the probes' ``points`` say, probe again with ``budget``. Ends after the last time or once
    RUNS probes are merged. Every rank takes the same path: the counts are of the same calls,
    the clock and the times are agreed."""

    def __init__(self, budget: float, times, points: dict[str, dict[int, float]]):
        self.budget, self.times, self.points = budget, list(times), points
        self.start = time.perf_counter()
        self.units = CHECK_UNITS

    def __call__(self, group, nbytes: int) -> None:
        self.units -= units(nbytes)
        if self.units > 0:
            return
        self.units = CHECK_UNITS
        group.on_all_reduce = None  # the check's own calls do not count
        if self._check(group):
            group.on_all_reduce = self

    def _check(self, group) -> bool:
        """One agreement of the clock and, when a time has come, the check; whether there is
        more to check."""
        (elapsed,) = _agreed(group, [time.perf_counter() - self.start])
        if elapsed < self.times[0]:
            return True
        self.times.pop(0)
        points = self.points  # as measured: a probe cut short after one size has no curves
        why = ""
        for nbytes, names in check_plan(points, every=cut_short(points)):
            buf = torch.zeros(max(1, nbytes // 4))
            reps = [repetitions(points[a][nbytes], LOOP_SECONDS / 2) for a in names]
            # short loops (latency-bound sizes, cheap) as the probe's: the median of its rounds,
            # not one lucky loop against a median (8 B at 4 ranks: 1.35x "faster" by chance)
            now = _rounds(group, buf, names, reps, ROUNDS if nbytes < DROP_FROM else 1)
            faster = stale(points, now, nbytes)
            if faster:
                why = f"{', '.join(faster)} now faster at {nbytes} bytes"
                break
        log.info("group %s: probe checked %.0f s after it: %s", group.name, elapsed,
                 f"{why}, probing again" if why else "as probed")
        if why:
            self.points = _probe(group, self.budget, points)
        return bool(self.times) and group.model.probed < RUNS


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


def _rounds(group, buf, names: list[str], reps: list[int], rounds: int) -> dict[str, float]:
    """{algorithm: seconds per call}: the median over ``rounds`` interleaved rounds of loops of
    ``reps`` calls, each the slowest rank's."""
    times = [_agreed(group, [_loop(group, buf, a, r) for a, r in zip(names, reps)])
             for _ in range(rounds)]
    return {a: statistics.median(col) for a, col in zip(names, zip(*times))}


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
        times = _rounds(group, buf, names, reps, ROUNDS)
        for a, t in times.items():
            points.setdefault(a, {})[nbytes] = t
        # every loop is its calls and one untimed call before them
        spent += 2 * sum(first) + sum(t * (r + 1) * ROUNDS for t, r in zip(times.values(), reps))
        racing = still_racing(times, nbytes)
        if spent > budget:
            break
    return points


GROUP_HOOKS.append(autotune)
