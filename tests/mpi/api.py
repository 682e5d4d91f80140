"""The drop-in API on real ranks: every collective, inputs of every kind, groups and meshes.
Expected values are computed here from every rank's known input, never by commlib."""

import numpy as np
import torch
from _harness import main

import commlib
from commlib import ReduceOp

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]


def data(rank, count, dtype):
    g = torch.Generator().manual_seed(77 * rank + count)
    if dtype is torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    return torch.randint(0, 5, (count,), generator=g).to(dtype)


def case_collectives_every_dtype():
    r, n = commlib.get_rank(), commlib.get_world_size()
    for dtype in DTYPES:
        for count in (0, 1, n * 3 + 1, 2000):
            xs = [data(k, count, dtype) for k in range(n)]
            stacked = torch.stack(xs) if count else torch.empty(n, 0, dtype=dtype)
            # all_reduce SUM (bool: OR) and MAX
            t = xs[r].clone()
            commlib.all_reduce(t)
            want = stacked.any(0) if dtype is torch.bool else stacked.to(torch.float64).sum(0).to(dtype)
            assert torch.equal(t, want), (dtype, count, t, want)
            t = xs[r].clone()
            commlib.all_reduce(t, op=ReduceOp.MIN)
            want = stacked.all(0) if dtype is torch.bool else stacked.min(0).values
            assert torch.equal(t, want), ("min", dtype, count)
            # broadcast from the last rank, reduce to it
            t = xs[r].clone()
            commlib.broadcast(t, src=n - 1)
            assert torch.equal(t, xs[n - 1])
            # all_gather_into_tensor, all_gather (list)
            out = torch.empty(n * count, dtype=dtype)
            commlib.all_gather_into_tensor(out, xs[r])
            assert torch.equal(out, torch.cat(xs))
            outs = [torch.empty(count, dtype=dtype) for _ in range(n)]
            commlib.all_gather(outs, xs[r])
            assert all(torch.equal(o, x) for o, x in zip(outs, xs))
            if dtype is not torch.bool:
                big = [data(k + 10, n * count, dtype) for k in range(n)]
                out = torch.empty(count, dtype=dtype)
                commlib.reduce_scatter_tensor(out, big[r])
                want = torch.stack(big).to(torch.float64).sum(0).to(dtype)
                assert torch.equal(out, want[r * count:(r + 1) * count]), ("rs", dtype, count)
                t = xs[r].clone()
                commlib.reduce(t, dst=n - 1, op=ReduceOp.MAX)
                assert torch.equal(t, stacked.max(0).values if r == n - 1 else xs[r])


def case_avg_and_half_precision_accumulation():
    r, n = commlib.get_rank(), commlib.get_world_size()
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        t = torch.full((7,), float(r + 1), dtype=dtype)
        commlib.all_reduce(t, op="avg")
        assert torch.equal(t, torch.full((7,), (n + 1) / 2, dtype=dtype)), (dtype, t)
    # 256 + 1 + 1 + 1 in bfloat16 step by step stays 256 (each +1 rounds away); with float32
    # accumulation and one final rounding the sum is 256 + (n - 1) rounded once.
    value = 256.0 if r == 0 else 1.0
    t = torch.full((3,), value, dtype=torch.bfloat16)
    commlib.all_reduce(t)
    want = torch.tensor(256.0 + (n - 1), dtype=torch.float32).to(torch.bfloat16)
    assert torch.equal(t, torch.full((3,), float(want), dtype=torch.bfloat16)), t


def case_numpy_noncontiguous_and_views():
    r, n = commlib.get_rank(), commlib.get_world_size()
    a = np.full((4, 3), r + 1, dtype=np.int64)
    commlib.all_reduce(a)
    assert (a == n * (n + 1) // 2).all(), a
    strided = np.zeros((6, 4), dtype=np.float32)[:, 1]
    strided += r
    commlib.all_reduce(strided)
    assert (strided == n * (n - 1) / 2).all()
    base = torch.zeros(5, 4)
    col = base[:, 2]  # non-contiguous view: the result must land in `base`
    col.fill_(float(r + 1))
    commlib.all_reduce(col, op=ReduceOp.PRODUCT)
    assert torch.equal(base[:, 2], torch.full((5,), float(np.prod(range(1, n + 1)))))
    assert torch.equal(base[:, 0], torch.zeros(5)), "neighbouring memory changed"
    t = torch.arange(12.0).view(3, 4).t()  # transposed
    commlib.broadcast(t, src=0)
    assert torch.equal(t, torch.arange(12.0).view(3, 4).t())
    # in-place all-gather: the input is this rank's slice of the output
    out = torch.zeros(n, 3)
    out[r] = float(r)
    commlib.all_gather_into_tensor(out, out[r])
    assert torch.equal(out, torch.arange(n, dtype=torch.float32)[:, None].expand(n, 3))


def case_all_to_all_uneven():
    r, n = commlib.get_rank(), commlib.get_world_size()
    # rank i sends (i + j) % 3 rows to rank j (zeros included); rows are tagged by (src, dst).
    send = [(r + j) % 3 for j in range(n)]
    recv = [(i + r) % 3 for i in range(n)]
    inp = torch.cat([torch.full((send[j], 2), float(100 * r + j)) for j in range(n)])
    out = torch.full((sum(recv), 2), -1.0)
    commlib.all_to_all_single(out, inp, recv, send)
    want = torch.cat([torch.full((recv[i], 2), float(100 * i + r)) for i in range(n)])
    assert torch.equal(out, want), (out, want)
    even = torch.arange(n * 2, dtype=torch.int32) + 10 * r
    got = torch.empty_like(even)
    commlib.all_to_all_single(got, even)
    assert torch.equal(got, torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.int32) + 10 * i
                                       for i in range(n)]))


def case_async_in_reverse_order():
    r, n = commlib.get_rank(), commlib.get_world_size()
    tensors = [torch.full((100,), float(r + k)) for k in range(4)]
    works = [commlib.all_reduce(t, async_op=True, algorithm=alg)
             for t, alg in zip(tensors, ["native", "ring", "rabenseifner", "recursive_doubling"])]
    for w in reversed(works):
        assert w.wait() is True
        assert w.is_completed()
    for k, t in enumerate(tensors):
        assert torch.equal(t, torch.full((100,), float(n * (n - 1) / 2 + n * k))), (k, t)


def case_point_to_point():
    r, n = commlib.get_rank(), commlib.get_world_size()
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.empty(3)
    ops = [commlib.P2POp(commlib.isend, torch.full((3,), float(r)), right, tag=5),
           commlib.P2POp(commlib.irecv, got, left, tag=5)]
    for w in commlib.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got, torch.full((3,), float(left)))
    if r == 0:  # receive from any rank, in whatever order they arrive
        senders = set()
        for _ in range(n - 1):
            x = torch.empty(2, dtype=torch.int64)
            src = commlib.recv(x, tag=9)
            assert torch.equal(x, torch.full((2,), src)), (x, src)
            senders.add(src)
        assert senders == set(range(1, n))
    else:
        commlib.send(torch.full((2,), r, dtype=torch.int64), dst=0, tag=9)
    x = torch.empty(4)
    received = commlib.irecv(x, src=left)
    sent = commlib.isend(torch.full((4,), float(r)), dst=right)
    assert received.result() == left  # the sender's world rank
    sent.wait()
    assert torch.equal(x, torch.full((4,), float(left)))
    commlib.barrier()


def case_groups_and_meshes():
    r, n = commlib.get_rank(), commlib.get_world_size()
    members = list(range(n - 1, -1, -2))  # reversed, every other rank
    g = commlib.new_group(members)
    if r in members:
        assert g.rank == members.index(r) and g.size == len(members)
        t = torch.tensor([float(r)])
        commlib.all_reduce(t, group=g)
        assert float(t) == sum(members)
        t = torch.tensor([float(r)])
        commlib.broadcast(t, group=g, group_src=0)  # group rank 0 is world rank n - 1
        assert float(t) == n - 1
    else:
        assert g.rank == -1
        try:
            commlib.all_reduce(torch.ones(1), group=g)
        except commlib.CommStateError as exc:
            assert "not a member" in str(exc) and "Fix:" in str(exc)
        else:
            raise AssertionError("a non-member's collective did not raise")
    shape = (2, n // 2) if n % 2 == 0 and n > 2 else (n,)
    names = ("dp", "tp")[:len(shape)]
    mesh = commlib.Mesh(shape, names)
    for d, name in enumerate(names):
        sub = mesh.group(name)
        coords = mesh.coords
        want = [mesh.rank_at(coords[:d] + (i,) + coords[d + 1:]) for i in range(shape[d])]
        assert list(sub.ranks) == want, (name, sub.ranks, want)
        t = torch.tensor([float(r)])
        commlib.all_reduce(t, group=sub)
        assert float(t) == sum(want)


if __name__ == "__main__":
    main(globals())
