"""Shared-memory collectives on real ranks (run by tests/test_shm.py, usually with
COMMLIB_SHM_SLOT_BYTES=4096 so that modest tensors span many chunks of the segment).

Every case checks against references computed here from every rank's input (each rank rebuilds
all inputs from (rank, seed)), and that all ranks hold bitwise identical results (gathered
through mpi4py, not commlib).

The crash scenario (a rank killed mid-collective) is tests/torch_dist/shm_die.py.
"""

import os
import time

import torch
from _harness import main
from algorithms import reference  # float64 / int64 reduction in rank order, rounded once
from mpi4py import MPI

import commlib
from commlib.transports.shm import wait_policy

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
OPS_FLOAT = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
OPS_INT = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def data(rank, count, dtype, op, seed=0):
    g = torch.Generator().manual_seed(7919 * rank + count + seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if op == "PRODUCT":
        return torch.randint(1, 3, (count,), generator=g).to(dtype)
    if dtype.is_floating_point:  # non-integers: rounding of half precision is exercised
        return (torch.randn(count, generator=g, dtype=torch.float64) * 8).to(dtype)
    return torch.randint(0, 4 if dtype in (torch.int8, torch.uint8) else 1000, (count,),
                         generator=g).to(dtype)


def close(got, want, dtype):
    """Exact for integers and bool; for floats within the rounding of float32 accumulation and
    one final rounding to the dtype."""
    if not dtype.is_floating_point:
        return torch.equal(got, want)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    return torch.allclose(got.double(), want.double(), rtol=tol[dtype], atol=tol[dtype] * 8)


def identical_everywhere(t):
    """Every rank holds the same bits."""
    mine = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return len(set(MPI.COMM_WORLD.allgather(mine))) == 1


def ours_in_dev_shm() -> set[str]:
    """commlib's names in /dev/shm (segments and shared buffers)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("commlib-")}


def counts(n):
    slot = int(os.environ.get("COMMLIB_SHM_SLOT_BYTES", 1 << 20))
    return sorted({1, n * 3 + 1, 1000, slot // 2 * 3 + 5})  # the last spans several chunks


def case_segment():
    """A group of ranks on one host has a segment; its name is already unlinked."""
    g, n = commlib.get_world_group(), commlib.get_world_size()
    if n == 1:
        assert g.shm is None
        return
    assert g.shm is not None and g.shm.size == n and g.shm.rank == g.rank
    MPI.COMM_WORLD.Barrier()
    assert not ours_in_dev_shm(), os.listdir("/dev/shm")
    # both ways of waiting once spinning stops (spin 0: every wait sleeps / yields at once), with
    # ranks arriving late by turns so that waits really happen
    spin, sleep0, yield0 = g.shm.spin, g.shm.sleep, g.shm.yield_us
    # a core per rank: yield, then futex after a long wait; ranks outnumbering cores: yield
    assert (spin, sleep0, yield0) == wait_policy(n)
    assert (sleep0, yield0 > 0) in ((True, True), (False, False))
    for sleep, yield_us in ((True, 0), (False, 0), (True, 300)):  # sleep, yield, yield then sleep
        g.shm.sleep, g.shm.spin, g.shm.yield_us = sleep, 0, yield_us
        for i in range(40):
            if i % n == g.rank:
                time.sleep(0.002)
            t = torch.full((3000,), float(g.rank + i))
            commlib.all_reduce(t, algorithm="shm_oneshot" if i % 2 else "shm_twoshot")
            assert torch.equal(t, torch.full((3000,), float(n * (n - 1) // 2 + n * i))), (sleep, i)
    g.shm.sleep, g.shm.spin, g.shm.yield_us = sleep0, spin, yield0
    for name, bad in (("spin", -1), ("yield_us", -5), ("nt_min", -1)):
        try:
            setattr(g.shm, name, bad)
        except ValueError as exc:
            assert name in str(exc), exc
        else:
            raise AssertionError(f"{name} = {bad} accepted")


def case_all_reduce():
    r, n = commlib.get_rank(), commlib.get_world_size()
    for dtype in FLOATS + INTS + [torch.bool]:
        ops = OPS_FLOAT if dtype.is_floating_point else OPS_INT
        if dtype is torch.bool:
            ops = ["SUM", "PRODUCT", "MIN", "MAX"]
        for op in ops:
            for count in counts(n):
                inputs = [data(k, count, dtype, op) for k in range(n)]
                want = reference(inputs, op, dtype)
                for algo in ("shm_oneshot", "shm_twoshot", None):
                    t = inputs[r].clone()
                    commlib.all_reduce(t, op=op, algorithm=algo)
                    assert close(t, want, dtype), (dtype, op, count, algo, t[:4], want[:4])
                    assert identical_everywhere(t), (dtype, op, count, algo)


def case_reduce_scatter():
    r, n = commlib.get_rank(), commlib.get_world_size()
    for dtype in FLOATS + INTS:
        for op in OPS_FLOAT if dtype.is_floating_point else OPS_INT:
            for m in counts(n):
                inputs = [data(k, n * m, dtype, op) for k in range(n)]
                want = reference(inputs, op, dtype)[r * m:(r + 1) * m]
                out = torch.empty(m, dtype=dtype)
                commlib.reduce_scatter_tensor(out, inputs[r].clone(), op=op, algorithm="shm")
                assert close(out, want, dtype), (dtype, op, m)


def case_movement():
    r, n = commlib.get_rank(), commlib.get_world_size()
    shm = commlib.get_world_group().shm
    for stream in (False, True):  # all-gather: streaming stores into every output (nt_min 0)
        if shm is not None:
            default = shm.nt_min
            shm.nt_min = 0 if stream else default
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8):
            for m in counts(n) + ([4099, 3 * 1024 + 1] if stream else []):  # odd byte counts
                inputs = [data(k, m, dtype, "SUM") for k in range(n)]
                base = torch.empty(n * m * dtype.itemsize + 64, dtype=torch.uint8)
                for shift in (0, 3) if stream and dtype.itemsize == 1 else (0,):  # misaligned
                    out = base[shift:shift + n * m * dtype.itemsize].view(dtype)
                    commlib.all_gather_into_tensor(out, inputs[r], algorithm="shm")
                    assert torch.equal(out, torch.cat(inputs)), (dtype, m, stream, shift)
                for root in {0, n - 1}:
                    t = inputs[r].clone()
                    commlib.broadcast(t, group_src=root, algorithm="shm")
                    assert torch.equal(t, inputs[root]), (dtype, m, root, stream)
        if shm is not None:
            shm.nt_min = default
    # NumPy, non-contiguous tensors and 2-d shapes take the same paths
    t = torch.full((6, 4), float(r + 1)).t()
    commlib.all_reduce(t, op="max")
    assert torch.equal(t, torch.full((4, 6), float(n)))
    a = (torch.arange(5, dtype=torch.float64) * (r + 1)).numpy()
    commlib.all_reduce(a)
    assert a.tolist() == [k * n * (n + 1) / 2 for k in range(5)]


def case_async_and_polled():
    """Several operations in flight at once (async), waited in reverse order; the latency plan
    of a repeated call interleaved with them."""
    r, n = commlib.get_rank(), commlib.get_world_size()
    ins = [[data(k, 3000 + i, torch.float32, "SUM") for k in range(n)] for i in range(4)]
    bufs = [x[r].clone() for x in ins]
    algos = ["shm_oneshot", "shm_twoshot", "shm_oneshot", None]
    works = [commlib.all_reduce(b, algorithm=a, async_op=True) for b, a in zip(bufs, algos)]
    planned = torch.full((3,), float(r))
    for _ in range(3):  # blocking calls after pending async ones complete them in order
        commlib.all_reduce(planned)
    out = torch.empty(n * 5)
    w = commlib.all_gather_into_tensor(out, torch.full((5,), float(r)), async_op=True)
    for work in reversed(works):
        work.wait()
    w.wait()
    for b, x in zip(bufs, ins):
        assert close(b, reference(x, "SUM", torch.float32), torch.float32)
    s = sum(range(n))
    assert torch.equal(planned, torch.full((3,), float(s * n ** 2)))
    assert torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(5))


def case_two_groups():
    """Two groups with their own segments, used alternately and concurrently."""
    r, n = commlib.get_rank(), commlib.get_world_size()
    if n < 2:
        return
    rev = commlib.new_group(list(reversed(range(n))))
    half = commlib.new_group(list(range(0, n, 2)))
    assert rev.shm is not None and rev.shm is not commlib.get_world_group().shm
    assert (half.shm is not None) == (half.size > 1 and half.rank >= 0)
    for i in range(20):
        a = torch.full((2000,), float(r + i))
        b = torch.full((2000,), float(r * i))
        wa = commlib.all_reduce(a, group=rev, async_op=True)
        commlib.all_reduce(b)  # world, while rev's is in flight
        wa.wait()
        assert torch.equal(a, torch.full((2000,), float(sum(range(n)) + n * i)))
        assert torch.equal(b, torch.full((2000,), float(sum(range(n)) * i)))
        if half.rank >= 0 and half.size > 1:
            c = torch.full((10,), float(r))
            commlib.all_reduce(c, group=half, op="max")
            assert torch.equal(c, torch.full((10,), float(half.ranks[-1])))


def case_cuda_ipc_runtime_without_gpu():
    """The cuda_ipc runtime is collective: every rank constructs it over the world's engine. Its
    exchange returns every rank's record in rank order; without CUDA every rank reaches the same
    verdict (rank 0 has no CUDA device) and each call takes the fallback, logged once."""
    from commlib.transports import cuda_ipc as ipc
    from commlib import get_world_group

    world = get_world_group()
    r, n = world.rank, world.size
    exchange = ipc.engine_exchange(world.backend)
    got = exchange(bytes([r, 255 - r]) * 3)
    assert got == [bytes([j, 255 - j]) * 3 for j in range(n)], got
    calls = []

    def fallback(t, op):
        calls.append(op)
        commlib.all_reduce(t, op)

    rt = ipc.CudaIpcAllReduce(exchange, r, n, None, fallback, host=12345)
    assert not rt.check.usable and rt.check.reason == "rank 0 has no CUDA device (CUDA is absent there)"
    for op in ("SUM", "MAX"):
        t = torch.full((1000,), float(r + 1))
        assert rt.plan(t, getattr(commlib.ReduceOp, op)).algorithm == "nccl"
        rt.all_reduce(t, getattr(commlib.ReduceOp, op))
        want = n * (n + 1) / 2 if op == "SUM" else n
        assert torch.equal(t, torch.full((1000,), float(want))), (op, t[:4])
    assert calls == [commlib.ReduceOp.SUM, commlib.ReduceOp.MAX]
    assert len(rt._logged) == 1
    rt.close()


def _fixed_anonymous(addr: int, nbytes: int):
    """Private anonymous memory mapped at exactly ``addr`` (MAP_FIXED_NOREPLACE), as a uint8
    tensor, or None where the kernel would not place it there."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    got = libc.mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x100000, -1, 0)
    if got != addr:
        return None
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def case_shared_buffers():
    """commlib.shared_empty: inputs every rank maps are read in place by the all-gather, the
    reduce-scatter and the broadcast (one copy), alone or mixed with private inputs on other
    ranks, across many chunks, and the caller may overwrite them as soon as a call returns."""
    import gc

    r, n = commlib.get_rank(), commlib.get_world_size()
    g = commlib.get_world_group()
    before = ours_in_dev_shm()
    t = commlib.shared_empty(3, 5, dtype=torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype is torch.bfloat16 and t.device.type == "cpu"
    commlib.barrier()  # every rank has unlinked its file's name
    assert ours_in_dev_shm() <= before
    assert (g.shm is not None) == (n > 1)
    if g.shm is not None:
        assert len(g.resources.transports["shm"].peer_buffers) >= n - 1
    assert commlib.shared_empty(0).numel() == 0
    m = int(os.environ.get("COMMLIB_SHM_SLOT_BYTES", 1 << 20)) // 4 * 3 + 7  # several chunks
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        inputs = [data(k, m, dtype, "SUM", seed=5) for k in range(n)]
        for mixed in (False, True):  # True: the odd ranks pass private inputs
            for stream in (False, True):
                if g.shm is not None:
                    default = g.shm.nt_min
                    g.shm.nt_min = 0 if stream else default
                src = commlib.shared_empty(m, dtype=dtype)
                src.copy_(inputs[r])
                mine = src.clone() if mixed and r % 2 else src
                out = torch.empty(n * m, dtype=dtype)
                commlib.all_gather_into_tensor(out, mine, algorithm="shm")
                assert torch.equal(out, torch.cat(inputs)), (dtype, mixed, stream)
                if g.shm is not None:
                    g.shm.nt_min = default
            # in place: the input is this rank's block of the output (a shared one: the peers
            # read the block there, and no copy of it is made)
            full = commlib.shared_empty(n * m, dtype=dtype)
            if mixed and r % 2:
                full = torch.empty(n * m, dtype=dtype)
            full.view(n, m)[r] = inputs[r]
            commlib.all_gather_into_tensor(full, full.view(n, m)[r], algorithm="shm")
            assert torch.equal(full, torch.cat(inputs)), (dtype, mixed, "in place")
            for root in {0, n - 1}:
                buf = commlib.shared_empty(m, dtype=dtype)
                buf.copy_(inputs[r])
                mine = buf.clone() if mixed and r % 2 else buf
                commlib.broadcast(mine, group_src=root, algorithm="shm")
                assert torch.equal(mine, inputs[root]), (dtype, mixed, root)
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for op in OPS_FLOAT if dtype.is_floating_point else OPS_INT:
            inputs = [data(k, n * m, dtype, op, seed=6) for k in range(n)]
            src = commlib.shared_empty(n * m, dtype=dtype)
            src.copy_(inputs[r])
            out = torch.empty(m, dtype=dtype)
            commlib.reduce_scatter_tensor(out, src, op=op, algorithm="shm")
            want = reference(inputs, op, dtype)[r * m:(r + 1) * m]
            assert close(out, want, dtype), (dtype, op)
            assert torch.equal(src, inputs[r]), (dtype, op)  # read, never written
    # Overwritten right after every call (blocking and async): a rank returns only once its peers
    # have read its buffer, so no peer ever sees the next round's values.
    src = commlib.shared_empty(m)
    out = torch.empty(n * m)
    for i in range(30):
        src.fill_(float(100 * i + r))
        if i % 3 == 2:
            commlib.all_gather_into_tensor(out, src, async_op=True).wait()
        else:
            commlib.all_gather_into_tensor(out, src)
        want = torch.arange(n, dtype=torch.float32).add(100 * i).repeat_interleave(m)
        assert torch.equal(out, want), i
    # A buffer that is gone is no longer read in place, even when new memory takes its address.
    if g.shm is not None:
        old = commlib.shared_empty(m)
        old.fill_(-1.0)
        addr, nbytes = old.data_ptr(), old.untyped_storage().nbytes()
        del old
        gc.collect()
        fresh = _fixed_anonymous(addr, nbytes)
        assert fresh is not None, "the freed buffer's address range was not free again"
        x = fresh[:m * 4].view(torch.float32)
        x.fill_(float(r))
        commlib.all_gather_into_tensor(out, x, algorithm="shm")
        assert torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(m))
        del x, fresh  # the memory stays mapped (a test process)
    # Bad arguments everywhere: each rank raises its own error, naming the argument.
    for args, kw, arg in (((-1,), {}, "size"), ((2.5,), {}, "size"),
                          ((3,), {"dtype": "float32"}, "dtype")):
        try:
            commlib.shared_empty(*args, **kw)
            raise AssertionError(f"shared_empty{args} {kw} was not refused")
        except commlib.CommArgumentError as exc:
            assert f"argument '{arg}'" in str(exc) and "Fix:" in str(exc), str(exc)
    # Disagreement raises on every rank, before anything is allocated.
    if n > 1:
        try:
            commlib.shared_empty(10 + r)
            raise AssertionError("ranks asking for different sizes were not refused")
        except commlib.CommMismatchError as exc:
            assert "different sizes" in str(exc) and "Fix:" in str(exc)
        try:
            commlib.shared_empty(-1 if r == n - 1 else 4)
            raise AssertionError("a negative size was not refused")
        except commlib.CommArgumentError as exc:
            assert ("argument 'size'" in str(exc)) == (r == n - 1), str(exc)
            assert "Fix:" in str(exc)
    commlib.barrier()
    assert ours_in_dev_shm() <= before


if __name__ == "__main__":
    main(globals())
