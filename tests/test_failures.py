"""Disagreeing and failing ranks: every rank gets an error or the job ends; nothing hangs."""

import re
import time

import pytest


def caught(proc, n):
    # Ranks' lines can interleave in mpiexec's merged stdout: match the tokens, not the lines.
    return sorted(int(rank) for rank in re.findall(r"caught \w+ rank (\d+)", proc.stdout))


@pytest.mark.parametrize("scenario", ["debug_shape", "debug_collective", "debug_local_error"])
@pytest.mark.parametrize("n", [2, 3])
def test_debug_mode_raises_on_every_rank(mpirun, scenario, n):
    start = time.monotonic()
    proc = mpirun(n, "failures.py", scenario, timeout=60, COMMLIB_DEBUG=1)
    assert caught(proc, n) == list(range(n)), proc.stdout + proc.stderr
    assert time.monotonic() - start < 30


def test_debug_mode_dtype_op_root(mpirun):
    proc = mpirun(4, "failures.py", "debug_dtype_op_root", timeout=90, COMMLIB_DEBUG=1)
    assert caught(proc, 4) == sorted(list(range(4)) * 3), proc.stdout + proc.stderr


@pytest.mark.parametrize("scenario", ["timeout_raise", "work_wait_timeout"])
def test_timeout_raises_naming_op_group_and_sequence(mpirun, scenario):
    proc = mpirun(3, "failures.py", scenario, timeout=60, COMMLIB_TIMEOUT="2",
                  COMMLIB_TIMEOUT_MODE="raise")
    want = [0, 1, 1, 2, 2] if scenario == "timeout_raise" else [0, 1, 2]
    assert caught(proc, 3) == want, proc.stdout + proc.stderr


def test_timeout_abort_ends_the_job_naming_op_group_and_sequence(mpirun):
    start = time.monotonic()
    proc = mpirun(3, "failures.py", "timeout_abort", timeout=60, check=False,
                  COMMLIB_TIMEOUT="2")
    assert proc.returncode != 0
    assert time.monotonic() - start < 30, "the watchdog did not end the job"
    assert "commlib.CommTimeoutError: commlib.all_reduce: operation #1 on group 'world'" \
        in proc.stderr, proc.stderr


def test_uncaught_exception_on_one_rank_ends_the_job(mpirun):
    start = time.monotonic()
    proc = mpirun(3, "failures.py", "uncaught", timeout=60, check=False)
    assert proc.returncode != 0
    assert "boom on rank 2" in proc.stderr
    assert time.monotonic() - start < 30, "the other ranks were left waiting"
