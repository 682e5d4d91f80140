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
    """Waits out the host's slow phases before a measurement: every rank times a canary (MPI's
    ``Allreduce`` of 1 MiB: the fastest of 3 loops of 10, the slowest rank's time) and, while it
    is more than ``slack`` times the fastest canary seen, all ranks wait and retry, up to
    ``patience`` seconds per point (then they measure anyway, and the summary counts it).
    ``patience`` 0: no canary, no wait.

    One loop of 10 spreads 1.5x inside a quiet phase here (135-207 us, 2 ranks, 300 loops over
    30 s); the fastest of 3 spreads less, so the slack can be tight enough (1.35) to also catch
    the milder slow phases (1.3-1.6x) that shifted whole calibrations."""

    def __init__(self, comm, slack: float = 1.35, patience: float = 60.0):
        self.comm, self.slack, self.patience = comm, slack, patience
        self.buf = torch.ones(1 << 18)
        self.best = float("inf")
        self.waited = 0.0
        self.gave_up = 0

    def canary(self) -> float:
        view = self.buf.numpy()
        self.comm.Allreduce(MPI.IN_PLACE, view)
        return min(time_loop(lambda: self.comm.Allreduce(MPI.IN_PLACE, view), 10, self.comm)
                   for _ in range(3))

    def wait(self) -> None:
        if self.comm.Get_size() < 2 or self.patience <= 0:
            return
        t0 = time.perf_counter()
        while True:
            c = self.canary()
            self.best = min(self.best, c)
            if c <= self.slack * self.best:
                break
            if time.perf_counter() - t0 > self.patience:
                self.gave_up += 1
                break
            time.sleep(0.5)
        self.waited += time.perf_counter() - t0


_QUIET: dict[int, Quiet] = {}


def quiet_for(comm, patience: float = 60.0) -> Quiet:
    """The gate of ``comm`` (one per communicator and process: it remembers the best canary)."""
    return _QUIET.setdefault(id(comm), Quiet(comm, patience=patience))


def quiet_summary(comm) -> str:
    q = _QUIET.get(id(comm))
    if q is None or q.best == float("inf"):
        return "# slow phases: not checked (one rank, or --patience 0)"
    return (f"# slow phases: waited {q.waited:.1f} s in all; canary (1 MiB MPI Allreduce) best "
            f"{q.best * 1e6:.0f} us; measured anyway after {q.patience:.0f} s: {q.gave_up} point(s)")
