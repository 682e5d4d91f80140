"""The training pieces of commlib.compress (tests/mpi/compress_training.py): the differentiable
tensor-parallel collectives, RowParallelLinear(compress=...), pipeline activations and the DDP
hook's bucket handling in one mpiexec job per world size; the DDP acceptance test (200 steps, int8
with error feedback, within 2% of exact) on a torchrun-like gloo job, as the torch backend's tests
run. Every job has a hard timeout (a deadlock fails the test)."""

from __future__ import annotations

import re

import pytest

from conftest import MPI_DIR, run_mpi
from test_torch_backend import run_torch

CASES = ["case_tp_functions_against_dense", "case_mlp_against_dense",
         "case_row_parallel_compress", "case_parallel_mlp_compress", "case_pipeline_activations",
         "case_ddp_hook_buckets", "case_ddp_hook_overlap", "case_errors"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 4])
def test_compress_training_mpi(n):
    """Outputs and every gradient against the dense computation: exact backwards equal, compressed
    ones within the codec's bound (or equal to its round trip); the codec runs only where asked
    (wire bytes per direction); typed errors."""
    out = run_mpi(n, "compress_training.py", *CASES, timeout=140).stdout
    for case in CASES:
        assert f"ok {case} (world size {n})" in out, out


@pytest.mark.timeout(150)
def test_ddp_int8_error_feedback_within_2_percent():
    """DistributedDataParallel on gloo, 2 ranks, 200 steps: the int8 hook with error feedback
    ends within 2% of the exact all-reduce's loss; the hook ran (compress.wire bytes > 0)."""
    out = run_torch(2, ["case_ddp_int8_error_feedback"], timeout=140,
                    script=MPI_DIR / "compress_training.py")
    assert "ok case_ddp_int8_error_feedback (world size 2)" in out, out
    found = re.search(r"exact ([\d.]+), int8\+ef ([\d.]+)", out)
    assert found, out
    exact, compressed = map(float, found.groups())
    assert abs(compressed - exact) / exact <= 0.02, out
