"""Measuring outside the host's slow phases (bench/calibrate.py, bench/model_accuracy.py and the
--compare tables of bench/_harness.py).

The virtual machines this project runs on have their CPUs moved by the host: for seconds at a
time, traffic between cores runs 4-8x slower (a 1 MiB all-reduce at 2 ranks: ~85 us for the
shared-memory two-shot and ~190 us for MPI, then ~650 and ~720 us for 10 s or more), while a
local copy keeps its speed. A number measured in such a phase prices the host, not the code.
"""

from __future__ import annotations

import time

import torch
from mpi4py import MPI


def time_loop(fn, iters: int, comm) -> float:
    """The slowest rank's mean seconds per call of ``fn`` over ``iters`` calls (a collective ends
    with its slowest rank)."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    mine = (time.perf_counter() - t0) / iters
    return comm.allreduce(mine, op=MPI.MAX)


class Quiet:
    """Waits out the host's slow phases before a measurement: every rank times two canaries (MPI's
    ``Allreduce`` of 1 MiB and of 8 B: the fastest of 3 loops, the slowest rank's time) and,
    while either is more than ``slack`` times the fastest of its kind seen, all ranks wait and
    retry, up to ``patience`` seconds per point (then they measure anyway, and the summary
    counts it). ``patience`` 0: no canary, no wait.

    One loop of 10 spreads 1.5x inside a quiet phase here (135-207 us, 2 ranks, 300 loops over
    30 s); the fastest of 3 spreads less, so the slack can be tight enough (1.35) to also catch
    the milder slow phases (1.3-1.6x) that shifted whole calibrations. The 8-byte canary catches
    the phases that slow latency more than bandwidth (a whole row of 8-128 B points measured
    35-45% slower than its calibration while the 1 MiB canary passed)."""

    def __init__(self, comm, slack: float = 1.35, patience: float = 60.0):
        self.comm, self.slack, self.patience = comm, slack, patience
        self.buf = torch.ones(1 << 18)
        self.small = torch.ones(2)
        self.best = float("inf")
        self.best_small = float("inf")
        self.waited = 0.0
        self.gave_up = 0

    def canary(self, buf=None, iters: int = 10) -> float:
        view = (self.buf if buf is None else buf).numpy()
        self.comm.Allreduce(MPI.IN_PLACE, view)
        return min(time_loop(lambda: self.comm.Allreduce(MPI.IN_PLACE, view), iters, self.comm)
                   for _ in range(3))

    def wait(self) -> None:
        if self.comm.Get_size() < 2 or self.patience <= 0:
            return

        def quiet() -> bool:
            c, s = self.canary(), self.canary(self.small, 50)
            self.best, self.best_small = min(self.best, c), min(self.best_small, s)
            return c <= self.slack * self.best and s <= self.slack * self.best_small

        waited, gave_up = wait_until(quiet, self.patience)
        self.waited += waited
        self.gave_up += gave_up


def wait_until(ok, patience: float) -> tuple[float, bool]:
    """Call ``ok()`` every half second until it returns True or ``patience`` seconds have passed
    (then measure anyway); returns the seconds waited and whether it gave up. ``ok`` is collective
    where the gate is (every rank gets the same answer from the slowest rank's canary)."""
    t0 = time.perf_counter()
    while not ok():
        if time.perf_counter() - t0 > patience:
            return time.perf_counter() - t0, True
        time.sleep(0.5)
    return time.perf_counter() - t0, False


_QUIET: dict[int, Quiet] = {}
_PATIENCE = [60.0]


def set_patience(seconds: float) -> None:
    """The patience of every gate created from now on (a run's --patience; 0: no gate)."""
    _PATIENCE[0] = seconds


def quiet_for(comm, patience: float | None = None) -> Quiet:
    """The gate of ``comm`` (one per communicator and process: it remembers the best canaries),
    created with ``patience`` or else the run's (:func:`set_patience`)."""
    q = _QUIET.get(id(comm))
    if q is None:
        q = _QUIET[id(comm)] = Quiet(comm, patience=_PATIENCE[0] if patience is None else patience)
    return q


def quiet_summary(comm) -> str:
    q = _QUIET.get(id(comm))
    if q is None or q.best == float("inf"):
        return "# slow phases: not checked (one rank, or --patience 0)"
    return (f"# slow phases: waited {q.waited:.1f} s in all; canaries (MPI Allreduce) best "
            f"{q.best * 1e6:.0f} us at 1 MiB, {q.best_small * 1e6:.2f} us at 8 B; measured anyway "
            f"after {q.patience:.0f} s: {q.gave_up} point(s)")
