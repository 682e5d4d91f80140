"""cuda_ipc host-side logic (buffer layout, size limits, launch shape, one-shot / two-shot / NCCL
decisions) without a GPU, and the kernels themselves where CUDA is present."""

import pytest
import torch

from commlib import CommArgumentError
from commlib.backends import cuda_ipc as ipc
from commlib.ops import ReduceOp

NV = dict(full_nvlink=True, p2p_ok=True)


def test_layout_is_aligned_and_disjoint():
    lay = ipc.layout(8 << 20)
    assert lay.signal == 0 and lay.data >= ipc.SIGNAL_BYTES
    assert lay.data % 256 == 0 and lay.tmp % 256 == 0 and lay.total % 256 == 0
    assert lay.tmp - lay.data >= 8 << 20 and lay.total - lay.tmp >= 8 << 20
    assert ipc.SIGNAL_BYTES == 2 * 64 * 8 * 4  # ClSignal in csrc/cuda_ipc.cu
    odd = ipc.layout(48)
    assert odd.tmp - odd.data == 256 and odd.total - odd.tmp == 256


@pytest.mark.parametrize("bad", [0, -16, 17, 1.5])
def test_layout_rejects_bad_sizes(bad):
    with pytest.raises(CommArgumentError, match="multiple of 16"):
        ipc.layout(bad)


@pytest.mark.parametrize("ws, nbytes, want", [
    (2, 16, "oneshot"), (2, 8 << 20, "oneshot"),             # 2 GPUs: always one-shot
    (4, (512 << 10) - 16, "oneshot"), (4, 512 << 10, "twoshot"),
    (6, (256 << 10) - 16, "oneshot"), (8, 256 << 10, "twoshot"), (8, 16, "oneshot"),
])
def test_oneshot_twoshot_thresholds(ws, nbytes, want):
    assert ipc.decide(nbytes, torch.bfloat16, ReduceOp.SUM, ws, **NV).algorithm == want


@pytest.mark.parametrize("kwargs, reason", [
    (dict(nbytes=1024, world_size=4, full_nvlink=True, p2p_ok=False), "peer-to-peer"),
    (dict(nbytes=1024, world_size=3, full_nvlink=True, p2p_ok=True), "world size 3"),
    (dict(nbytes=1024, world_size=4, full_nvlink=False, p2p_ok=True), "without full NVLink"),
    (dict(nbytes=1000, world_size=2, full_nvlink=False, p2p_ok=True), "multiple of 16"),
    (dict(nbytes=16 << 20, world_size=2, full_nvlink=True, p2p_ok=True), "exceeds"),
    (dict(nbytes=1024, world_size=2, full_nvlink=True, p2p_ok=True, contiguous=False), "contiguous"),
])
def test_fallback_to_nccl_says_why(kwargs, reason):
    nbytes = kwargs.pop("nbytes")
    ws = kwargs.pop("world_size")
    d = ipc.decide(nbytes, torch.float32, ReduceOp.SUM, ws, **kwargs)
    assert d.algorithm == "nccl" and reason in d.reason, d


def test_two_pcie_gpus_may_use_it_and_unsupported_types_fall_back():
    assert ipc.decide(1024, torch.float16, ReduceOp.AVG, 2, full_nvlink=False, p2p_ok=True).algorithm \
        == "oneshot"
    assert "dtype" in ipc.decide(1024, torch.int32, ReduceOp.SUM, 2, **NV).reason
    assert "bitwise" in ipc.decide(1024, torch.float32, ReduceOp.BAND, 2, **NV).reason


def test_launch_shape_and_kernel_names():
    assert ipc.launch_shape(16) == (1, 512)
    assert ipc.launch_shape(512 * 16 * 3) == (3, 512)
    assert ipc.launch_shape(1 << 30) == (36, 512)  # block limit, below the 64 flag sets
    assert ipc.launch_shape(1 << 30, block_limit=100)[0] == ipc.MAX_BLOCKS
    assert ipc.kernel_name("twoshot", torch.bfloat16) == "cl_ipc_twoshot_bf16"
    assert ipc.op_args(ReduceOp.AVG, 4) == (0, 4) and ipc.op_args(ReduceOp.MAX, 4) == (3, 0)
    source = (ipc._CSRC / "cuda_ipc.cu").read_text()
    for algo in ("oneshot", "twoshot"):
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            assert f"CL_DEFINE_IPC({ipc.kernel_name(algo, dt).rsplit('_', 1)[1]}," in source


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent on this machine")
def test_kernels_load_and_reduce_on_one_gpu():
    """With a GPU: the one-shot kernel over one 'peer' (itself) is the identity, and AVG of one
    rank divides by 1."""
    cupy = pytest.importorskip("cupy")
    mod = ipc.load_module()
    x = cupy.arange(1024, dtype=cupy.float32)
    out = cupy.empty_like(x)
    sig = cupy.zeros(ipc.SIGNAL_BYTES // 4, dtype=cupy.uint32)
    ptrs = cupy.array([x.data.ptr], dtype=cupy.uint64)
    sigs = cupy.array([sig.data.ptr], dtype=cupy.uint64)
    blocks, threads = ipc.launch_shape(x.nbytes)
    mod.get_function("cl_ipc_oneshot_f32")((blocks,), (threads,), (
        ptrs, sigs, out, cupy.uint64(x.size), cupy.int32(0), cupy.int32(1), cupy.uint32(1),
        cupy.int32(0), cupy.int32(0)))
    assert bool((out == x).all())
