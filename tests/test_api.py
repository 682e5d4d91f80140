"""The drop-in API on real ranks: the cases of tests/mpi/api.py (and the argument errors of
tests/mpi/errors.py) in one job per world size, 1 to 4, under mpiexec; again in both timeout modes
and in debug mode (valid programs must run unchanged); and in-process on the ``self`` backend."""

import pathlib
import re
import sys

import pytest

from conftest import MPI_DIR

sys.path.insert(0, str(MPI_DIR))


def case_names() -> list[str]:
    names = []
    for script in ("api.py", "errors.py"):
        names += re.findall(r"^def (case_\w+)\(", (MPI_DIR / script).read_text(), re.M)
    return sorted(names)


CASES = case_names()


def assert_every_case_ran(proc, n):
    missing = [c for c in CASES if f"ok {c} (world size {n})\n" not in proc.stdout]
    assert not missing, f"cases that did not report ok: {missing}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_api_at_world_size(mpirun, n):
    proc = mpirun(n, "api.py", timeout=240, EXPECT_BACKEND="mpi")
    assert_every_case_ran(proc, n)


@pytest.mark.parametrize("n, env", [
    (3, {"COMMLIB_DEBUG": "1", "COMMLIB_TIMEOUT_MODE": "raise"}),
    (4, {"COMMLIB_TIMEOUT_MODE": "raise"}),
    (2, {"COMMLIB_DEBUG": "1"}),
], ids=["debug-raise-3", "raise-4", "debug-2"])
def test_api_in_other_modes(mpirun, n, env):
    proc = mpirun(n, "api.py", timeout=240, EXPECT_BACKEND="mpi", **env)
    assert_every_case_ran(proc, n)


@pytest.mark.parametrize("case", CASES)
def test_case_on_self_backend(self_world, case):
    """Every case in this process, a world of one on the ``self`` backend."""
    import torch

    threads = torch.get_num_threads()
    try:
        import api  # its harness pins torch to one thread (right for ranks, not for pytest)
    finally:
        torch.set_num_threads(threads)
    (getattr(api, case, None) or getattr(api.errors, case))()


def test_case_list_is_complete():
    assert len(CASES) >= 20 and len(set(CASES)) == len(CASES)
    assert pathlib.Path(MPI_DIR / "api.py").exists()
