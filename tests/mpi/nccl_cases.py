"""Cases for the nccl backend (CuPy's NCCL over MPI), run on GPU machines by
tests/test_nccl_backend.py under ``mpiexec -n 2`` with COMMLIB_BACKEND=nccl."""

import torch
from _harness import main

import commlib
from commlib import ReduceOp


def _dev():
    import cupy

    return torch.device("cuda", cupy.cuda.Device().id)


def case_backend_is_nccl():
    assert commlib.get_world_group().backend.name == "nccl"


def case_all_reduce_half_native():
    n, r = commlib.get_world_size(), commlib.get_rank()
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int64):
        t = torch.full((1000,), r + 1, dtype=dtype, device=_dev())
        commlib.all_reduce(t)
        assert torch.equal(t.cpu(), torch.full((1000,), n * (n + 1) // 2, dtype=dtype))
    t = torch.full((4,), float(r), device=_dev())
    commlib.all_reduce(t, op=ReduceOp.MAX)
    assert torch.equal(t.cpu(), torch.full((4,), float(n - 1)))


def case_bitwise_is_unsupported():
    t = torch.ones(4, dtype=torch.int64, device=_dev())
    try:
        commlib.all_reduce(t, op=ReduceOp.BAND)
    except commlib.CommUnsupportedError as exc:
        assert "algorithm='ring'" in str(exc)
    else:
        raise AssertionError("BAND on nccl did not raise")


def case_movement():
    n, r = commlib.get_world_size(), commlib.get_rank()
    t = torch.full((3,), float(r), device=_dev())
    commlib.broadcast(t, src=n - 1)
    assert torch.equal(t.cpu(), torch.full((3,), float(n - 1)))
    out = torch.empty(n * 2, dtype=torch.bool, device=_dev())
    commlib.all_gather_into_tensor(out, torch.tensor([True, r % 2 == 1], device=_dev()))
    assert out.cpu().tolist() == [v for k in range(n) for v in (True, k % 2 == 1)]
    rs = torch.empty(2, device=_dev())
    commlib.reduce_scatter_tensor(rs, torch.arange(2.0 * n, device=_dev()))
    assert torch.equal(rs.cpu(), torch.arange(2.0 * r, 2.0 * r + 2) * n)
    in_splits = [(r + d) % 3 for d in range(n)]
    out_splits = [(s + r) % 3 for s in range(n)]
    inp = torch.cat([torch.full(((r + d) % 3,), 10.0 * r + d) for d in range(n)]).to(_dev())
    out = torch.empty(sum(out_splits), device=_dev())
    commlib.all_to_all_single(out, inp, out_splits, in_splits)
    exp = torch.cat([torch.full(((s + r) % 3,), 10.0 * s + r) for s in range(n)])
    assert torch.equal(out.cpu(), exp)
    commlib.barrier()


def case_p2p_ring():
    n, r = commlib.get_world_size(), commlib.get_rank()
    got = torch.empty(5, device=_dev())
    w = commlib.irecv(got, src=(r - 1) % n)
    commlib.isend(torch.full((5,), float(r), device=_dev()), dst=(r + 1) % n).wait()
    w.wait()
    assert torch.equal(got.cpu(), torch.full((5,), float((r - 1) % n)))


def case_subgroup():
    n, r = commlib.get_world_size(), commlib.get_rank()
    g = commlib.new_group(list(reversed(range(n))))
    t = torch.full((2,), float(r), device=_dev())
    commlib.all_reduce(t, group=g)
    assert torch.equal(t.cpu(), torch.full((2,), float(sum(range(n)))))


if __name__ == "__main__":
    main(globals())
