"""Multi-rank cases for commlib as a torch.distributed backend (``init_process_group("commlib")``),
run by tests/test_torch_pg.py on every rank of a torchrun-like job or under mpiexec.

Each case uses torch.distributed (and DDP, FSDP2, DTensor) exactly as code written for gloo does;
only the backend name differs. Expected values are computed here from every rank's input, which
each rank regenerates from the same seeds, or by the same computation on a gloo group or on one
process: nothing is taken from commlib.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

import commlib
import commlib.torch_backend

torch.set_num_threads(1)


def world():
    return dist.get_rank(), dist.get_world_size()


def data(rank: int, shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(1, 4, shape if isinstance(shape, tuple) else (shape,), generator=g).to(dtype)


def case_backend_is_commlib():
    r, n = world()
    assert dist.get_backend() == "commlib", dist.get_backend()
    assert commlib.is_initialized() and commlib.get_world_size() == n and commlib.get_rank() == r
    assert isinstance(dist.group.WORLD, commlib.torch_backend.ProcessGroupCommlib)


def case_collectives():
    """Every collective of torch.distributed on the backend, against its definition."""
    r, n = world()
    inputs = [data(k, 7) for k in range(n)]
    for op, ref in ((dist.ReduceOp.SUM, lambda xs: sum(xs)),
                    (dist.ReduceOp.MAX, lambda xs: torch.stack(xs).max(0).values),
                    (dist.ReduceOp.PRODUCT, lambda xs: torch.stack(xs).prod(0))):
        t = inputs[r].clone()
        dist.all_reduce(t, op=op)
        assert torch.equal(t, ref(inputs)), (op, t)
        t = inputs[r].clone()
        dist.reduce(t, dst=n - 1, op=op)
        assert torch.equal(t, ref(inputs) if r == n - 1 else inputs[r]), (op, t)
    for dtype in (torch.float64, torch.int64, torch.bfloat16):
        t = data(r, 5, dtype)
        dist.all_reduce(t)
        assert torch.equal(t, sum(data(k, 5, dtype).double() for k in range(n)).to(dtype)), dtype
    b = data(r, (3, 2))
    dist.broadcast(b, src=n - 1)
    assert torch.equal(b, data(n - 1, (3, 2)))
    outs = [torch.empty(4) for _ in range(n)]
    dist.all_gather(outs, data(r, 4))
    assert all(torch.equal(outs[k], data(k, 4)) for k in range(n))
    out = torch.empty(n * 4)
    dist.all_gather_into_tensor(out, data(r, 4))
    assert torch.equal(out, torch.cat([data(k, 4) for k in range(n)]))
    full = [data(k, n * 3) for k in range(n)]
    out = torch.empty(3)
    dist.reduce_scatter_tensor(out, full[r])
    assert torch.equal(out, sum(full)[3 * r:3 * r + 3])
    out = torch.empty(3)
    dist.reduce_scatter(out, list(full[r].split(3)))
    assert torch.equal(out, sum(full)[3 * r:3 * r + 3])
    # all_to_all_single, even and uneven: rank k sends (k + j + 1) elements to rank j
    inp = torch.arange(n * 2, dtype=torch.float32) + 100 * r
    out = torch.empty(n * 2)
    dist.all_to_all_single(out, inp)
    assert torch.equal(out, torch.cat([torch.arange(2 * r, 2 * r + 2) + 100 * k
                                       for k in range(n)]).float())
    send = [k + r + 1 for k in range(n)]
    recv = [r + k + 1 for k in range(n)]
    inp = torch.cat([torch.full((c,), float(10 * r + j)) for j, c in enumerate(send)])
    out = torch.empty(sum(recv))
    dist.all_to_all_single(out, inp, recv, send)
    assert torch.equal(out, torch.cat([torch.full((c,), float(10 * k + r))
                                       for k, c in enumerate(recv)]))
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), float(10 * r + j)) for j in range(n)])
    assert all(torch.equal(outs[k], torch.full((2,), float(10 * k + r))) for k in range(n))
    root = n // 2
    gathered = [torch.empty(3) for _ in range(n)] if r == root else None
    dist.gather(data(r, 3), gathered, dst=root)
    if r == root:
        assert all(torch.equal(gathered[k], data(k, 3)) for k in range(n))
    got = torch.empty(3)
    dist.scatter(got, [data(100 + k, 3) for k in range(n)] if r == root else None, src=root)
    assert torch.equal(got, data(100 + r, 3))
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "list": list(range(r))})
    assert objs == [{"rank": k, "list": list(range(k))} for k in range(n)]
    box = [("hello", r)] if r == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    assert box == [("hello", 0)]
    dist.barrier()


def case_async_and_futures():
    """async_op works: wait() drives; the future completes on its own, with gloo's value (the
    list of output tensors), and then() chains as DDP's comm hooks do."""
    r, n = world()
    t = torch.full((1000,), float(r + 1))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    value = fut.wait()
    assert torch.equal(value, torch.full((1000,), float(n * (n + 1))))
    assert work.is_completed()
    works = [dist.broadcast(torch.full((10,), float(r)), src=k, async_op=True) for k in range(n)]
    for w in works:
        w.wait()
    # many futures at once, waited out of order
    ts = [torch.full((50,), float(r + i)) for i in range(6)]
    futs = [dist.all_reduce(t, async_op=True).get_future() for t in ts]
    for i in reversed(range(6)):
        assert torch.equal(futs[i].wait()[0], torch.full((50,), float(sum(k + i for k in range(n)))))


def case_point_to_point():
    r, n = world()
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.empty(4)
    reqs = [dist.isend(torch.full((4,), float(r)), right, tag=3), dist.irecv(got, left, tag=3)]
    for q in reqs:
        q.wait()
    assert torch.equal(got, torch.full((4,), float(left)))
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(r)), right),
           dist.P2POp(dist.irecv, got[:2], left)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    assert torch.equal(got[:2], torch.full((2,), float(left)))
    if r == 0:
        senders = set()
        for _ in range(n - 1):
            buf = torch.empty(1)
            senders.add(dist.recv(buf))  # any source: returns the sender's rank
            assert buf.item() == 7.0
        assert senders == set(range(1, n)), senders
    else:
        dist.send(torch.full((1,), 7.0), 0)


def case_groups_and_device_mesh():
    """new_group (members only enter the backend), split_group-free DeviceMesh dims."""
    from torch.distributed.device_mesh import init_device_mesh

    r, n = world()
    evens = list(range(0, n, 2))
    g = dist.new_group(evens)
    if r in evens:
        t = torch.full((3,), float(r))
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((3,), float(sum(evens))))
        assert dist.get_process_group_ranks(g) == evens
    shape = (2, n // 2) if n % 2 == 0 and n > 2 else (1, n)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        members = dist.get_process_group_ranks(group)
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.full((2,), float(sum(members)))), (dim, members, t)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 4))


def case_ddp_matches_gloo():
    """DDP on the default ('commlib') group and on a gloo group, the same model, data and steps:
    losses and parameters bitwise equal at 1-2 ranks (a sum of two terms has one order), within
    1e-6 relative at 3-4 (the reduction orders may differ)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = world()
    gloo = dist.new_group(backend="gloo")
    runs = {}
    for name, group in (("commlib", None), ("gloo", gloo)):
        model = DDP(_model(), process_group=group, bucket_cap_mb=0.005)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(5):
            g = torch.Generator().manual_seed(10 * step + r)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        runs[name] = (torch.stack(losses), [p.detach().clone() for p in model.parameters()])
    (la, pa), (lb, pb) = runs["commlib"], runs["gloo"]
    if n <= 2:
        assert torch.equal(la, lb), (la, lb)
        assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    else:
        torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-7)
        for a, b in zip(pa, pb):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def case_ddp_bucket_mb():
    """``ddp_bucket_mb``: every gradient in one bucket where the group's collectives run in the
    call (one host, no core free for a progress thread: ``COMMLIB_PROGRESS=auto`` with as many
    ranks as cores, or ``wait``) and for one rank; else a cap from the cost model within its
    bounds (64 KiB to half the gradients). DDP takes either; a gloo group is refused, naming
    the argument."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commlib.errors import CommArgumentError
    from commlib.topology.affinity import host_cpu_count

    _, n = world()
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    grads = 2 * (256 * 256 + 256) * 4  # bytes of float32 gradients, counted by hand
    mb = commlib.torch_backend.ddp_bucket_mb(module)
    mode = os.environ.get("COMMLIB_PROGRESS", "auto")
    # every rank of these jobs is on this host: a core is free for a thread when ranks < cores
    overlaps = n > 1 and (mode == "thread" or (mode == "auto" and n < host_cpu_count()))
    if overlaps:
        assert (1 << 16) <= mb * (1 << 20) <= max(grads // 2, 1 << 16), (mode, n, mb)
    else:
        assert mb * (1 << 20) == grads, (mode, n, mb)
    model = DDP(module, bucket_cap_mb=mb)
    model(torch.ones(4, 256)).sum().backward()
    gloo = dist.new_group(backend="gloo")
    try:
        commlib.torch_backend.ddp_bucket_mb(module, gloo)
    except CommArgumentError as exc:
        assert "process_group" in str(exc) and "init_process_group('commlib')" in str(exc), exc
    else:
        raise AssertionError("ddp_bucket_mb took a gloo group")


def case_fsdp2_matches_dense():
    """FSDP2 (fully_shard) on CPU: parameters after some steps equal one process training the
    same model on the whole batch (float32, 1e-5)."""
    from torch.distributed.fsdp import fully_shard

    r, n = world()
    dense = _model(1)
    model = _model(1)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(dense.parameters(), lr=0.05)
    for step in range(3):
        xs, ys = [], []
        for k in range(n):
            g = torch.Generator().manual_seed(10 * step + k)
            xs.append(torch.randn(4, 16, generator=g))
            ys.append(torch.randn(4, 4, generator=g))
        loss = torch.nn.functional.mse_loss(model(xs[r]), ys[r])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref = torch.nn.functional.mse_loss(dense(torch.cat(xs)), torch.cat(ys))
        ref_opt.zero_grad()
        ref.backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), dense.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)


def case_dtensor_redistribute():
    """DTensor on a 2-D DeviceMesh over the backend: distribute_tensor and redistribute between
    Shard, Replicate and Partial, against the full tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    r, n = world()
    shape = (2, n // 2) if n % 2 == 0 and n > 2 else (1, n)
    mesh = init_device_mesh("cpu", shape)
    full = data(0, (4 * n, 6 * n))
    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    assert torch.equal(d.full_tensor(), full)
    for placements in ([Replicate(), Shard(0)], [Shard(1), Replicate()], [Replicate(), Replicate()],
                       [Shard(1), Shard(0)]):
        e = d.redistribute(mesh, placements)
        assert torch.equal(e.full_tensor(), full), placements
    # Partial over mesh dim 0: a rank's part is a multiple of the tensor, the parts sum to it
    first = mesh.get_coordinate()[0]
    local = full if shape[0] == 1 else (full * 3 if first == 0 else -full * 2)
    part = DTensor.from_local(local, mesh, [Partial(), Replicate()])
    assert torch.equal(part.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full)
    assert torch.equal(part.redistribute(mesh, [Shard(0), Replicate()]).full_tensor(), full)


def case_rank_raises_in_backward():
    """The last rank raises inside backward (a gradient hook) at the third step; every other
    rank must end with an error (the job's exit), not wait in DDP's all-reduce for ever."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = world()
    model = DDP(_model(), bucket_cap_mb=0.005)
    for step in range(5):
        if step == 2 and r == n - 1:
            model.module[0].weight.register_hook(_boom)
        x = torch.randn(8, 16)
        model(x).sum().backward()
    raise AssertionError(f"rank {r}: five steps completed although rank {n - 1} failed")


def case_uneven_inputs():
    """Rank 0 trains one step more than the others (DDP without join()): its extra all-reduce has
    no partner, and it must end with an error within the timeout, not wait for ever."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = world()
    model = DDP(_model(), bucket_cap_mb=0.005)
    for _ in range(3 + (r == 0)):
        model(torch.randn(8, 16)).sum().backward()
    if r != 0:
        time.sleep(60)  # alive, as a rank that went on to other work would be
    raise AssertionError(f"rank {r}: the unmatched step completed")


def _boom(grad):
    raise RuntimeError("injected failure in backward")


if __name__ == "__main__":
    if commlib.api.groups.detect_backend() == "mpi":
        commlib.init()  # MPI's world; then torch's rendezvous variables from it
        commlib.torch_backend.mpi_environment()
    dist.init_process_group("commlib")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "mpi"))
    from _harness import main

    main(globals())
    dist.destroy_process_group()
    assert os.environ.get("RANK") is not None
