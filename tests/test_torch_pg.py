"""commlib as a torch.distributed backend: ``init_process_group("commlib")``, then torch's own
collectives, DDP, FSDP2 and DTensor, on real processes (torchrun-style env:// and mpiexec).

The cases are in tests/torch_dist/pg_cases.py; their references are computed there from the seeds,
by gloo in the same job, or by one process (see each case).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

import commlib.torch_backend as tb
from commlib.errors import CommConfigError

from conftest import ROOT, mpiexec_path, run_mpi, torchrun_env
from test_torch_backend import run_torch

PG_CASES = ROOT / "tests" / "torch_dist" / "pg_cases.py"
CASES = ["case_backend_is_commlib", "case_collectives", "case_async_and_futures",
         "case_point_to_point", "case_groups_and_device_mesh", "case_ddp_matches_gloo",
         "case_ddp_bucket_mb", "case_fsdp2_matches_dense", "case_dtensor_redistribute"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_clients_on_commlib_backend(n):
    """torchrun-style launch: every case at world sizes 1-4."""
    out = run_torch(n, CASES, script=PG_CASES)
    for case in CASES:
        assert f"ok {case} (world size {n})" in out, out


@pytest.mark.parametrize("progress", ["thread", "wait"])
def test_torch_clients_on_each_path(progress):
    """Both ways the process group runs a collective, at 2 ranks: ``thread`` issues every one
    asynchronously (the futures completed by the progress thread, as across hosts), ``wait``
    runs them blocking in the call (as on one host with no free core, the default here)."""
    cases = ["case_collectives", "case_async_and_futures", "case_ddp_matches_gloo",
             "case_ddp_bucket_mb"]
    out = run_torch(2, cases, script=PG_CASES, COMMLIB_PROGRESS=progress)
    for case in cases:
        assert f"ok {case} (world size 2)" in out, out


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (pip install mpich)")
def test_torch_clients_on_commlib_backend_under_mpiexec():
    """mpiexec launch: commlib's world is MPI's; torch's rendezvous variables come from it."""
    out = run_mpi(3, str(PG_CASES), *CASES).stdout
    for case in CASES:
        assert f"ok {case} (world size 3)" in out, out


def _launch(n: int, case: str, timeout: float, until=None, **env):
    """Start ``case`` on ``n`` torchrun-style ranks; return each rank's (exit code, seconds from
    start to exit, stderr), killing what is still alive after ``timeout``, or once the ranks
    ``until`` (default: all) have ended."""
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(PG_CASES), case], cwd=ROOT, env=e, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for e in torchrun_env(n, **env)]
    ended = [None] * n
    awaited = range(n) if until is None else until
    while any(ended[i] is None for i in awaited) and time.monotonic() - start < timeout:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic() - start
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [(p.wait(), ended[i], p.communicate()[1]) for i, p in enumerate(procs)]


# commlib's typed error as a rank ends with it: "commlib: CommTimeoutError: ..." when a torch
# future's operation failed (issued asynchronously, completed by the progress thread),
# "commlib.errors.CommBackendError: ..." (the exception) or "commlib.CommTimeoutError: ..." (the
# watchdog) when the process group ran the collective blocking (one host, no free core)
TYPED = r"commlib(\.errors)?[.:] ?Comm(Backend|Timeout)Error: commlib\.all_reduce"


@pytest.mark.parametrize("progress", ["auto", "thread"])
def test_rank_failing_in_backward_ends_every_rank(progress):
    """A rank raising inside DDP's backward: every other rank ends with commlib's typed error
    (its blocking all-reduce raises, or under ``thread`` the future of its all-reduce fails),
    not a hang and not a crash."""
    results = _launch(2, "case_rank_raises_in_backward", 60, COMMLIB_TIMEOUT="10",
                      COMMLIB_PROGRESS=progress)
    code, seconds, err = results[0]
    assert seconds is not None, "rank 0 did not end"
    assert code == 1, (code, err[-2000:])
    assert re.search(TYPED, err), err[-2000:]
    assert "injected failure in backward" in results[1][2]


def test_uneven_inputs_end_with_a_timeout():
    """DDP without join(), rank 0 one step more: its unmatched all-reduce fails with
    CommTimeoutError within the timeout (10 s) plus 5 s, while rank 1 is still alive (it sleeps
    60 s: ended by the test once rank 0 has)."""
    results = _launch(2, "case_uneven_inputs", 45, until=[0], COMMLIB_TIMEOUT="10")
    code, seconds, err = results[0]
    assert seconds is not None and code == 1, (code, seconds, err[-2000:])
    assert re.search(TYPED.replace("Backend|", ""), err), err[-2000:]
    assert seconds < 10 + 5 + 10, seconds  # + start-up and the three matched steps
    assert results[1][1] is None or results[1][1] > seconds  # rank 1 outlived it


def test_rendezvous_address_where_the_host_name_does_not_resolve(self_world, monkeypatch):
    """``mpi_environment`` on a host whose name no resolver knows (a network namespace, the
    multi-host cluster's hosts): rank 0's first non-loopback interface address, and where it has
    none, a ``CommConfigError`` naming MASTER_ADDR (raised on every rank) instead of
    ``socket.gaierror``."""
    def unresolvable(name):
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE"):
        # setenv first: monkeypatch then restores the caller's state, absent or not, whatever
        # mpi_environment sets (delenv of an absent variable would record nothing)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    monkeypatch.setattr(tb, "interface_addresses", lambda: ["10.1.2.3", "127.0.0.1"])
    assert tb.mpi_environment()["MASTER_ADDR"] == "10.1.2.3"
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setattr(tb, "interface_addresses", lambda: ["127.0.0.1"])
    with pytest.raises(CommConfigError, match="set MASTER_ADDR"):
        tb.mpi_environment()
