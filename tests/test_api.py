"""The drop-in API under mpiexec at world sizes 1 to 4, and init in every launch mode."""

import sys

import pytest

from conftest import mpiexec_path, run_cmd

CASES = ["case_collectives_every_dtype", "case_avg_and_half_precision_accumulation",
         "case_numpy_noncontiguous_and_views", "case_all_to_all_uneven",
         "case_async_in_reverse_order", "case_point_to_point", "case_groups_and_meshes"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_api(mpirun, n):
    proc = mpirun(n, "api.py", timeout=240)
    for case in CASES:
        assert f"ok {case} (world size {n})" in proc.stdout, proc.stdout


@pytest.mark.parametrize("mode", ["raise", "abort"])
def test_api_in_both_timeout_modes(mpirun, mode):
    proc = mpirun(3, "api.py", timeout=240, COMMLIB_TIMEOUT_MODE=mode)
    assert proc.stdout.count("ok case_") == len(CASES)


def test_readme_example_prints_sixes_on_every_rank():
    code = ("import commlib, torch; commlib.init(); t = torch.full((5,), "
            "float(commlib.get_rank() + 1)); commlib.all_reduce(t); print(t)")
    proc = run_cmd([mpiexec_path(), "-n", "3", sys.executable, "-c", code], timeout=120)
    assert proc.stdout.count("tensor([6., 6., 6., 6., 6.])") == 3, proc.stdout


def test_plain_process_is_a_world_of_one():
    code = ("import commlib, torch; w = commlib.init(); assert w is commlib.init(); "
            "t = torch.arange(3.); commlib.all_reduce(t); "
            "o = torch.empty(3); commlib.all_gather_into_tensor(o, t); "
            "print(w.backend.name, commlib.get_world_size(), t.tolist(), o.tolist()); "
            "commlib.finalize(); print(commlib.init().size)")
    proc = run_cmd([sys.executable, "-c", code], timeout=60)
    lines = proc.stdout.split("\n")
    assert lines[0] == "self 1 [0.0, 1.0, 2.0] [0.0, 1.0, 2.0]", proc.stdout
    assert lines[1] == "1"


def test_mpiexec_world_uses_mpi():
    code = "import commlib; w = commlib.init(); print(w.backend.name, w.size, w.rank)"
    proc = run_cmd([mpiexec_path(), "-n", "2", sys.executable, "-c", code], timeout=120)
    assert sorted(proc.stdout.split("\n")[:2]) == ["mpi 2 0", "mpi 2 1"], proc.stdout
