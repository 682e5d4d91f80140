"""Shared-memory collectives (commlib/transports/shm.py, csrc/shm/) on real ranks: every
collective x op x dtype at 1 to 4 ranks with messages larger than the segment's regions, async
and polled operation, two groups at once, and a rank killed mid-collective (the others raise,
nothing hangs, nothing is left in /dev/shm)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, torchrun_env

pytest.importorskip("commlib.transports._shm", reason="the C extension is not built (pip install -e .)")

CASES = ("case_segment", "case_all_reduce", "case_reduce_scatter", "case_movement",
         "case_async_and_polled", "case_two_groups", "case_shared_buffers", "case_cuda_ipc_runtime_without_gpu")
DIE = ROOT / "tests" / "torch_dist" / "shm_die.py"
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


@pytest.mark.parametrize("mode,shared,asynchronous", [
    ("abort", False, False), ("raise", False, False), ("raise", True, False),
    ("abort", False, True)])
def test_killed_rank_gives_the_others_an_error(mode, shared, asynchronous, tmp_path):
    """Three ranks (started here with torchrun's variables, see tests/torch_dist/shm_die.py for
    why not mpiexec); the last is SIGKILLed inside a multi-chunk all-reduce, or (``shared``)
    after publishing its block of an all-gather whose other inputs are shared buffers, whose
    owners wait for every peer to have read them before returning, or (``asynchronous``) while
    the survivors compute after issuing an asynchronous all-reduce: their progress thread
    (``COMMLIB_PROGRESS=thread``: by default, ranks that outnumber the cores get none) meets
    the failure meanwhile and ``wait()`` raises it. Each survivor raises
    CommBackendError naming the dead rank within seconds, the group then refuses every call with
    the same error, nothing hangs and nothing is left in /dev/shm."""
    report = tmp_path / "report.txt"
    report.touch()
    before = leftovers()
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(DIE)], cwd=ROOT, start_new_session=True,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for env in torchrun_env(3, COMMLIB_SHM_SLOT_BYTES=SMALL_SLOT,
                                     COMMLIB_TIMEOUT_MODE=mode, SHM_DIE_REPORT=str(report),
                                     SHM_DIE_SHARED=str(int(shared)),
                                     SHM_DIE_ASYNC=str(int(asynchronous)),
                                     # 3 ranks on 2 cores: only a forced thread runs on one host
                                     COMMLIB_PROGRESS="thread" if asynchronous else "auto")]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    took = time.monotonic() - start
    text = report.read_text()
    context = text + "".join(f"--- rank {r}\n{o[-3000:]}" for r, o in enumerate(outputs))
    assert [p.returncode for p in procs] == [0, 0, -signal.SIGKILL], context
    caught = re.findall(r"^rank (\d) caught CommBackendError after ([\d.]+) s: (.*)$", text, re.M)
    assert sorted(r for r, _, _ in caught) == ["0", "1"], context
    for _, seconds, message in caught:
        assert float(seconds) < 10, context
        assert "rank 2 of group 'world'" in message and "exited" in message, context
        assert "Fix:" in message, context
    assert sorted(re.findall(r"^rank (\d) unusable afterwards$", text, re.M)) == ["0", "1"], context
    assert "not found while computing" not in text, context
    assert took < 80
    assert leftovers() <= before, leftovers() - before
