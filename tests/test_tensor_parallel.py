"""Tensor-parallel layers (commlib.nn.ColumnParallelLinear, RowParallelLinear, ParallelMLP): the
multi-rank cases of tests/mpi/tp_layers.py in one mpiexec job per world size (1-4; every size in
them is a multiple of 12, so all run at 3 ranks too, there under COMMLIB_DEBUG=1, whose call
checks then run in every layer), each against the dense torch modules. Every job has a hard
timeout (a deadlock fails the test)."""

from __future__ import annotations

import pytest

from conftest import run_mpi

CASES = ["case_column", "case_comm_pattern", "case_errors", "case_from_dense_roundtrip",
         "case_init_matches_dense", "case_mlp", "case_row", "case_row_chunks", "case_subgroup"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_tp_layers_mpi(n):
    """Outputs, input gradients and every parameter gradient (through to_dense()) against
    nn.Linear / the dense MLP for every combination of sequence_parallel x overlap x
    gather_output / input_is_parallel x bias x float64/float32; the collectives each mode issues;
    from_dense/to_dense round trips; typed errors on every rank; subgroups."""
    debug = {"COMMLIB_DEBUG": "1"} if n == 3 else {}
    out = run_mpi(n, "tp_layers.py", *CASES, timeout=140, **debug).stdout
    for case in CASES:
        assert f"ok {case} (world size {n})" in out, out
