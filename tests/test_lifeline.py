"""Lifelines (commlib/engines/lifeline.py) between real processes: a SIGKILLed holder is seen as
dead by the others, a holder that closes cleanly is not, a group without the dead process is not
affected, and the segment leaves nothing in /dev/shm.

The end-to-end case (a survivor of a SIGKILL inside an MPI all-reduce gets CommBackendError, never
a result with zeros in place of the dead rank's data) is tests/test_faults.py's mpi kill job.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from commlib.engines.lifeline import Lifelines, PeerDied

WORLD_RANKS = [10, 11, 12]  # slot i holds world rank 10 + i: the messages must name world ranks


def _child(index, pids, names, barrier, closed, results):
    def share(name):
        if index == 0:
            for _ in range(len(WORLD_RANKS) - 1):
                names.put(name)
            return name
        return names.get(timeout=30)

    def pid_of():
        pids[index] = os.getpid()
        barrier.wait(30)
        return list(pids)

    def sync():
        barrier.wait(30)

    try:
        lines = Lifelines.create(index, len(WORLD_RANKS), pid_of, WORLD_RANKS, share, sync)
        assert lines is not None, "no lifelines on this machine"
        everyone = lines.watch(WORLD_RANKS)
        without_last = lines.watch(WORLD_RANKS[:2])
        everyone.check()  # all alive
        barrier.wait(30)  # (A) every rank has checked
        if index == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        barrier.wait(30)  # (B) the parent saw rank 12 die (the barrier has 3 parties again)
        try:
            everyone.check()
            results.put((index, "everyone", "passed"))
        except PeerDied as exc:
            results.put((index, "everyone", str(exc)))
        without_last.check()  # raises if wrongly affected
        results.put((index, "without_last", "passed"))
        barrier.wait(30)  # (C)
        if index == 1:
            lines.close()  # a clean departure
            return
        assert closed.wait(30)  # rank 11 has closed and exited
        without_last.check()
        results.put((index, "after_clean_close", "passed"))
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which fails the test
        results.put((index, "error", repr(exc)))


def test_lifelines_see_a_killed_process_and_not_a_clean_exit():
    ctx = multiprocessing.get_context("fork")
    pids = ctx.Array("i", len(WORLD_RANKS))
    names, results, closed = ctx.Queue(), ctx.Queue(), ctx.Event()
    barrier = ctx.Barrier(len(WORLD_RANKS))  # three parties: the children, then two children + us
    before = set(os.listdir("/dev/shm"))
    procs = [ctx.Process(target=_child, args=(i, pids, names, barrier, closed, results))
             for i in range(len(WORLD_RANKS))]
    for p in procs:
        p.start()
    try:
        procs[2].join(60)
        assert procs[2].exitcode == -signal.SIGKILL, procs[2].exitcode
        barrier.wait(30)  # (B), in place of the dead child
        barrier.wait(30)  # (C)
        procs[1].join(30)
        closed.set()
        for p in procs[:2]:
            p.join(30)
            assert p.exitcode == 0, p.exitcode
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    got = {}
    while not results.empty():
        item = results.get()
        got[item[:2]] = item[2]
    assert not any(k[1] == "error" for k in got), got
    dead_pid = pids[2]
    for i in (0, 1):
        assert got[(i, "everyone")].startswith(f"rank 12 (pid {dead_pid}) on this host died"), got
        assert got[(i, "without_last")] == "passed", got
    assert got[(0, "after_clean_close")] == "passed", got
    left = [f for f in set(os.listdir("/dev/shm")) - before if "lifelines" in f]
    assert left == [], left


def test_no_lifelines_off_the_main_thread():
    """A mutex dies with the thread that holds it: lifelines made off the main thread would report
    a living process dead when that thread ends, so there are none."""
    import threading

    got = []
    t = threading.Thread(target=lambda: got.append(
        Lifelines.create(0, 1, lambda: [os.getpid()], [0], lambda name: name, lambda: None)))
    t.start()
    t.join()
    assert got == [None]


if not os.path.isdir("/dev/shm"):
    pytestmark = pytest.mark.skip(reason="no /dev/shm on this machine: lifelines need it")
