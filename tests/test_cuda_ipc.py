"""cuda_ipc host-side logic (buffer layout, size limits, launch shape, one-shot / two-shot / NCCL
decisions) without a GPU, and the kernels themselves where CUDA is present."""

import pytest
import torch

from commlib import CommArgumentError
from commlib.transports import cuda_ipc as ipc
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


# ----- the runtime's host-side decisions (commlib.transports.cuda_ipc.CudaIpcAllReduce) ---------
def rec(uuid, p2p=0b1111, nvl=0b1111, host=7, handle=b"", offset=0):
    return ipc.PeerRecord(host, 100, uuid, p2p, nvl, handle, offset)


def test_records_round_trip_through_bytes():
    handle = bytes(range(64))
    r = rec("GPU-0a1b", p2p=0b101, nvl=0b1, handle=handle, offset=3 << 20)
    data = ipc.pack_record(r)
    assert len(data) == len(ipc.pack_record(rec("x")))  # fixed size: one all-gather
    assert ipc.unpack_record(data) == r
    assert ipc.unpack_record(ipc.pack_record(rec(""))) == rec("")
    with pytest.raises(CommArgumentError, match="cudaIpcMemHandle"):
        ipc.pack_record(rec("a", handle=b"short"))


UU = ["u0", "u1", "u2", "u3"]


@pytest.mark.parametrize("records, reason", [
    ([rec("u0"), rec("")], "rank 1 has no CUDA device"),
    ([rec("u0"), rec("u1", host=8)], "span 2 hosts"),
    ([rec("u0"), rec("u1"), rec("u0")], "ranks 0 and 2 share GPU u0"),
    ([rec("u0", p2p=0b11), rec("u1", p2p=0b10)], "from rank 1 to rank 0"),
    ([rec("u0", p2p=0b1011), rec("u1"), rec("u2"), rec("u3")], "from rank 0 to rank 2"),
    ([rec(f"u{i}") for i in range(9)], "at most 8"),
])
def test_group_check_refuses_and_says_why(records, reason):
    check = ipc.check_group(records)
    assert not check.usable and reason in check.reason, check


def test_group_check_accepts_and_reports_nvlink():
    full = ipc.check_group([rec(u) for u in UU])
    assert full.usable and full.full_nvlink
    partial = ipc.check_group([rec(u, nvl=0b1111 if i else 0b0111) for i, u in enumerate(UU)])
    assert partial.usable and not partial.full_nvlink
    pcie = ipc.check_group([rec("u0", nvl=0b01), rec("u1", nvl=0b10)])
    assert pcie.usable and not pcie.full_nvlink


def test_peer_devices_map_uuids_to_this_process_indices():
    assert ipc.peer_devices(["a", "b", "c"], ["c", "a"]) == [2, 0]
    assert ipc.peer_devices(["b"], ["a", "b"]) == [None, 0]  # hidden by CUDA_VISIBLE_DEVICES


def test_planner_turns_decisions_into_launches():
    nv4 = ipc.Planner(4, ipc.check_group([rec(u) for u in UU]))
    p = nv4.plan(1024, torch.bfloat16, ReduceOp.AVG)
    assert p == ipc.Plan("oneshot", p.reason, "cl_ipc_oneshot_bf16", 1, 512, 1024, 0, 4)
    big = nv4.plan(1 << 20, torch.float32, ReduceOp.MAX)  # 4 MiB on 4 GPUs: two-shot
    assert (big.algorithm, big.kernel, big.grid, big.op_code, big.avg) == \
        ("twoshot", "cl_ipc_twoshot_f32", 36, 3, 0)
    assert nv4.plan(1 << 20, torch.float32, ReduceOp.MAX) is big  # memoized
    too_big = nv4.plan(4 << 20, torch.float32, ReduceOp.SUM)
    assert too_big.algorithm == "nccl" and "exceeds" in too_big.reason and too_big.kernel is None
    assert "not contiguous" in nv4.plan(1024, torch.float32, ReduceOp.SUM, False).reason
    assert "multiple of 16" in nv4.plan(3, torch.float32, ReduceOp.SUM).reason
    pcie4 = ipc.Planner(4, ipc.check_group([rec(u, nvl=0) for u in UU]))
    assert "without full NVLink" in pcie4.plan(1024, torch.float32, ReduceOp.SUM).reason
    off = ipc.Planner(2, ipc.check_group([rec("u0"), rec("")]))
    assert off.plan(1024, torch.float32, ReduceOp.SUM) == ipc.Plan("nccl", "rank 1 has no CUDA "
                                                                           "device (CUDA is absent there)")


def test_runtime_constructs_without_a_gpu_and_falls_back():
    """One rank (exchange = identity): no CUDA device, so every call goes to the fallback with
    the reason logged once; nothing touches CUDA or CuPy."""
    seen = []
    rt = ipc.CudaIpcAllReduce(lambda b: [b], 0, 1, None, lambda t, op: seen.append((t, op)), host=1)
    assert not rt.check.usable and "no CUDA device" in rt.check.reason
    t = torch.ones(8)
    assert rt.plan(t, ReduceOp.SUM).algorithm == "nccl"
    rt.all_reduce(t, ReduceOp.MIN)
    rt.all_reduce(t, ReduceOp.SUM)
    assert [op for _, op in seen] == [ReduceOp.MIN, ReduceOp.SUM] and seen[0][0] is t
    assert len(rt._logged) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent on this machine")
def test_runtime_on_one_gpu_is_the_identity():
    """With a GPU and CuPy: a one-rank group allocates, exports and (trivially) checks its buffer;
    1 rank is not a kernel world size, so it falls back; the record carries a real IPC handle."""
    pytest.importorskip("cupy")
    seen = []
    rt = ipc.CudaIpcAllReduce(lambda b: [b], 0, 1, 0, lambda t, op: seen.append(op), host=1)
    assert rt.check.usable, rt.check
    t = torch.ones(1024, device="cuda")
    assert "world size 1" in rt.plan(t).reason
    rt.all_reduce(t)
    assert seen == [ReduceOp.SUM]
    rt.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one host; CUDA is absent here")
def test_all_reduce_reaches_the_kernels_through_selection(mpirun):
    """commlib.all_reduce on CUDA tensors, NCCL engine (CuPy) under mpiexec: the kernels run where
    selection picks them, NCCL elsewhere, and every result matches the definition."""
    pytest.importorskip("cupy")
    proc = mpirun(2, "cuda_ipc_gpu.py", timeout=300, COMMLIB_BACKEND="nccl")
    assert "ok case_all_reduce_through_the_kernels (world size 2)" in proc.stdout, proc.stdout
