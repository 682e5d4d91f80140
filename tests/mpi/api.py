"""The drop-in API on real ranks: every collective x op x dtype, inputs of every kind (torch, NumPy,
non-contiguous views, 0-d, empty), async Work, point-to-point, groups and meshes, init/finalize.

Run under ``mpiexec -n N`` (backend mpi) or as a plain ``python`` process (backend self, world size
1); ``EXPECT_BACKEND`` names the backend the launch should give. The argument-error cases of
``errors.py`` run in the same job. Expected values are computed here with torch from every rank's
input, which each rank rebuilds from (rank, seed); never by commlib.
"""

import datetime
import functools
import os
import time

import errors
import numpy as np
import torch
from _harness import main

import commlib
from commlib import ReduceOp

SUM, AVG, PRODUCT, MIN, MAX = ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX
BAND, BOR, BXOR = ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
DTYPES = FLOATS + INTS + [torch.bool]
LIMITS = {torch.int8: (-128, 128), torch.uint8: (0, 256), torch.int32: (-2**31, 2**31),
          torch.int64: (-2**62, 2**62)}


def world():
    return commlib.get_rank(), commlib.get_world_size()


def counts(n):
    return (0, 1, n * 3 + 1, 3000)


def valid_ops(dtype):
    if dtype is torch.bool:
        return [SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR]
    if dtype.is_floating_point:
        return [SUM, AVG, PRODUCT, MIN, MAX]
    return [SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR]


def make(rank, count, dtype, op=SUM, salt=0):
    """Rank ``rank``'s input: values chosen so that every result is exact (no overflow, sums of
    quarters), so any reduction order gives the same bits."""
    seed = 1_000_003 * rank + 7919 * count + 131 * DTYPES.index(dtype) + 17 * list(ReduceOp).index(op)
    g = torch.Generator().manual_seed(seed + 100_000_007 * salt)

    def pick(values):
        values = torch.tensor(values, dtype=torch.float64)
        return values[torch.randint(0, len(values), (count,), generator=g)].to(dtype)

    if dtype is torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    floating = dtype.is_floating_point
    if op in (SUM, AVG):
        if floating:
            return (torch.randint(-8, 9, (count,), generator=g) / 4).to(dtype)
        bound = {torch.int8: 20, torch.uint8: 60, torch.int32: 2**28, torch.int64: 2**60}[dtype]
        low = 0 if dtype is torch.uint8 else -bound
        return torch.randint(low, bound, (count,), generator=g, dtype=torch.int64).to(dtype)
    if op is PRODUCT:
        if floating:
            return pick([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])
        return pick([1, 2, 3] if dtype is torch.uint8 else [-2, -1, 1, 2])
    if floating:  # MIN, MAX: any values
        return (torch.randn(count, generator=g, dtype=torch.float64) * 100).to(dtype)
    low, high = LIMITS[dtype]
    return torch.randint(low, high, (count,), generator=g, dtype=torch.int64).to(dtype)


def reference(xs, op):
    """The reduction of the ranks' inputs ``xs``, computed here with torch."""
    dtype = xs[0].dtype
    s = torch.stack(xs)
    if dtype is torch.bool:  # bool: SUM/MAX are OR, PRODUCT/MIN are AND
        if op in (SUM, MAX, BOR):
            return s.any(0)
        if op in (PRODUCT, MIN, BAND):
            return s.all(0)
        return functools.reduce(torch.logical_xor, xs)
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    if op is SUM:
        return s.to(wide).sum(0).to(dtype)
    if op is AVG:
        return (s.to(torch.float64).sum(0) / len(xs)).to(dtype)
    if op is PRODUCT:
        return s.to(wide).prod(0).to(dtype)
    if op is MIN:
        return s.amin(0)
    if op is MAX:
        return s.amax(0)
    fn = {BAND: torch.bitwise_and, BOR: torch.bitwise_or, BXOR: torch.bitwise_xor}[op]
    return functools.reduce(fn, xs)


def check(got, want, *what):
    got = torch.as_tensor(got)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int((got != want).sum())} wrong of {got.numel()}; first at "
                             f"{bad}: got {got[tuple(bad)]} want {want[tuple(bad)]}")


# ----- reductions: every op valid for the dtype x every dtype x element counts ---------------
def case_all_reduce_every_op_and_dtype():
    r, n = world()
    for dtype in DTYPES:
        for op in valid_ops(dtype):
            for count in counts(n):
                xs = [make(k, count, dtype, op) for k in range(n)]
                t = xs[r].clone()
                assert commlib.all_reduce(t, op=op) is None
                check(t, reference(xs, op), "all_reduce", dtype, op, count)


def case_reduce_every_op_and_dtype():
    r, n = world()
    for dtype in DTYPES:
        for i, op in enumerate(valid_ops(dtype)):
            for count in counts(n):
                xs = [make(k, count, dtype, op, salt=1) for k in range(n)]
                dst = (i + count) % n
                t = xs[r].clone()
                if i % 2:
                    commlib.reduce(t, dst=dst, op=op)
                else:
                    commlib.reduce(t, op=op, group_dst=dst)
                want = reference(xs, op) if r == dst else xs[r]  # other ranks: unchanged
                check(t, want, "reduce", dtype, op, count, dst)


def case_reduce_scatter_every_op_and_dtype():
    r, n = world()
    for dtype in DTYPES:
        for op in valid_ops(dtype):
            for count in (0, 1, n * 3 + 1, 1000):
                xs = [make(k, n * count, dtype, op, salt=2) for k in range(n)]
                out = torch.zeros(count, dtype=dtype)
                commlib.reduce_scatter_tensor(out, xs[r].clone(), op=op)
                check(out, reference(xs, op)[r * count:(r + 1) * count], "reduce_scatter", dtype,
                      op, count)


def case_half_precision_accumulates_in_float32():
    r, n = world()
    # Rank 0 holds `big`, every other rank 1. At `big` the dtype's spacing is 2, so adding 1 in
    # the dtype rounds back to `big` (tie to even): accumulating in bf16/fp16 loses every 1.
    # float32 accumulation then one rounding gives the exact sum rounded once.
    for dtype, big in ((torch.bfloat16, 256.0), (torch.float16, 2048.0)):
        for count in (5, 3000):
            xs = [torch.full((count,), big if k == 0 else 1.0, dtype=dtype) for k in range(n)]
            exact = big + (n - 1)
            want = torch.full((count,), exact, dtype=torch.float64).to(dtype)
            naive = xs[0].clone()
            for x in xs[1:]:
                naive += x  # what accumulating in the dtype itself gives
            if n >= 3:
                assert not torch.equal(naive, want), "the case would not tell the difference"
            t = xs[r].clone()
            commlib.all_reduce(t)
            check(t, want, "all_reduce", dtype)
            t = xs[r].clone()
            commlib.all_reduce(t, op=AVG)
            check(t, torch.full((count,), exact / n, dtype=torch.float64).to(dtype), "avg", dtype)
            t = xs[r].clone()
            commlib.reduce(t, dst=n - 1)
            check(t, want if r == n - 1 else xs[r], "reduce", dtype)
            out = torch.empty(count, dtype=dtype)
            commlib.reduce_scatter_tensor(out, xs[r].repeat(n))
            check(out, want, "reduce_scatter", dtype)


# ----- data movement: every dtype ------------------------------------------------------------
def a2a_splits(n, i, j, salt=0):
    """Rows rank i sends rank j: uneven, with zeros (rank 0 sends nothing when salt is 1)."""
    if salt == 1 and i == 0:
        return 0
    return (i + 2 * j + salt) % 4


def case_data_movement_every_dtype():
    r, n = world()
    for dtype in DTYPES:
        for count in counts(n):
            xs = [make(k, count, dtype, salt=3) for k in range(n)]
            src = count % n
            t = xs[r].clone() if r == src else torch.zeros(count, dtype=dtype)
            commlib.broadcast(t, src=src)
            check(t, xs[src], "broadcast", dtype, count)
            t = xs[r].clone() if r == n - 1 else torch.zeros(count, dtype=dtype)
            commlib.broadcast(t, group_src=n - 1)
            check(t, xs[n - 1], "broadcast group_src", dtype, count)
            out = torch.zeros(n * count, dtype=dtype)
            commlib.all_gather_into_tensor(out, xs[r])
            check(out, torch.cat(xs), "all_gather_into_tensor", dtype, count)
            out = torch.zeros(n, count, dtype=dtype)
            commlib.all_gather_into_tensor(out, xs[r])
            check(out, torch.stack(xs), "all_gather_into_tensor (n, count)", dtype, count)
            outs = [torch.zeros(count, dtype=dtype) for _ in range(n)]
            commlib.all_gather(outs, xs[r])
            for k in range(n):
                check(outs[k], xs[k], "all_gather", dtype, count, k)
        for salt in (0, 1):  # uneven split sizes with zeros; rank 0 sends nothing at salt 1
            rows = [[make(i, 3 * a2a_splits(n, i, j, salt), dtype, salt=10 + j).view(-1, 3)
                     for j in range(n)] for i in range(n)]
            inp = torch.cat(rows[r])
            out = torch.zeros(sum(a2a_splits(n, i, r, salt) for i in range(n)), 3, dtype=dtype)
            commlib.all_to_all_single(out, inp, [a2a_splits(n, i, r, salt) for i in range(n)],
                                      [a2a_splits(n, r, j, salt) for j in range(n)])
            check(out, torch.cat([rows[i][r] for i in range(n)]), "all_to_all uneven", dtype, salt)
        blocks = [make(k, 2 * n, dtype, salt=4).view(n, 2) for k in range(n)]
        out = torch.zeros(n, 2, dtype=dtype)
        commlib.all_to_all_single(out, blocks[r])  # equal splits
        check(out, torch.stack([blocks[i][r] for i in range(n)]), "all_to_all even", dtype)


def case_scalars_and_shapes():
    r, n = world()
    t = torch.tensor(float(r + 1))  # 0-d
    commlib.all_reduce(t)
    check(t, torch.tensor(n * (n + 1) / 2), "0-d all_reduce")
    t = torch.tensor(r, dtype=torch.int64)
    commlib.broadcast(t, src=n - 1)
    check(t, torch.tensor(n - 1), "0-d broadcast")
    t = torch.tensor(r + 1, dtype=torch.int32)
    commlib.reduce(t, dst=0, op=MAX)
    check(t, torch.tensor(n if r == 0 else r + 1, dtype=torch.int32), "0-d reduce")
    xs = [make(k, 24, torch.float32, salt=5).view(2, 3, 4) for k in range(n)]
    t = xs[r].clone()
    commlib.all_reduce(t)
    check(t, reference(xs, SUM), "3-d all_reduce")
    out = torch.zeros(n, 2, 3, 4)
    commlib.all_gather_into_tensor(out, xs[r])
    check(out, torch.stack(xs), "3-d all_gather_into_tensor")
    big = [make(k, n * 6, torch.int32, salt=6).view(n * 2, 3) for k in range(n)]
    out = torch.zeros(2, 3, dtype=torch.int32)
    commlib.reduce_scatter_tensor(out, big[r])
    check(out, reference(big, SUM)[2 * r:2 * r + 2], "2-d reduce_scatter")
    t = torch.zeros(0, 5)
    commlib.all_reduce(t)
    commlib.broadcast(t, src=0)
    assert t.shape == (0, 5)


# ----- NumPy arrays and non-contiguous views: results land in the caller's memory -------------
def case_numpy_arrays_in_place():
    r, n = world()
    a = np.full((4, 3), r + 1, dtype=np.int64)
    assert commlib.all_reduce(a) is None
    assert (a == n * (n + 1) // 2).all(), a
    h = np.full(5, 0.25 * (r + 1), dtype=np.float16)  # float32 accumulation, AVG
    commlib.all_reduce(h, op="avg")
    assert h.dtype == np.float16 and (h == np.float16(0.25 * (n + 1) / 2)).all(), h
    b = np.array([r == 0, True, r % 2 == 0])
    commlib.all_reduce(b, op=MIN)
    assert b.tolist() == [n == 1, True, n == 1], b
    u = np.full(3, 1 << r, dtype=np.uint8) if r < 8 else np.zeros(3, np.uint8)
    commlib.all_reduce(u, op=BOR)
    assert (u == (1 << n) - 1).all(), u
    c = np.arange(6, dtype=np.float32) + r
    commlib.broadcast(c, src=n - 1)
    assert (c == np.arange(6) + n - 1).all(), c
    d = np.full(3, r + 1, dtype=np.int32)
    commlib.reduce(d, dst=0, op=PRODUCT)
    assert (d == (np.prod(np.arange(1, n + 1)) if r == 0 else r + 1)).all(), d
    out = np.zeros((n, 3), dtype=np.float64)
    inp = np.full(3, float(r))
    inp.flags.writeable = False  # inputs may be read-only
    commlib.all_gather_into_tensor(out, inp)
    assert (out == np.arange(n)[:, None]).all(), out
    outs = [np.zeros(2, dtype=np.int8) for _ in range(n)]
    commlib.all_gather(outs, np.full(2, r, dtype=np.int8))
    assert all((o == k).all() for k, o in enumerate(outs)), outs
    out = np.zeros(2, dtype=np.float32)
    commlib.reduce_scatter_tensor(out, np.arange(2 * n, dtype=np.float32) * (r + 1))
    assert (out == np.arange(2 * r, 2 * r + 2) * n * (n + 1) / 2).all(), out
    out = np.zeros(n, dtype=np.int64)
    commlib.all_to_all_single(out, np.arange(n) + 10 * r)
    assert (out == 10 * np.arange(n) + r).all(), out
    m = np.zeros((6, 4), dtype=np.float32)
    col = m[:, 1]  # strided view: the result must land in m
    col += r + 1
    commlib.all_reduce(col)
    assert (m[:, 1] == n * (n + 1) / 2).all() and (m[:, [0, 2, 3]] == 0).all(), m
    tr = (np.arange(12, dtype=np.float64).reshape(3, 4) + r).T  # transposed
    commlib.broadcast(tr, src=0)
    assert (tr == np.arange(12).reshape(3, 4).T).all(), tr


def case_non_contiguous_written_back():
    r, n = world()
    base = torch.zeros(5, 4)
    col = base[:, 2]
    col.fill_(float(r + 1))
    commlib.all_reduce(col, op=PRODUCT)
    check(base[:, 2], torch.full((5,), float(np.prod(range(1, n + 1)))), "strided all_reduce")
    assert not base[:, [0, 1, 3]].any(), "neighbouring memory changed"
    for dtype, op in ((torch.bfloat16, AVG), (torch.bool, SUM), (torch.int8, BXOR)):
        xs = [make(k, 24, dtype, op, salt=7).view(4, 6) for k in range(n)]
        t = xs[r].t().contiguous().t()  # same values, column-major memory
        assert not t.is_contiguous()
        commlib.all_reduce(t, op=op)
        check(t, reference(xs, op), "transposed all_reduce", dtype, op)
    xs = [make(k, 12, torch.float64, salt=8).view(3, 4) for k in range(n)]
    t = xs[r].t()
    commlib.broadcast(t, src=n - 1)
    check(t, xs[n - 1].t(), "transposed broadcast")
    base = torch.zeros(7, 3, dtype=torch.int32)
    view = base[::2, 1]
    view.copy_(torch.arange(4, dtype=torch.int32) + r)
    commlib.reduce(view, dst=n - 1)
    want = torch.arange(4, dtype=torch.int32) * n + n * (n - 1) // 2 if r == n - 1 else torch.arange(4) + r
    check(base[::2, 1], want.to(torch.int32), "strided reduce")
    assert base.sum() == base[::2, 1].sum(), "reduce wrote outside the view"
    out_base = torch.zeros(3, 2 * n)
    out = out_base.t()  # (2n, 3), non-contiguous
    inp = (torch.arange(12.0).view(2, 6) + 100 * r)[:, ::2]  # (2, 3), strided
    commlib.all_gather_into_tensor(out, inp)
    check(out, torch.cat([torch.arange(12.0).view(2, 6)[:, ::2] + 100 * k for k in range(n)]),
          "non-contiguous all_gather_into_tensor")
    big = torch.zeros(3, n)
    outs = [big[:, k] for k in range(n)]
    commlib.all_gather(outs, torch.arange(6.0).view(3, 2)[:, 1] + r)
    check(big, torch.arange(6.0).view(3, 2)[:, 1:] + torch.arange(n), "non-contiguous all_gather")
    xs = [make(k, 4 * n, torch.float32, salt=9).view(n, 4) for k in range(n)]
    inp = xs[r].t().contiguous().t()  # logical (n, 4), transposed memory
    out_base = torch.zeros(4, 2)
    commlib.reduce_scatter_tensor(out_base[:, 1], inp)
    check(out_base[:, 1], reference(xs, SUM)[r], "non-contiguous reduce_scatter")
    assert not out_base[:, 0].any()
    inp = (torch.arange(3.0 * n).view(3, n) + 10 * r).t()  # (n, 3) transposed: row j to rank j
    out_base = torch.zeros(n, 6)
    commlib.all_to_all_single(out_base[:, ::2], inp)
    want = torch.stack([torch.arange(3.0 * n).view(3, n)[:, r] + 10 * i for i in range(n)])
    check(out_base[:, ::2], want, "non-contiguous all_to_all")
    assert not out_base[:, 1::2].any()


def case_autograd_tensors_and_fortran_arrays():
    r, n = world()
    leaf = torch.full((3,), float(r + 1), requires_grad=True)  # e.g. a parameter
    commlib.all_reduce(leaf)  # as torch.distributed: on the data, not recorded by autograd
    assert leaf.requires_grad and torch.equal(leaf.detach(), torch.full((3,), n * (n + 1) / 2))
    commlib.all_reduce(leaf, op=MAX)  # again (no plan is made for it)
    assert torch.equal(leaf.detach(), torch.full((3,), n * (n + 1) / 2))
    param = torch.full((4,), float(r), requires_grad=True)
    commlib.broadcast(param, src=n - 1)
    assert torch.equal(param.detach(), torch.full((4,), float(n - 1)))
    out = torch.zeros(n, 4)
    commlib.all_gather_into_tensor(out, param * 2)  # a non-leaf input
    assert torch.equal(out, torch.full((n, 4), 2.0 * (n - 1)))
    f = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1))
    commlib.all_reduce(f)
    assert f.flags.f_contiguous and (f == np.arange(6).reshape(2, 3) * n * (n + 1) / 2).all(), f


def case_in_place_all_gather_and_reduce_scatter():
    r, n = world()
    xs = [make(k, 3, torch.float32, salt=11) for k in range(n)]
    out = torch.full((n, 3), -1.0)
    out[r] = xs[r]
    commlib.all_gather_into_tensor(out, out[r])  # the input is this rank's slice of the output
    check(out, torch.stack(xs), "in-place all_gather_into_tensor")
    flat = torch.full((n * 3,), -1.0)
    flat[3 * r:3 * r + 3] = xs[r]
    commlib.all_gather_into_tensor(flat, flat[3 * r:3 * r + 3], async_op=True).wait()
    check(flat, torch.cat(xs), "in-place async all_gather_into_tensor")
    arr = np.full((n, 2), -1, dtype=np.int64)
    arr[r] = r
    commlib.all_gather_into_tensor(arr, arr[r])
    assert (arr == np.arange(n)[:, None]).all(), arr
    outs = [torch.zeros(3) for _ in range(n)]
    outs[r] = xs[r].clone()
    commlib.all_gather(outs, outs[r])  # torch.distributed allows tensor_list[rank] as input
    for k in range(n):
        check(outs[k], xs[k], "all_gather with tensor_list[rank] as input", k)
    big = [make(k, 3 * n, torch.int64, salt=12) for k in range(n)]
    inp = big[r].clone()
    commlib.reduce_scatter_tensor(inp[3 * r:3 * r + 3], inp)  # output inside the input
    check(inp[3 * r:3 * r + 3], reference(big, SUM)[3 * r:3 * r + 3], "in-place reduce_scatter")


# ----- async: Work, several outstanding, waited in reverse ------------------------------------
def case_async_outstanding_waited_in_reverse():
    r, n = world()
    xs = [make(k, 1000, torch.float32, salt=13) for k in range(n)]
    hs = [make(k, 100, torch.bfloat16, AVG, salt=14) for k in range(n)]
    works, checks = [], []

    def add(work, fn):
        assert isinstance(work, commlib.Work), work
        works.append(work)
        checks.append(fn)

    t1 = xs[r].clone()
    add(commlib.all_reduce(t1, async_op=True), lambda: check(t1, reference(xs, SUM), "async all_reduce"))
    t2 = hs[r].clone()
    add(commlib.all_reduce(t2, op=AVG, async_op=True), lambda: check(t2, reference(hs, AVG), "async avg"))
    base = torch.zeros(1000, 2)
    base[:, 1] = xs[r]
    add(commlib.all_reduce(base[:, 1], op=MAX, async_op=True),
        lambda: check(base[:, 1], reference(xs, MAX), "async strided all_reduce"))
    t3 = xs[r].clone()
    add(commlib.all_reduce(t3, async_op=True, algorithm="ring"),  # a multi-step algorithm
        lambda: check(t3, reference(xs, SUM), "async ring all_reduce"))
    t4 = xs[r].clone()
    add(commlib.broadcast(t4, src=n - 1, async_op=True), lambda: check(t4, xs[n - 1], "async broadcast"))
    t5 = xs[r].clone()
    add(commlib.reduce(t5, dst=0, op=MIN, async_op=True),
        lambda: check(t5, reference(xs, MIN) if r == 0 else xs[r], "async reduce"))
    g1 = torch.zeros(n, 1000)
    add(commlib.all_gather_into_tensor(g1, xs[r], async_op=True),
        lambda: check(g1, torch.stack(xs), "async all_gather_into_tensor"))
    g2 = [torch.zeros(100, dtype=torch.bfloat16) for _ in range(n)]
    add(commlib.all_gather(g2, hs[r], async_op=True),
        lambda: [check(g2[k], hs[k], "async all_gather") for k in range(n)])
    rs = torch.zeros(10)
    big = [make(k, 10 * n, torch.float32, salt=15) for k in range(n)]
    add(commlib.reduce_scatter_tensor(rs, big[r], async_op=True),
        lambda: check(rs, reference(big, SUM)[10 * r:10 * r + 10], "async reduce_scatter"))
    a2a = torch.zeros(n, dtype=torch.int64)
    add(commlib.all_to_all_single(a2a, torch.arange(n) + 10 * r, async_op=True),
        lambda: check(a2a, 10 * torch.arange(n) + r, "async all_to_all"))
    add(commlib.barrier(async_op=True), lambda: None)
    empty = commlib.all_reduce(torch.zeros(0), async_op=True)
    assert empty.is_completed() and empty.wait() is True
    for w in reversed(works):
        assert w.wait() is True
        assert w.is_completed()
        assert w.wait(timeout=1) is True  # waiting again is a no-op
    for fn in checks:
        fn()
    # is_completed() alone drives an operation to completion (no wait())
    t = xs[r].clone()
    w = commlib.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 30
    while not w.is_completed():
        assert time.monotonic() < deadline, "is_completed() never became True"
    check(t, reference(xs, SUM), "polled all_reduce")
    t = xs[r].clone()
    commlib.all_reduce(t, async_op=True).wait(timeout=datetime.timedelta(seconds=30))
    check(t, reference(xs, SUM), "wait(timedelta)")


# ----- point-to-point ----------------------------------------------------------------------
def case_point_to_point():
    r, n = world()
    if n == 1:  # messages to oneself: only the non-blocking calls
        for dtype in DTYPES:
            x, got = make(0, 50, dtype, salt=16), torch.zeros(50, dtype=dtype)
            recv = commlib.irecv(got, src=0, tag=3)
            send = commlib.isend(x, dst=0, tag=3)
            assert recv.result() == 0 and send.wait()
            check(got, x, "self message", dtype)
        return
    right, left = (r + 1) % n, (r - 1) % n
    for dtype in DTYPES:  # ring of isend/irecv, every dtype, empty to a few thousand
        for count in (0, 1, 3000):
            got = torch.zeros(count, dtype=dtype)
            recv = commlib.irecv(got, src=left)
            send = commlib.isend(make(r, count, dtype, salt=17), dst=right)
            assert recv.result() == left and send.wait() is True and recv.is_completed()
            check(got, make(left, count, dtype, salt=17), "isend/irecv", dtype, count)
    # blocking send/recv with a specific source: every rank to rank 0 and back
    if r == 0:
        for src in range(1, n):
            got = torch.zeros(4, dtype=torch.bfloat16)
            assert commlib.recv(got, src=src) == src
            check(got, make(src, 4, torch.bfloat16, salt=18), "recv", src)
            commlib.send(torch.full((2,), src * 10, dtype=torch.int64), dst=src)
    else:
        commlib.send(make(r, 4, torch.bfloat16, salt=18), dst=0)
        got = torch.zeros(2, dtype=torch.int64)
        assert commlib.recv(got, src=0) == 0
        check(got, torch.full((2,), r * 10), "reply")
    # any source: recv returns the sender's world rank; tags pick messages out of order
    if r == 0:
        senders = []
        for _ in range(n - 1):
            x = torch.zeros(3, dtype=torch.int64)
            src = commlib.recv(x, tag=9)
            check(x, torch.full((3,), src), "any-source recv", src)
            senders.append(src)
        assert sorted(senders) == list(range(1, n)), senders
        for src in range(1, n):
            a, b = torch.zeros(2), torch.zeros(2)
            assert commlib.recv(b, src=src, tag=2) == src  # sent second, received first
            assert commlib.recv(a, src=src, tag=1) == src
            check(a, torch.full((2,), 1.0 + src), "tag 1")
            check(b, torch.full((2,), 2.0 + src), "tag 2")
        x = np.zeros(5, dtype=np.float16)  # a NumPy buffer, any source, async
        w = commlib.irecv(x, tag=4)
        assert w.result() == n - 1 and (x == 0.5).all(), x
        base = torch.zeros(3, 4)
        assert commlib.recv(base[:, 1], src=1, tag=5) == 1  # a strided buffer
        check(base[:, 1], torch.arange(3.0), "strided recv")
        assert not base[:, [0, 2, 3]].any()
    else:
        commlib.send(torch.full((3,), r, dtype=torch.int64), dst=0, tag=9)
        w1 = commlib.isend(torch.full((2,), 1.0 + r), dst=0, tag=1)
        w2 = commlib.isend(torch.full((2,), 2.0 + r), dst=0, tag=2)
        w1.wait()
        w2.wait()
        if r == n - 1:
            commlib.send(np.full(5, 0.5, dtype=np.float16), dst=0, tag=4)
        if r == 1:
            commlib.send(torch.arange(6.0).view(3, 2)[:, 0] / 2, dst=0, tag=5)  # strided send
    # the user's messages never match a collective's traffic, even posted around one
    got = torch.zeros(6)
    recv = commlib.irecv(got, src=left)
    t = torch.ones(6)
    commlib.all_reduce(t)
    send = commlib.isend(torch.full((6,), float(r)), dst=right)
    recv.wait()
    send.wait()
    check(got, torch.full((6,), float(left)), "user message around a collective")
    check(t, torch.full((6,), float(n)), "collective around user messages")


def case_batch_isend_irecv():
    r, n = world()
    right, left = (r + 1) % n, (r - 1) % n
    from_left = torch.zeros(5, dtype=torch.int32)
    from_right = torch.zeros(3, dtype=torch.bfloat16)
    ops = [commlib.P2POp(commlib.irecv, from_left, left, tag=1),
           commlib.P2POp(commlib.irecv, from_right, group_peer=right, tag=2),
           commlib.P2POp(commlib.isend, torch.full((5,), r, dtype=torch.int32), right, tag=1),
           commlib.P2POp(torch.distributed.isend, torch.full((3,), r + 0.5, dtype=torch.bfloat16),
                         left, tag=2)]
    works = commlib.batch_isend_irecv(ops)
    assert len(works) == 4 and all(isinstance(w, commlib.Work) for w in works)
    for w in reversed(works):
        w.wait()
    assert works[0].result() == left and works[1].result() == right
    check(from_left, torch.full((5,), left, dtype=torch.int32), "batch from left")
    check(from_right, torch.full((3,), right + 0.5, dtype=torch.bfloat16), "batch from right")


def case_barrier():
    r, n = world()
    assert commlib.barrier() is None
    if n == 1:
        return
    if r == 0:
        time.sleep(0.4)
    start = time.monotonic()
    commlib.barrier()
    if r != 0:
        assert time.monotonic() - start > 0.3, "barrier returned before rank 0 entered it"
    w = commlib.barrier(async_op=True)
    assert w.wait() is True


# ----- groups and meshes -------------------------------------------------------------------
def case_new_group_subset():
    r, n = world()
    members = list(range(n - 1, -1, -2))  # every other rank, in reverse order
    g = commlib.new_group(members)
    assert g.size == len(members) and list(g.ranks) == members
    assert commlib.get_world_size(g) == len(members)
    if r not in members:
        assert g.rank == -1 and commlib.get_rank(g) == -1
        calls = [lambda: commlib.all_reduce(torch.ones(1), group=g),
                 lambda: commlib.broadcast(torch.ones(1), group=g),
                 lambda: commlib.all_gather_into_tensor(torch.ones(len(members)), torch.ones(1), group=g),
                 lambda: commlib.barrier(group=g),
                 lambda: commlib.send(torch.ones(1), group=g, group_dst=0)]
        for call in calls:
            try:
                call()
            except commlib.CommStateError as exc:
                text = str(exc)
                assert f"world rank {r}) is not a member of group {g.name!r}" in text, text
                assert str(members) in text and "Fix:" in text, text
            else:
                raise AssertionError("a non-member's collective did not raise")
    else:
        me = members.index(r)
        assert g.rank == me and commlib.get_rank(g) == me
        t = torch.tensor([float(r)])
        commlib.all_reduce(t, group=g)
        check(t, torch.tensor([float(sum(members))]), "group all_reduce")
        t = torch.tensor([float(r)])
        commlib.broadcast(t, src=members[-1], group=g)  # src is a world rank
        check(t, torch.tensor([float(members[-1])]), "group broadcast src")
        t = torch.tensor([float(r)])
        commlib.broadcast(t, group=g, group_src=0)  # group rank 0 is world rank n - 1
        check(t, torch.tensor([float(n - 1)]), "group broadcast group_src")
        t = torch.tensor([r + 1])
        commlib.reduce(t, dst=members[-1], group=g, op=PRODUCT)
        want = int(np.prod([m + 1 for m in members])) if r == members[-1] else r + 1
        check(t, torch.tensor([want]), "group reduce dst")
        t = torch.tensor([r + 1])
        commlib.reduce(t, group=g, group_dst=0)
        check(t, torch.tensor([sum(m + 1 for m in members) if me == 0 else r + 1]), "group_dst")
        out = torch.zeros(len(members), dtype=torch.int64)
        commlib.all_gather_into_tensor(out, torch.tensor([r]), group=g)
        check(out, torch.tensor(members), "group all_gather is in group order")
        if len(members) > 1:  # point-to-point by group rank; recv returns the world rank
            peer = (me + 1) % len(members)
            got = torch.zeros(2)
            w = commlib.irecv(got, group=g, group_src=(me - 1) % len(members))
            commlib.isend(torch.full((2,), float(r)), group=g, group_dst=peer).wait()
            assert w.result() == members[(me - 1) % len(members)]
            check(got, torch.full((2,), float(members[(me - 1) % len(members)])), "group p2p")
    commlib.barrier()
    everyone = commlib.new_group()
    t = torch.ones(2)
    commlib.all_reduce(t, group=everyone)
    check(t, torch.full((2,), float(n)), "new_group() of all ranks")


def _mesh_checks(mesh, want_groups, names):
    r, n = world()
    for d, name in enumerate(names):
        sub = mesh.group(name)
        assert sub is mesh.group(d) and sub is mesh[name], name
        assert list(sub.ranks) == want_groups[d], (r, name, sub.ranks, want_groups[d])
        assert sub.rank == want_groups[d].index(r) and mesh.coordinate(name) == sub.rank
        t = torch.tensor([float(r)])
        commlib.all_reduce(t, group=sub)
        check(t, torch.tensor([float(sum(want_groups[d]))]), "mesh all_reduce", name)
        out = torch.zeros(len(want_groups[d]), dtype=torch.int64)
        commlib.all_gather_into_tensor(out, torch.tensor([r]), group=sub)
        check(out, torch.tensor(want_groups[d]), "mesh all_gather", name)


def case_mesh():
    r, n = world()
    mesh = commlib.Mesh((n,), ("x",))
    assert mesh.coords == (r,) and mesh.size() == n and mesh.size("x") == n
    _mesh_checks(mesh, [list(range(n))], ("x",))
    mesh = commlib.Mesh((1, n))  # a dimension of size one
    _mesh_checks(mesh, [[r], list(range(n))], ("dim0", "dim1"))
    if n == 4:
        mesh = commlib.Mesh((2, 2), ("dp", "tp"))
        # Row-major: rank = 2 * dp coordinate + tp coordinate, written out per rank.
        coords = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}[r]
        dp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}[r]
        tp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}[r]
        assert mesh.coords == coords and mesh.rank_at(coords) == r
        assert mesh.rank_at((1, 0)) == 2 and mesh.size("tp") == 2 and mesh.ndim == 2
        _mesh_checks(mesh, [dp, tp], ("dp", "tp"))
        assert mesh.group(-1) is mesh.group("tp")
        # both dimensions in one step: a 2-D reduction is dp then tp
        t = torch.tensor([float(r + 1)])
        commlib.all_reduce(t, group=mesh.group("dp"))
        commlib.all_reduce(t, group=mesh.group("tp"))
        check(t, torch.tensor([10.0]), "dp then tp")


# ----- the latency path: repeated calls on the same tensor ------------------------------------
def case_repeated_calls():
    r, n = world()
    t = torch.ones(4)
    for k in range(1, 4):
        commlib.all_reduce(t)
        check(t, torch.full((4,), float(n ** k)), "repeated all_reduce", k)
    t.fill_(float(r))
    commlib.all_reduce(t, op=MAX)
    check(t, torch.full((4,), float(n - 1)), "repeated with another op")
    t.set_(torch.full((7,), float(r + 1)))  # same tensor object, new memory and size
    commlib.all_reduce(t)
    check(t, torch.full((7,), n * (n + 1) / 2), "repeated after set_")
    u = torch.zeros(4, 2)[:, 0]
    for _ in range(2):
        u.fill_(1.0)
        commlib.all_reduce(u)
        check(u, torch.full((4,), float(n)), "repeated strided")


def case_repeated_reduce_scatter_and_all_gather():
    """The same (output, input) pair again and again (the planned path where the algorithm has
    one), then changed memory, size, op and dtype on the same objects, and in-place all-gather."""
    r, n = world()
    out, inp = torch.empty(3), torch.empty(3 * n)
    for k in range(3):
        inp.copy_(torch.arange(3 * n, dtype=torch.float32) + r + k)
        commlib.reduce_scatter_tensor(out, inp)
        want = n * (torch.arange(3 * r, 3 * r + 3, dtype=torch.float32) + k) + n * (n - 1) / 2
        check(out, want, "repeated reduce_scatter_tensor", k)
    commlib.reduce_scatter_tensor(out, inp, op=MAX)
    check(out, torch.arange(3 * r, 3 * r + 3, dtype=torch.float32) + 2 + n - 1, "then MAX")
    inp.set_(torch.ones(5 * n))
    out.set_(torch.empty(5))  # same objects, new memory and size
    commlib.reduce_scatter_tensor(out, inp)
    check(out, torch.full((5,), float(n)), "reduce_scatter_tensor after set_")
    half_out, half_in = torch.empty(2, dtype=torch.bfloat16), torch.full((2 * n,), 1.5,
                                                                         dtype=torch.bfloat16)
    for k in range(2):
        commlib.reduce_scatter_tensor(half_out, half_in)
        check(half_out, torch.full((2,), 1.5 * n, dtype=torch.bfloat16), "bfloat16", k)
    gout, gin = torch.empty(n, 4), torch.empty(4)
    for k in range(3):
        gin.fill_(float(10 * r + k))
        commlib.all_gather_into_tensor(gout, gin)
        check(gout, (10 * torch.arange(n, dtype=torch.float32) + k).unsqueeze(1).expand(n, 4),
              "repeated all_gather_into_tensor", k)
    for k in range(2):  # in place: the input is this rank's row of the output
        gout.zero_()
        gout[r].fill_(float(r + k))
        commlib.all_gather_into_tensor(gout, gout[r])
        check(gout, (torch.arange(n, dtype=torch.float32) + k).unsqueeze(1).expand(n, 4),
              "repeated in-place all_gather_into_tensor", k)


# ----- init and finalize -------------------------------------------------------------------
def case_init_and_finalize():
    r, n = world()
    w = commlib.get_world_group()
    expect = os.environ["EXPECT_BACKEND"]
    assert w.backend.name == expect, (w.backend.name, expect)
    if expect == "mpi":
        from mpi4py import MPI

        assert n == MPI.COMM_WORLD.Get_size() and r == MPI.COMM_WORLD.Get_rank()
    else:
        assert n == 1 and r == 0
    assert commlib.init() is w and commlib.is_initialized()
    other = "self" if expect == "mpi" else "mpi"
    try:
        commlib.init(backend=other)
    except commlib.CommStateError as exc:
        assert f"already initialized with backend {expect!r}" in str(exc) and "finalize" in str(exc)
    else:
        raise AssertionError("init with another backend did not raise")
    g = commlib.new_group()
    commlib.finalize()
    assert not commlib.is_initialized()
    commlib.finalize()  # twice is harmless
    for group in (w, g):  # groups of the old world raise instead of reaching freed engines
        try:
            commlib.all_reduce(torch.ones(1), group=group)
        except commlib.CommStateError as exc:
            assert "finalize" in str(exc) and "Fix:" in str(exc), exc
        else:
            raise AssertionError("a finalized group ran a collective")
    w2 = commlib.init()
    assert w2 is not w and w2.size == n and w2.rank == r and w2.backend.name == expect
    t = torch.full((5,), float(r + 1))
    commlib.all_reduce(t)
    check(t, torch.full((5,), n * (n + 1) / 2), "all_reduce after finalize and init")


if __name__ == "__main__":
    main(globals(), errors)
