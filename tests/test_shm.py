"""Shared-memory collectives (commlib/backends/shm.py, csrc/shm.c) on real ranks: every
collective x op x dtype at 1 to 4 ranks with messages larger than the segment's regions, async
and polled operation, two groups at once, and a rank killed mid-collective (the others raise,
nothing hangs, nothing is left in /dev/shm)."""

import os
import re
import time

import pytest
from conftest import base_env, mpiexec_path, run_cmd, MPI_DIR

pytest.importorskip("commlib._shm", reason="the C extension is not built (pip install -e .)")

CASES = ("case_segment", "case_all_reduce", "case_reduce_scatter", "case_movement",
         "case_async_and_polled", "case_two_groups", "case_cuda_ipc_runtime_without_gpu")
SMALL_SLOT = "4096"  # 1024 float32 per region: the larger test messages span many chunks


def leftovers():
    return {f for f in os.listdir("/dev/shm") if f.startswith("commlib-")}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shm_collectives(mpirun, n):
    before = leftovers()
    proc = mpirun(n, "shm_cases.py", timeout=240, COMMLIB_SHM_SLOT_BYTES=SMALL_SLOT)
    for case in CASES:
        assert f"ok {case} (world size {n})" in proc.stdout, proc.stdout
    assert leftovers() <= before


def test_shm_polled_mode(mpirun):
    """COMMLIB_TIMEOUT_MODE=raise: every call goes through the poll loop (the ShmOp handles)."""
    proc = mpirun(3, "shm_cases.py", "case_all_reduce", "case_async_and_polled", "case_two_groups",
                  timeout=240, COMMLIB_SHM_SLOT_BYTES=SMALL_SLOT, COMMLIB_TIMEOUT_MODE="raise")
    assert "ok case_two_groups (world size 3)" in proc.stdout, proc.stdout


@pytest.mark.parametrize("mode", ["abort", "raise"])
def test_killed_rank_gives_the_others_an_error(mode, tmp_path):
    """mpiexec -disable-auto-cleanup keeps the survivors running after the kill, so that what
    they do is observable: each raises CommBackendError naming the dead rank, within seconds (and
writes what it caught to a file: hydra stops forwarding output once a rank was killed)."""
    report = tmp_path / "report.txt"
    before = leftovers()
    cmd = [mpiexec_path(), "-disable-auto-cleanup", "-n", "3", os.sys.executable,
           str(MPI_DIR / "shm_cases.py"), "die"]
    start = time.monotonic()
    proc = run_cmd(cmd, timeout=90, check=False,
                   env=base_env(COMMLIB_SHM_SLOT_BYTES=SMALL_SLOT, COMMLIB_TIMEOUT_MODE=mode,
                                SHM_DIE_REPORT=str(report)))
    text = report.read_text() if report.exists() else ""
    took = time.monotonic() - start
    caught = re.findall(r"^rank (\d) caught CommBackendError after ([\d.]+) s", text, re.M)
    assert sorted(r for r, _ in caught) == ["0", "1"], text + proc.stdout + proc.stderr
    assert all(float(s) < 10 for _, s in caught), caught
    assert text.count("unusable afterwards") == 2, text
    assert took < 60
    assert leftovers() <= before, leftovers() - before
