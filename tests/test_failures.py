"""Disagreeing, stalled and failing ranks (tests/mpi/failures.py): every rank gets an error
naming what went wrong, or the whole job ends quickly; nothing hangs."""

import re
import time

import pytest


def caught(proc) -> dict[tuple[str, str], list[int]]:
    """Rank 0's summary: (scenario, exception) -> ranks that caught it."""
    found = re.findall(r"^caught (\w+) (\w+) ranks \[([\d, ]*)\]$", proc.stdout, re.M)
    return {(s, k): [int(x) for x in ranks.split(",") if x.strip()] for s, k, ranks in found}


DEBUG_SCENARIOS = ["shape", "dtype", "op", "root", "reduce_root", "collective", "barrier_vs_gather",
                   "algorithm", "reduce_scatter_op"]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_debug_mode_raises_on_every_rank(mpirun, n):
    start = time.monotonic()
    proc = mpirun(n, "failures.py", "debug", timeout=90, COMMLIB_DEBUG=1)
    got, everyone, last = caught(proc), list(range(n)), n - 1
    want = {(s, "CommMismatchError"): everyone for s in DEBUG_SCENARIOS}
    # a rank whose own arguments fail raises its own error; the others name it
    want[("local_error", "CommArgumentError")] = [last]
    want[("local_error", "CommMismatchError")] = everyone[:-1]
    want[("local_error_gather", "CommArgumentError")] = [last]
    want[("local_error_gather", "CommMismatchError")] = everyone[:-1]
    assert got == want, proc.stdout + proc.stderr
    # each scenario is checked in the job to raise within 5 s; the whole job stays short
    assert time.monotonic() - start < 60


ALWAYS_SCENARIOS = ["count", "dtype", "op", "root", "collective", "async"]


@pytest.mark.parametrize("n", [2, 3])
def test_shm_mismatch_raises_on_every_rank_without_debug_mode(mpirun, n):
    """No COMMLIB_DEBUG: the shared-memory segment compares the calls the ranks publish with each
    step; every rank raises naming both calls, and the group stays usable (checked after each)."""
    start = time.monotonic()
    proc = mpirun(n, "failures.py", "always", timeout=60, COMMLIB_TIMEOUT_MODE="raise")
    want = {(s, "CommMismatchError"): list(range(n)) for s in ALWAYS_SCENARIOS}
    if n == 2:  # the ring's truncated receive on rank 0; rank 1 waits out the timeout
        want[("ring_truncated", "CommMismatchError")] = [0]
        want[("ring_truncated", "CommTimeoutError")] = [1]
    assert caught(proc) == want, proc.stdout + proc.stderr
    last, rest = n - 1, list(range(n - 1))
    assert (f"message: commlib.all_reduce: ranks of group 'world' disagree on operation #1: ranks "
            f"[{last}] differ from ranks {rest}.\n"
            + "".join(f"  rank {k}: all_reduce(count={5 if k == last else 4}, dtype=float32, op=SUM, "
                      f"algorithm=shm_oneshot)\n" for k in range(n))
            + "Fix: make every rank of the group call the same collective with the same shape, "
              "dtype, op and root.\n") in proc.stdout, proc.stdout
    assert time.monotonic() - start < 40


@pytest.mark.parametrize("n", [2, 3])
def test_timeout_raises_naming_op_group_and_sequence(mpirun, n):
    proc = mpirun(n, "failures.py", "timeout", timeout=120, COMMLIB_TIMEOUT="3",
                  COMMLIB_TIMEOUT_MODE="raise")
    not_first, not_last = list(range(1, n)), list(range(n - 1))
    assert caught(proc) == {
        ("blocking", "CommTimeoutError"): not_first,  # rank 0 skipped an all_reduce
        ("unusable", "CommStateError"): not_first,  # the group is unusable afterwards
        ("unusable_other_op", "CommStateError"): not_first,
        ("broadcast", "CommTimeoutError"): not_last,  # the root skipped a broadcast
        ("work_wait", "CommTimeoutError"): not_first,  # Work.wait(timeout=1)
        ("work_unusable", "CommStateError"): not_first,
    }, proc.stdout + proc.stderr


def test_timeout_in_abort_mode_ends_the_job(mpirun):
    start = time.monotonic()
    proc = mpirun(3, "failures.py", "abort", timeout=60, check=False, COMMLIB_TIMEOUT="2")
    took = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert took < 40, f"the watchdog took {took:.0f} s to end the job"
    # Work.wait(timeout=) is catchable in this mode too, on every rank that waited
    assert sorted(re.findall(r"rank (\d) caught work_wait CommTimeoutError", proc.stdout)) == ["1", "2"]
    assert proc.stdout.count("before the skipped all_reduce") == 3
    # operation #1 of the world was the barrier; the skipped all_reduce is #2
    assert re.search(r"commlib\.CommTimeoutError: commlib\.all_reduce: operation #2 on group "
                     r"'world' \(size 3\) did not complete within 2 s on rank [12]; ending the job",
                     proc.stderr), proc.stderr
    assert "the job was not ended" not in proc.stderr


@pytest.mark.parametrize("scenario", ["uncaught", "uncaught_torch"])
def test_uncaught_exception_on_one_rank_ends_the_job(mpirun, scenario):
    """With torch.distributed on commlib too: its excepthook, installed by init_process_group
    around commlib's, captures stderr to print it after commlib's returns, which never does."""
    start = time.monotonic()
    proc = mpirun(4, "failures.py", scenario, timeout=60, check=False)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert "RuntimeError: boom on rank 3" in proc.stderr, proc.stderr
    assert took < 40, f"the other ranks were left waiting ({took:.0f} s)"
    assert "the job was not ended" not in proc.stderr


def test_failure_while_building_the_world_group_ends_the_job(mpirun):
    proc = mpirun(3, "init_failure.py", timeout=90, check=False)
    assert proc.returncode != 0
    assert "injected failure while building the world group" in proc.stderr
    assert "unreachable" not in proc.stdout
