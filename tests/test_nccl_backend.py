"""The nccl backend (CuPy's NCCL bootstrapped over MPI).

Its planning (dtype and op codes, element counts, the all-to-all schedule) and its error messages
are tested everywhere; the multi-rank GPU cases run only where CUDA and CuPy are present.
"""

from __future__ import annotations

import importlib.util
import py_compile
import sys

import pytest
import torch

from commlib.engines import nccl as nb
from commlib.errors import CommBackendError, CommUnsupportedError
from commlib.ops import ReduceOp
from conftest import MPI_DIR


def _cuda_available() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver
        return False


cuda_available = _cuda_available()
needs_cuda = pytest.mark.skipif(
    not cuda_available,
    reason="needs CUDA: CuPy with NCCL and at least one GPU (this machine has none)")


# ----- tables ---------------------------------------------------------------------------------
def test_dtype_table_matches_nccl_h():
    assert nb.nccl_dtype(torch.float16) == 6  # ncclFloat16
    assert nb.nccl_dtype(torch.bfloat16) == 9  # ncclBfloat16
    assert nb.nccl_dtype(torch.float32) == 7
    assert nb.nccl_dtype(torch.float64) == 8
    assert nb.nccl_dtype(torch.int8) == 0
    assert nb.nccl_dtype(torch.uint8) == 1
    assert nb.nccl_dtype(torch.int32) == 2
    assert nb.nccl_dtype(torch.int64) == 4


def test_bool_is_not_reduced_natively():
    with pytest.raises(CommUnsupportedError, match="bool"):
        nb.nccl_dtype(torch.bool)


def test_op_table():
    assert nb.nccl_op(ReduceOp.SUM) == 0
    assert nb.nccl_op(ReduceOp.PRODUCT) == 1
    assert nb.nccl_op(ReduceOp.MAX) == 2
    assert nb.nccl_op(ReduceOp.MIN) == 3
    # AVG is a SUM that commlib divides once afterwards (ncclAvg would divide twice)
    assert nb.nccl_op(ReduceOp.AVG) == nb.nccl_op(ReduceOp.SUM)


@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
def test_bitwise_ops_are_unsupported_and_say_the_fix(op):
    with pytest.raises(CommUnsupportedError) as info:
        nb.nccl_op(op, torch.uint8)
    text = str(info.value)
    assert op.name in text and "uint8" in text and "no bitwise" in text
    assert "algorithm='ring'" in text and "backend='mpi'" in text and "Fix:" in text


def test_backend_advertises_half_precision_and_its_ops():
    assert {torch.float16, torch.bfloat16} <= nb.NCCLBackend.native_reduce_dtypes
    assert nb.NCCLBackend.native_ops == {ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN,
                                         ReduceOp.MAX}
    assert nb.NCCLBackend.devices == {"cuda"}


# ----- counts ---------------------------------------------------------------------------------
def test_reduction_and_movement_counts():
    assert nb.reduction_args(torch.bfloat16, 1000, ReduceOp.SUM) == (1000, 9, 0)
    assert nb.reduction_args(torch.float64, 3, ReduceOp.MIN) == (3, 8, 3)
    # data movement goes as bytes whatever the dtype
    assert nb.movement_args(1000, 2) == (2000, nb.NCCL_UINT8)
    assert nb.movement_args(7, 1) == (7, nb.NCCL_UINT8)
    assert nb.movement_args(0, 8) == (0, nb.NCCL_UINT8)


def test_all_to_all_plan_uneven():
    # 3 ranks, rank 1's view; element counts, 4-byte elements
    in_counts = [2, 0, 3]   # to ranks 0, 1, 2
    out_counts = [1, 0, 4]  # from ranks 0, 1, 2
    steps = nb.plan_all_to_all(1, out_counts, in_counts, 4)
    assert steps == [
        # peers in the order rank, rank+1, ...: self (empty, skipped), 2, 0
        nb.P2PStep("send", 2, 8, 12), nb.P2PStep("recv", 0, 0, 4),
        nb.P2PStep("send", 0, 0, 8), nb.P2PStep("recv", 2, 4, 16),
    ]


def test_all_to_all_plan_is_consistent_across_ranks():
    """Every send planned by one rank has the matching receive planned by its peer, with the same
    byte count, and offsets tile each buffer exactly."""
    size, item = 4, 2

    def count(s, d):
        return (3 * s + d) % 4

    plans = {r: nb.plan_all_to_all(r, [count(s, r) for s in range(size)],
                                   [count(r, d) for d in range(size)], item)
             for r in range(size)}
    sends = {(r, s.peer): s.nbytes for r, p in plans.items() for s in p if s.kind == "send"}
    recvs = {(s.peer, r): s.nbytes for r, p in plans.items() for s in p if s.kind == "recv"}
    assert sends == recvs
    assert sends == {(s, d): count(s, d) * item for s in range(size) for d in range(size)
                     if count(s, d)}
    for plan in plans.values():
        for kind in ("send", "recv"):
            spans = sorted((s.offset, s.offset + s.nbytes) for s in plan if s.kind == kind)
            for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
                assert end <= start


def test_device_choice():
    assert [nb.device_for_local_rank(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(CommBackendError, match="no CUDA device"):
        nb.device_for_local_rank(0, 0)


# ----- without CuPy / CUDA --------------------------------------------------------------------
def test_module_imports_without_cupy():
    assert "cupy" not in sys.modules or cuda_available
    from commlib.engines import get_backend_class

    assert get_backend_class("nccl") is nb.NCCLBackend


def test_create_world_without_cupy_says_how(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(CommBackendError) as info:
        nb.NCCLBackend.create_world()
    text = str(info.value)
    assert "CuPy" in text and "Fix:" in text and "cupy-cuda12x" in text and "mpi" in text


def test_cpu_tensor_is_refused_with_a_fix():
    backend = nb.NCCLBackend.__new__(nb.NCCLBackend)
    with pytest.raises(CommBackendError, match="GPU memory only.*Fix:"):
        backend._ptr(torch.ones(3))


def test_any_source_receive_is_unsupported():
    backend = nb.NCCLBackend.__new__(nb.NCCLBackend)
    with pytest.raises(CommUnsupportedError, match="any-source.*Fix: pass src="):
        backend.irecv(torch.ones(3), None, 0, user=True)


def test_gpu_case_script_compiles():
    py_compile.compile(str(MPI_DIR / "nccl_cases.py"), doraise=True)


# ----- on GPUs --------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("n", [1, 2])
def test_nccl_collectives_on_gpus(mpirun, n):
    proc = mpirun(n, "nccl_cases.py", COMMLIB_BACKEND="nccl")
    for case in ("case_backend_is_nccl", "case_all_reduce_half_native",
                 "case_bitwise_is_unsupported", "case_movement", "case_p2p_ring",
                 "case_subgroup"):
        assert f"ok {case} (world size {n})" in proc.stdout, proc.stdout
