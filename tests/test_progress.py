"""Asynchronous operations advance while the caller computes (commlib/runtime/progress.py: the
progress thread), on real ranks: tests/mpi/progress_cases.py under mpiexec (mpi engine, with the
shared-memory segment and without it) and with torchrun's variables (torch engine on gloo). A
rank that dies while another's asynchronous operation is in flight is in
tests/test_shm.py::test_killed_rank_gives_the_others_an_error (``async``)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from conftest import MPI_DIR, run_cmd, run_mpi_hosts
from test_torch_backend import run_torch

import commlib
from commlib.runtime.progress import _Progress, choose_lane, set_progress

CASES = ["case_progress_while_computing", "case_no_progress_without_the_thread",
         "case_auto_thread_only_where_a_core_is_free", "case_async_beside_blocking"]


@pytest.mark.parametrize("mode,spans_hosts,ranks_on_host,cores,lane", [
    ("auto", True, 8, 2, "remote"),  # across hosts the network moves the data: always a thread
    ("auto", True, 1, 64, "remote"),
    ("auto", False, 2, 2, None),  # one host, no free core: progress in wait()
    ("auto", False, 4, 2, None),
    ("auto", False, 2, 3, "local"),  # a free core
    ("auto", False, 1, 2, "local"),
    ("thread", False, 4, 2, "local"),  # forced
    ("thread", True, 4, 2, "remote"),
    ("wait", True, 1, 64, None),
    ("wait", False, 1, 64, None),
])
def test_choose_lane(mode, spans_hosts, ranks_on_host, cores, lane):
    """Which progress thread serves a group, from its facts (a pure function)."""
    assert choose_lane(mode, spans_hosts, ranks_on_host, cores) == lane


def test_pauses_per_lane(monkeypatch):
    """Both threads back off to 1 ms between passes; the one across hosts first keeps to 100 us
    (MPI over TCP answers a handshake only inside a call). Each pace has its option, and the
    first pause never exceeds the fast one, nor the fast one the longest."""
    from commlib.runtime.progress import _PROGRESS
    local, remote = _PROGRESS.threads["local"], _PROGRESS.threads["remote"]
    for name in ("COMMLIB_PROGRESS_MIN_US", "COMMLIB_PROGRESS_MAX_US",
                 "COMMLIB_PROGRESS_REMOTE_FAST_US"):
        monkeypatch.delenv(name, raising=False)
    assert local.pauses() == pytest.approx((50e-6, 1e-3, 1e-3))
    assert remote.pauses() == pytest.approx((50e-6, 100e-6, 1e-3))
    monkeypatch.setenv("COMMLIB_PROGRESS_MIN_US", "400")
    monkeypatch.setenv("COMMLIB_PROGRESS_REMOTE_FAST_US", "250")
    assert local.pauses() == pytest.approx((400e-6, 1e-3, 1e-3))
    assert remote.pauses() == pytest.approx((250e-6, 250e-6, 1e-3))
    monkeypatch.setenv("COMMLIB_PROGRESS_MAX_US", "200")
    assert remote.pauses() == pytest.approx((200e-6, 200e-6, 200e-6))
    monkeypatch.setenv("COMMLIB_PROGRESS_REMOTE_FAST_US", "0")
    with pytest.raises(commlib.CommConfigError, match="COMMLIB_PROGRESS_REMOTE_FAST_US"):
        remote.pauses()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH: not Linux")
@pytest.mark.parametrize("batch", ["1", "0"])
def test_the_thread_across_hosts_is_a_batch_task(monkeypatch, batch):
    """The remote lane's thread runs as SCHED_BATCH (its wake-ups do not preempt the compute),
    unless ``COMMLIB_PROGRESS_REMOTE_BATCH=0``; the one-host lane's never."""
    monkeypatch.setenv("COMMLIB_PROGRESS_REMOTE_BATCH", batch)
    want = os.SCHED_BATCH if batch == "1" else os.SCHED_OTHER
    for thread, policy in ((_Progress("remote", 0, "progress_remote_fast_us",
                                      "progress_remote_batch"), want),
                           (_Progress("local", 19), os.SCHED_OTHER)):
        thread.kick()
        try:
            deadline = time.monotonic() + 10
            while thread.timer_slack_ns is None and time.monotonic() < deadline:
                time.sleep(0.01)  # set after the policy: the thread's setup is done
            assert thread.timer_slack_ns is not None
            assert os.sched_getscheduler(thread._thread.native_id) == policy, thread.lane
            assert thread.batch == (policy == os.SCHED_BATCH)
        finally:
            thread.stop()


def test_next_pause_is_fast_after_a_move_or_while_the_caller_waits():
    """Doubling from the last pause, capped at the fast pace within 10 ms of an operation's
    issue or advance, or while the other threads used under a tenth of a core (the caller waits
    on the result); else at the longest."""
    from commlib.runtime.progress import next_pause
    fast, hi = 100e-6, 1e-3
    assert next_pause(50e-6, fast, hi, 0.001, 1.0) == pytest.approx(100e-6)
    assert next_pause(100e-6, fast, hi, 0.001, 1.0) == pytest.approx(100e-6)   # in the window
    assert next_pause(100e-6, fast, hi, 0.020, 1.0) == pytest.approx(200e-6)   # computing
    assert next_pause(800e-6, fast, hi, 0.020, 0.9) == pytest.approx(1e-3)
    assert next_pause(800e-6, fast, hi, 0.020, 0.3) == pytest.approx(1e-3)     # descheduled
    assert next_pause(800e-6, fast, hi, 0.020, 0.05) == pytest.approx(100e-6)  # caller waits
    assert next_pause(25e-6, fast, hi, 0.020, 0.0) == pytest.approx(50e-6)


_SHARES = """
import json, threading, time
from commlib.runtime.progress import _OthersBusy
shares = {}
def probe(key, ready, done):
    o = _OthersBusy()
    ready.set()
    done.wait()
    shares[key] = o.share()
for key in ("compute", "sleep"):
    ready, done = threading.Event(), threading.Event()
    t = threading.Thread(target=probe, args=(key, ready, done))
    t.start()
    ready.wait()
    end = time.perf_counter() + 0.1
    while time.perf_counter() < end:
        if key == "compute":
            sum(range(1000))
        else:
            time.sleep(0.005)
    done.set()
    t.join()
print(json.dumps(shares))
"""


def test_others_busy_tells_a_computing_caller_from_a_waiting_one():
    """The share of a core the other threads used, measured from a second thread as the progress
    thread does: most of a core while the main thread computes, near none while it sleeps (in a
    fresh process: no thread of an earlier test counts)."""
    proc = run_cmd([sys.executable, "-c", _SHARES], timeout=60)
    shares = json.loads(proc.stdout.strip().splitlines()[-1])
    assert shares["compute"] > 0.3, shares  # well above IDLE_SHARE, even on a busy host
    assert shares["sleep"] < 0.1, shares


_SLACK = """
import ctypes, json, time
from commlib.runtime.progress import TIMER_SLACK_NS, _Progress
libc = ctypes.CDLL(None)
libc.prctl(29, ctypes.c_ulong(77777), 0, 0, 0)  # the caller's own, which a new thread inherits
before = libc.prctl(30, 0, 0, 0, 0)
p = _Progress("test", 0)
p.kick()  # nothing pending: the thread starts, sets its slack and waits
end = time.monotonic() + 10
while p.timer_slack_ns is None and time.monotonic() < end:
    time.sleep(0.01)
thread = p.timer_slack_ns
p.stop()
print(json.dumps({"thread": thread, "main_before": before, "main_after": libc.prctl(30, 0, 0, 0, 0),
                  "asked": TIMER_SLACK_NS}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is Linux's prctl")
def test_progress_threads_sleep_their_pace_not_the_kernels_slack():
    """A progress thread sets its own timer slack to TIMER_SLACK_NS (1 µs, where Linux's 50 µs
    default made a 100 µs pace 156 µs), read back from the kernel in the thread; the caller's
    thread keeps its own (in a fresh process)."""
    proc = run_cmd([sys.executable, "-c", _SLACK], timeout=60)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["thread"] == got["asked"] == 1000, got
    assert got["main_after"] == got["main_before"] == 77777, got


def test_a_wait_across_hosts_naps_instead_of_taking_the_core():
    """Two virtual hosts, one rank each (tests/mpi/wait_cases.py): a rank waiting a second for a
    late peer in a blocking or an asynchronous all-reduce uses under a fifth of its core's time,
    and over 0.4 with the nap turned off (the negative control); both sums exact."""
    proc = run_mpi_hosts(["a", "b"], "wait_cases.py", timeout=120)
    for case in ("case_a_wait_across_hosts_naps", "case_b_endless_spin_takes_the_core"):
        assert f"ok {case} (world size 2)" in proc.stdout, proc.stdout


def test_set_progress_rejects_unknown_modes():
    with pytest.raises(ValueError, match="'spin'.*auto"):
        set_progress("spin")


@pytest.mark.parametrize("n,shm", [(1, "1"), (2, "1"), (4, "1"), (2, "0")])
def test_progress_on_mpi(mpirun, n, shm):
    proc = mpirun(n, "progress_cases.py", timeout=240, COMMLIB_SHM=shm)
    for case in CASES:
        assert f"ok {case} (world size {n})" in proc.stdout, proc.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_progress_on_gloo(n):
    out = run_torch(n, CASES, script=MPI_DIR / "progress_cases.py")
    for case in CASES:
        assert f"ok {case} (world size {n})" in out, out


def test_engine_failure_names_a_lost_peer_only_when_the_engine_says_so():
    """An engine's RuntimeError becomes CommBackendError naming the op; the message blames a
    peer that exited only when the engine's text says a connection or process was lost (gloo's
    "Connection closed by peer", MPI's failed process), not for any other engine error."""
    from types import SimpleNamespace

    from commlib.errors import CommBackendError
    from commlib.runtime.progress import engine_failure

    def failure(text):
        group = SimpleNamespace(backend=SimpleNamespace(name="torch"), name="world", size=2,
                                rank=1, broken=None)
        err = engine_failure(RuntimeError(text), group, "all_reduce", 7)
        assert isinstance(err, CommBackendError) and group.broken
        assert "operation #7" in str(err) and text in str(err)
        return str(err)

    for lost in ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:5",
                 "Connection reset by peer", "MPI_ERR_PROC_FAILED: Process Failure",
                 "Other MPI error, error stack: MPIR_Wait(105): Communication error with rank 0",
                 "PeerDied: rank 0 (pid 25925) on this host died during the operation"):
        assert "A peer process exited or was killed" in failure(lost), lost
    for other in ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms",
                  "Message truncated"):
        assert "peer process" not in failure(other), other
