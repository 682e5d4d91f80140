"""One record per algorithm (commlib/algorithms/registry.py), on real ranks: a toy algorithm
registered from a test file is chosen, explained and run; the CUDA IPC algorithms are reached
through selection for CUDA tensors (host-side, without a GPU) and fall back to NCCL saying why."""

import pytest


@pytest.mark.parametrize("n", [2, 4])
def test_records(mpirun, n):
    proc = mpirun(n, "records.py", timeout=240)
    for case in ("case_toy_algorithm_is_chosen_explained_and_run",
                 "case_cuda_ipc_selection_without_gpu"):
        assert f"ok {case} (world size {n})" in proc.stdout, proc.stdout
