"""Multi-rank cases for the torch backend, run by tests/test_torch_backend.py on every rank of a
torchrun-like job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; gloo on CPU).

``python cases.py case_a case_b`` runs those cases; with ``TORCH_CASES_PREINIT=1`` the script
calls ``torch.distributed.init_process_group`` itself before ``commlib.init()``.

Every expected value is computed here from every rank's input, which each rank regenerates from
the same seeds: nothing is taken from the library under test.
"""

from __future__ import annotations

import atexit
import functools
import os
import pathlib
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import commlib
from commlib import ReduceOp

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]
FLOATING = (torch.float32, torch.float64, torch.bfloat16)


def world():
    return commlib.get_rank(), commlib.get_world_size()


def data(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers (1..3; 0/1 for bool), exact in every dtype, so that
    sums and products of up to 4 ranks are exact too."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype is torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    return torch.randint(1, 4, (numel,), generator=g).to(dtype)


def expected_reduce(tensors, op: ReduceOp, dtype: torch.dtype) -> torch.Tensor:
    """Reference reduction in int64/float64, with bool's meaning of each op (SUM/MAX = or,
    PRODUCT/MIN = and)."""
    xs = [t.to(torch.float64 if dtype in FLOATING else torch.int64) for t in tensors]
    fn = {
        ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
        ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
        ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
        ReduceOp.BXOR: torch.bitwise_xor,
    }[op]
    acc = functools.reduce(fn, xs)
    if op is ReduceOp.AVG:
        acc = acc / len(xs)
    if dtype is torch.bool:
        return acc != 0
    return acc.to(dtype)


def ops_for(dtype):
    if dtype in FLOATING:
        return [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    return [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
            ReduceOp.BOR, ReduceOp.BXOR]


def check(actual, expected, what):
    if actual.dtype is torch.bfloat16 or expected.dtype is torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-2, atol=0,
                                   msg=lambda m: f"{what}: {m}")
    elif actual.is_floating_point():
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


# ----- init --------------------------------------------------------------------------------
def case_init_picks_torch():
    rank, n = world()
    g = commlib.get_world_group()
    assert g.backend.name == "torch", g
    assert dist.is_initialized() and dist.get_rank() == rank and dist.get_world_size() == n
    assert rank == int(os.environ["RANK"]) and n == int(os.environ["WORLD_SIZE"])
    assert g.ranks == tuple(range(n))
    assert g.backend.kind == "gloo" and g.backend.devices == frozenset({"cpu"})
    # half precision is not native on gloo: the API layer accumulates it in float32
    assert torch.bfloat16 not in g.backend.native_reduce_dtypes
    assert commlib.init() is g  # idempotent


# ----- reductions --------------------------------------------------------------------------
def case_all_reduce():
    rank, n = world()
    numel = 7
    for dtype in DTYPES:
        for i, op in enumerate(ops_for(dtype)):
            exp = expected_reduce([data(r, numel, dtype, i) for r in range(n)], op, dtype)
            t = data(rank, numel, dtype, i)
            commlib.all_reduce(t, op=op)
            check(t, exp, f"all_reduce {op} {dtype}")
            t = data(rank, numel, dtype, i)
            work = commlib.all_reduce(t, op=op, async_op=True)
            work.wait()
            assert work.is_completed()
            check(t, exp, f"all_reduce async {op} {dtype}")
    # torch.distributed's op objects are accepted too; a non-contiguous tensor is written back
    base = torch.zeros(4, 3)
    view = base[:, 1]
    view.copy_(torch.arange(4.0) + rank)
    commlib.all_reduce(view, op=dist.ReduceOp.MAX)
    assert torch.equal(base[:, 1], torch.arange(4.0) + n - 1)
    assert torch.equal(base[:, 0], torch.zeros(4)) and torch.equal(base[:, 2], torch.zeros(4))
    # NumPy arrays in place
    a = np.full(3, rank + 1, dtype=np.int64)
    commlib.all_reduce(a)
    assert (a == n * (n + 1) // 2).all(), a


def case_reduce():
    rank, n = world()
    for dtype in DTYPES:
        for root in range(n):
            for op in ops_for(dtype)[:4]:
                salt = 10 * root + 3
                exp = expected_reduce([data(r, 5, dtype, salt) for r in range(n)], op, dtype)
                t = data(rank, 5, dtype, salt)
                commlib.reduce(t, dst=root, op=op)
                if rank == root:
                    check(t, exp, f"reduce {op} {dtype} root {root}")
                else:  # gloo scribbles on non-root buffers: the backend must not let it show
                    assert torch.equal(t, data(rank, 5, dtype, salt)), f"non-root changed {t}"


def case_reduce_scatter_tensor():
    rank, n = world()
    m = 3
    for dtype in DTYPES:
        for i, op in enumerate(ops_for(dtype)):
            full = expected_reduce([data(r, n * m, dtype, i) for r in range(n)], op, dtype)
            out = torch.empty(m, dtype=dtype)
            commlib.reduce_scatter_tensor(out, data(rank, n * m, dtype, i), op=op)
            check(out, full[rank * m:(rank + 1) * m], f"reduce_scatter {op} {dtype}")
    # 2-d shapes: input (n*2, 3), output (2, 3)
    inp = torch.arange(n * 6, dtype=torch.float64).view(n * 2, 3) * (rank + 1)
    out = torch.empty(2, 3, dtype=torch.float64)
    work = commlib.reduce_scatter_tensor(out, inp, async_op=True)
    work.wait()
    total = torch.arange(n * 6, dtype=torch.float64).view(n * 2, 3) * (n * (n + 1) / 2)
    assert torch.equal(out, total[2 * rank:2 * rank + 2])


# ----- data movement -----------------------------------------------------------------------
def case_broadcast():
    rank, n = world()
    for dtype in DTYPES:
        for root in range(n):
            t = data(rank, 6, dtype, root)
            commlib.broadcast(t, src=root)
            assert torch.equal(t, data(root, 6, dtype, root)), (dtype, root, t)
    t = torch.full((2, 2), float(rank))
    commlib.broadcast(t, src=n - 1, async_op=True).wait()
    assert torch.equal(t, torch.full((2, 2), float(n - 1)))


def case_all_gather():
    rank, n = world()
    for dtype in DTYPES:
        outs = [torch.empty(2, 3, dtype=dtype) for _ in range(n)]
        commlib.all_gather(outs, data(rank, 6, dtype).view(2, 3))
        for r in range(n):
            assert torch.equal(outs[r], data(r, 6, dtype).view(2, 3)), (dtype, r)


def case_all_gather_into_tensor():
    rank, n = world()
    for dtype in DTYPES:
        out = torch.empty(n * 4, dtype=dtype)
        commlib.all_gather_into_tensor(out, data(rank, 4, dtype))
        assert torch.equal(out, torch.cat([data(r, 4, dtype) for r in range(n)])), dtype
    # in place: the input is this rank's slice of the output
    out = torch.zeros(n, 3)
    out[rank] = rank + 1.0
    commlib.all_gather_into_tensor(out, out[rank], async_op=True).wait()
    assert torch.equal(out, (torch.arange(n, dtype=torch.float32) + 1).unsqueeze(1).expand(n, 3))


def a2a_splits(src: int, dst: int) -> int:
    """Rows rank ``src`` sends to rank ``dst``: uneven, some zero."""
    return (src * 2 + dst * 3 + 1) % 4


def case_all_to_all_single_uneven():
    rank, n = world()
    for dtype in DTYPES:
        in_splits = [a2a_splits(rank, d) for d in range(n)]
        out_splits = [a2a_splits(s, rank) for s in range(n)]
        # block sent from s to d: rows of 2 columns, values encoding (s, d, row)
        def block(s, d, dtype=dtype):
            rows = a2a_splits(s, d)
            v = torch.arange(rows * 2).view(rows, 2) + 100 * s + 10 * d
            return (v % 2).bool() if dtype is torch.bool else v.to(dtype)
        inp = torch.cat([block(rank, d) for d in range(n)])
        out = torch.empty(sum(out_splits), 2, dtype=dtype)
        commlib.all_to_all_single(out, inp, out_splits, in_splits)
        assert torch.equal(out, torch.cat([block(s, rank) for s in range(n)])), dtype
    # even split with no sizes given, async
    inp = torch.arange(n * 2, dtype=torch.int64) + 100 * rank
    out = torch.empty(n * 2, dtype=torch.int64)
    commlib.all_to_all_single(out, inp, async_op=True).wait()
    exp = torch.cat([torch.arange(2 * rank, 2 * rank + 2) + 100 * s for s in range(n)])
    assert torch.equal(out, exp), out


def case_barrier():
    commlib.barrier()
    work = commlib.barrier(async_op=True)
    work.wait()
    assert work.is_completed()


def case_late_peer_waits_without_spinning():
    """The last rank enters 1 s late: the others wait for gloo's collective blocked in its
    Work, not spinning on is_completed() (which took the core from gloo's workers: steps of
    3-28 s at 3 ranks on 2 cores). Their main thread's CPU time over the wait is the measure."""
    import time
    rank, n = world()
    late = 1.0
    for async_op in (False, True):
        t = torch.full((1 << 16,), float(rank + 1))
        if rank == n - 1:
            time.sleep(late)
        wall, cpu = time.monotonic(), time.thread_time()
        work = commlib.all_reduce(t, async_op=async_op)
        if async_op:
            work.wait()
        wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
        assert torch.equal(t, torch.full_like(t, n * (n + 1) / 2)), async_op
        if rank != n - 1:
            assert wall >= 0.8 * late and cpu < 0.25 * wall, (async_op, wall, cpu)


# ----- point-to-point ----------------------------------------------------------------------
def case_send_recv_ring():
    rank, n = world()
    if n == 1:
        return
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for dtype in DTYPES:
        got = torch.empty(5, dtype=dtype)
        if rank % 2 == 0:
            commlib.send(data(rank, 5, dtype), dst=nxt)
            src = commlib.recv(got, src=prv)
        else:
            src = commlib.recv(got, src=prv)
            commlib.send(data(rank, 5, dtype), dst=nxt)
        assert src == prv
        assert torch.equal(got, data(prv, 5, dtype)), dtype


def case_isend_irecv():
    rank, n = world()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    got = torch.empty(4)
    r = commlib.irecv(got, src=prv, tag=7)
    s = commlib.isend(torch.full((4,), float(rank)), dst=nxt, tag=7)
    s.wait()
    assert r.result() == prv
    assert torch.equal(got, torch.full((4,), float(prv)))
    # any-source receive: rank 0 hears from every other rank, learning who sent each message
    if rank == 0:
        senders = set()
        for _ in range(n - 1):
            buf = torch.empty(2, dtype=torch.int64)
            src = commlib.irecv(buf, tag=9).result()
            assert torch.equal(buf, torch.full((2,), src)), (src, buf)
            senders.add(src)
        assert senders == set(range(1, n)), senders
    else:
        commlib.isend(torch.full((2,), rank, dtype=torch.int64), dst=0, tag=9).wait()
    # a message to oneself (gloo has no self pair: the backend matches it locally)
    mine = torch.empty(3)
    r = commlib.irecv(mine, src=rank, tag=3)
    commlib.isend(torch.arange(3.0), dst=rank, tag=3).wait()
    assert r.result() == rank and torch.equal(mine, torch.arange(3.0))
    # tags keep messages apart: send tag 2 then tag 1, receive tag 1 first
    if n > 1:
        a, b = torch.empty(1), torch.empty(1)
        if rank == 0:
            w2 = commlib.isend(torch.tensor([2.0]), dst=1, tag=2)
            w1 = commlib.isend(torch.tensor([1.0]), dst=1, tag=1)
            w1.wait()
            w2.wait()
        elif rank == 1:
            commlib.recv(a, src=0, tag=1)
            commlib.recv(b, src=0, tag=2)
            assert a.item() == 1.0 and b.item() == 2.0


def case_batch_isend_irecv():
    rank, n = world()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    right, left = torch.empty(3, dtype=torch.float64), torch.empty(3, dtype=torch.float64)
    ops = [
        commlib.P2POp(commlib.isend, torch.full((3,), rank + 0.5, dtype=torch.float64), nxt),
        commlib.P2POp(commlib.isend, torch.full((3,), rank + 0.25, dtype=torch.float64), prv,
                      tag=1),
        commlib.P2POp(commlib.irecv, left, prv),
        commlib.P2POp(commlib.irecv, right, nxt, tag=1),
    ]
    for w in commlib.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(left, torch.full((3,), prv + 0.5, dtype=torch.float64))
    assert torch.equal(right, torch.full((3,), nxt + 0.25, dtype=torch.float64))


def case_interop_with_torch_distributed():
    """The world's user channel is the default process group: commlib.send meets dist.recv."""
    rank, n = world()
    if n == 1:
        return
    if rank == 0:
        commlib.send(torch.arange(4.0), dst=1, tag=5)
    elif rank == 1:
        t = torch.empty(4)
        dist.recv(t, src=0, tag=5)
        assert torch.equal(t, torch.arange(4.0))
    # and collectives of both libraries interleave on the same ranks
    t = torch.ones(2)
    dist.all_reduce(t)
    commlib.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(n * n)))


# ----- groups ------------------------------------------------------------------------------
def case_new_group():
    rank, n = world()
    rev = list(reversed(range(n)))
    g = commlib.new_group(rev)  # ranks in the order given: group rank 0 is world rank n-1
    assert g.ranks == tuple(rev) and g.rank == n - 1 - rank
    assert g.backend.global_ranks() == rev
    t = torch.full((3,), float(rank))
    commlib.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((3,), float(sum(range(n)))))
    t = torch.empty(n)
    commlib.all_gather_into_tensor(t, torch.tensor([float(rank)]), group=g)
    assert torch.equal(t, torch.tensor([float(r) for r in rev])), t
    t = torch.full((2,), float(rank))
    commlib.broadcast(t, group=g, group_src=0)
    assert torch.equal(t, torch.full((2,), float(n - 1)))
    # p2p inside the group, by group rank
    if n > 1:
        buf = torch.empty(1)
        gr = g.rank
        w = commlib.irecv(buf, group=g, group_src=(gr - 1) % n)
        commlib.isend(torch.tensor([float(rank)]), group=g, group_dst=(gr + 1) % n).wait()
        assert w.result() == rev[(gr - 1) % n] and buf.item() == rev[(gr - 1) % n]
    # a group without some ranks: they get a non-member group and collectives raise
    evens = list(range(0, n, 2))
    e = commlib.new_group(evens)
    if rank in evens:
        t = torch.tensor([rank], dtype=torch.int64)
        commlib.all_reduce(t, group=e)
        assert t.item() == sum(evens)
    else:
        assert e.rank == -1 and not e.is_member
        try:
            commlib.all_reduce(torch.ones(1), group=e)
        except commlib.CommStateError as exc:
            assert "not a member" in str(exc)
        else:
            raise AssertionError("all_reduce on a non-member group did not raise")
    # a subgroup of a subgroup, created by its members only (torch.distributed.new_group would
    # need every rank of the job)
    if n >= 3:
        tail = commlib.new_group(list(range(1, n)))
        if rank >= 1:
            mesh = commlib.Mesh((n - 1,), ("x",), group=tail)
            t = torch.tensor([float(rank)])
            commlib.all_reduce(t, group=mesh.group("x"))
            assert t.item() == sum(range(1, n))


def case_mesh():
    rank, n = world()
    shape = (2, n // 2) if n % 2 == 0 else (n, 1)
    mesh = commlib.Mesh(shape, ("dp", "tp"))
    i, j = rank // shape[1], rank % shape[1]
    assert mesh.coords == (i, j)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    assert tp.ranks == tuple(i * shape[1] + c for c in range(shape[1]))
    assert dp.ranks == tuple(r * shape[1] + j for r in range(shape[0]))
    t = torch.tensor([float(rank)])
    commlib.all_reduce(t, group=tp)
    assert t.item() == sum(tp.ranks)
    t = torch.tensor([rank], dtype=torch.int64)
    commlib.all_reduce(t, op=ReduceOp.MAX, group=dp)
    assert t.item() == dp.ranks[-1]
    out = torch.empty(dp.size, dtype=torch.int64)
    commlib.all_gather_into_tensor(out, torch.tensor([rank]), group=dp)
    assert out.tolist() == list(dp.ranks)


# ----- engine gaps and the p2p algorithms ----------------------------------------------------
def case_emulated_reductions():
    """The all-gather + local reduction path the backend uses for reductions an engine lacks
    (bitwise ops on NCCL), forced on gloo so that it is tested on CPU."""
    rank, n = world()
    backend = commlib.get_world_group().backend
    saved = backend._lacks
    backend._lacks = frozenset(ReduceOp)
    try:
        for dtype in (torch.int64, torch.bool, torch.float32):
            for i, op in enumerate(ops_for(dtype)):
                exp = expected_reduce([data(r, 6, dtype, i) for r in range(n)], op, dtype)
                t = data(rank, 6, dtype, i)
                commlib.all_reduce(t, op=op)
                check(t, exp, f"emulated all_reduce {op} {dtype}")
                t = data(rank, 6, dtype, i)
                commlib.reduce(t, dst=n - 1, op=op, async_op=True).wait()
                check(t, exp if rank == n - 1 else data(rank, 6, dtype, i),
                      f"emulated reduce {op} {dtype}")
                full = expected_reduce([data(r, 2 * n, dtype, i) for r in range(n)], op, dtype)
                out = torch.empty(2, dtype=dtype)
                commlib.reduce_scatter_tensor(out, data(rank, 2 * n, dtype, i), op=op)
                check(out, full[2 * rank:2 * rank + 2], f"emulated reduce_scatter {op} {dtype}")
    finally:
        backend._lacks = saved


def _run_collective(coll, algo, dtype, salt):
    """Run ``coll`` with ``algorithm=algo`` and check it against a reference."""
    rank, n = world()
    numel = 2 * n + 3  # not a multiple of the group size
    if coll == "all_reduce":
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            t = data(rank, numel, dtype, salt)
            commlib.all_reduce(t, op=op, algorithm=algo)
            exp = expected_reduce([data(r, numel, dtype, salt) for r in range(n)], op, dtype)
            check(t, exp, f"{algo} all_reduce {op} {dtype}")
    elif coll == "broadcast":
        for root in range(n):
            t = data(rank, numel, dtype, salt + root)
            commlib.broadcast(t, src=root, algorithm=algo)
            assert torch.equal(t, data(root, numel, dtype, salt + root)), (algo, dtype, root)
    elif coll == "reduce":
        for root in range(n):
            t = data(rank, numel, dtype, salt)
            commlib.reduce(t, dst=root, algorithm=algo)
            exp = expected_reduce([data(r, numel, dtype, salt) for r in range(n)],
                                  ReduceOp.SUM, dtype)
            check(t, exp if rank == root else data(rank, numel, dtype, salt),
                  f"{algo} reduce {dtype} root {root}")
    elif coll == "all_gather":
        out = torch.empty(n * numel, dtype=dtype)
        commlib.all_gather_into_tensor(out, data(rank, numel, dtype, salt), algorithm=algo)
        assert torch.equal(out, torch.cat([data(r, numel, dtype, salt) for r in range(n)]))
    elif coll == "reduce_scatter":
        out = torch.empty(3, dtype=dtype)
        commlib.reduce_scatter_tensor(out, data(rank, 3 * n, dtype, salt), algorithm=algo)
        full = expected_reduce([data(r, 3 * n, dtype, salt) for r in range(n)], ReduceOp.SUM,
                               dtype)
        check(out, full[3 * rank:3 * rank + 3], f"{algo} reduce_scatter {dtype}")
    elif coll == "all_to_all":
        in_splits = [a2a_splits(rank, d) for d in range(n)]
        out_splits = [a2a_splits(s, rank) for s in range(n)]
        inp = torch.cat([torch.full((a2a_splits(rank, d),), 10 * rank + d) for d in range(n)])
        out = torch.empty(sum(out_splits), dtype=torch.int64)
        commlib.all_to_all_single(out, inp.long(), out_splits, in_splits, algorithm=algo)
        exp = torch.cat([torch.full((a2a_splits(s, rank),), 10 * s + rank) for s in range(n)])
        assert torch.equal(out, exp.long()), (algo, out)
    elif coll == "barrier":
        pass  # barrier takes no algorithm argument; the native one is covered by case_barrier


def _allpairs_all_reduce(ctx, buf):
    """A test-only all_reduce over the backend's internal channel: every rank sends its buffer to
    every other rank and reduces what arrives (in rank order, so every rank computes the same)."""
    from commlib.kernels import reduce_

    flat = buf.view(-1)
    parts = [torch.empty_like(flat) for _ in range(ctx.size)]
    parts[ctx.rank] = flat.clone()
    handles = []
    for peer in range(ctx.size):
        if peer != ctx.rank:
            handles.append(ctx.irecv(parts[peer], peer))
            handles.append(ctx.isend(parts[ctx.rank], peer))
    yield handles
    flat.copy_(parts[0])
    for part in parts[1:]:
        reduce_(flat, part, ctx.op)


def case_internal_channel():
    """Algorithm steps (user=False) never match the user's messages, even with the same tag: a
    user receive posted with the next collective's algorithm tag must get the user's message."""
    from commlib.algorithms import register_algorithm

    register_algorithm("torchtest_allpairs", "all_reduce")(_allpairs_all_reduce)
    rank, n = world()
    g = commlib.get_world_group()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    tag = (g.seq + 1) % (1 << 14)  # the tag the next collective's steps use
    user_buf = torch.empty(3)
    pending = commlib.irecv(user_buf, src=prv, tag=tag)
    for dtype in (torch.float32, torch.int64, torch.bool):
        for op in ops_for(dtype)[:4]:
            t = data(rank, 9, dtype, 5)
            commlib.all_reduce(t, op=op, algorithm="torchtest_allpairs")
            exp = expected_reduce([data(r, 9, dtype, 5) for r in range(n)], op, dtype)
            check(t, exp, f"allpairs {op} {dtype}")
    commlib.isend(torch.full((3,), 100.0 + rank), dst=nxt, tag=tag).wait()
    assert pending.result() == prv
    assert torch.equal(user_buf, torch.full((3,), 100.0 + prv)), user_buf


def case_p2p_algorithms():
    """Every registered algorithm of every collective over the torch backend's point-to-point
    (commlib's internal channel)."""
    from commlib.algorithms import COLLECTIVES, algorithm_names

    ran = []
    for coll in COLLECTIVES:
        for algo in algorithm_names(coll):
            for k, dtype in enumerate((torch.float32, torch.int64, torch.bfloat16)):
                _run_collective(coll, algo, dtype, salt=k)
            ran.append(f"{coll}:{algo}")
    if commlib.get_rank() == 0:
        print("algorithms: " + " ".join(ran), flush=True)


def case_p2p_stress():
    """The torch engine's point-to-point, many times in one job (issue 22's flaky hang: a
    blocking collective on gloo once ran past the 60 s timeout at 4 ranks on 2 cores): the
    internal-channel case and one point-to-point algorithm of one collective per round,
    ``TORCH_CASES_STRESS_ROUNDS`` rounds (default 200)."""
    from commlib.algorithms import COLLECTIVES, algorithm_names

    p2p = [(coll, algo) for coll in COLLECTIVES if coll != "barrier"
           for algo in algorithm_names(coll)
           if algo != "native" and not algo.startswith(("shm", "cuda_ipc"))]
    rounds = int(os.environ.get("TORCH_CASES_STRESS_ROUNDS", "200"))
    for i in range(rounds):
        case_internal_channel()
        coll, algo = p2p[i % len(p2p)]
        _run_collective(coll, algo, torch.float32, salt=i)
    if commlib.get_rank() == 0:
        print(f"stress: {rounds} rounds over {len(p2p)} algorithms", flush=True)


def case_exit_with_pending_recv():
    """Rank 1 leaves a receive from rank 0 posted, never sent, and polled once (so a waiter
    thread blocks in gloo's wait for it), then the job ends. Rank 0 exits at once, or
    ``TORCH_CASES_PEER_DELAY`` seconds later: at once, its exit ends that wait while rank 1 shuts
    down, and a waiter still inside torch then aborted rank 1 (PyTorch issue 38228)."""
    rank, _ = world()
    if rank == 1:
        handle = commlib.irecv(torch.zeros(4), src=0, tag=77)
        assert not handle.is_completed()
    elif rank == 0:
        # before commlib's own exit handler (they run last-registered first)
        atexit.register(time.sleep, float(os.environ.get("TORCH_CASES_PEER_DELAY", "0")))


if __name__ == "__main__":
    if os.environ.get("TORCH_CASES_PREINIT") == "1":
        dist.init_process_group("gloo", init_method="env://")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "mpi"))
    from _harness import main

    main(globals())
