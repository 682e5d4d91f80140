"""commlib as a torch.distributed backend: ``torch.distributed.init_process_group("commlib")``.

Importing commlib registers the backend name ``"commlib"`` for CPU tensors, so code that never
calls commlib itself (DistributedDataParallel, FSDP, DTensor, ``torch.distributed``'s collectives)
runs on commlib's selection: shared memory on one host, hierarchical algorithms across hosts, the
engine's own collectives elsewhere. For CUDA tensors name a second backend per device, torch's own
mechanism: ``init_process_group("cpu:commlib,cuda:nccl")``.

The world: under ``mpirun``/``mpiexec`` commlib's world is MPI's (call ``commlib.init()`` first,
which also gives torch the ``RANK``/``MASTER_ADDR`` variables its rendezvous needs, or let
``commlib.init_process_group`` do both); under ``torchrun`` (``env://``) it is built over the store
torch hands the backend. If commlib is initialized already, its world is used, and must have the
process group's size and rank. Groups from ``new_group``, ``split_group`` and ``DeviceMesh`` are
commlib groups created by their members (:func:`commlib.api.groups.member_group`).

Every operation runs as commlib's asynchronous operation and returns a torch ``Work`` over it:
``wait()`` drives it (commlib's ``Work.wait``, its timeout and typed errors), and its future
(``get_future()``, what DDP's reducer and comm hooks use) completes on its own: the operation
is then served by commlib's progress thread (``Work.add_done_callback``), so DDP's bucket
all-reduces progress during the backward pass. Where no progress thread would serve the group
(one host with no free core, :meth:`ProcessGroupCommlib._run`), collectives run blocking in the
call and return a completed ``Work``: nothing could hide there.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from .api import collectives as _c
from .api import p2p as _p2p
from .api.entry import fail_future
from .api.groups import (
    detect_backend,
    get_world_group,
    init,
    init_with,
    is_initialized,
    member_group,
)
from .engines.torch_dist import TorchBackend
from .errors import CommArgumentError, CommConfigError, CommStateError
from .runtime.group import state as _state
from .runtime.progress import lane_of, overlaps
from .topology.host import interface_addresses
from .tuning import bucket_sizes

__all__ = [
    "BACKEND", "ProcessGroupCommlib", "mpi_environment", "ddp_bucket_mb", "allreduce_avg_hook",
]

BACKEND = "commlib"


class _Work(dist._Work):
    """torch's ``Work`` over commlib ``Work``s that complete together; its value (``result()``,
    the future's value) is the list of output tensors, as gloo's."""

    def __init__(self, works, result: list):
        super().__init__()
        self._works, self._result = works, result
        self._future = None

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def wait(self, timeout=timedelta(0)) -> bool:
        # torch's default timeout (zero) means the group's: commlib's COMMLIB_TIMEOUT
        limit = None if not timeout or timeout == timedelta(0) else timeout
        for w in self._works:
            w.wait(limit)
        return True

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            future = self._future = torch.futures.Future()
            left = [len(self._works)]
            if not self._works:
                future.set_result(self._result)

            def done(work):
                if future.done():
                    return
                if work.exception() is not None:
                    fail_future(work.exception(), future)
                    return
                left[0] -= 1
                if left[0] == 0:
                    future.set_result(self._result)

            for w in self._works:
                w.add_done_callback(done)
        return self._future


class ProcessGroupCommlib(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose operations are commlib's, on the commlib ``Group``
    ``group`` (its ranks in the process group's order)."""

    def __init__(self, group, rank: int, size: int):
        super().__init__(rank, size)
        self.group = group
        self._group_name = self._group_desc = ""

    def getBackendName(self) -> str:
        return BACKEND

    # torch keeps a group's name and description in its C++ backends, which a Python process
    # group has none of (DeviceMesh reads group_name): kept here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupCommlib(rank {self.rank()} of {self.size()}, {self.group.name!r})"

    # ----- collectives ---------------------------------------------------------------------
    def _run(self, result: list, calls) -> _Work:
        """Issue the collectives ``calls`` (each ``call(async_op=...)``, returning a commlib
        ``Work`` when asynchronous); the torch ``Work`` over them, whose value is ``result``.

        Where no progress thread would serve this group (:func:`commlib.runtime.progress.lane_of`
        None: one host with no core free for one under ``COMMLIB_PROGRESS=auto``, or ``wait``),
        each runs blocking here and the work is complete when returned. Nothing could hide
        there (the cores that compute also copy), and a future complete at once costs DDP's
        reducer nothing, where one the forced progress thread completes cost it about twice the
        all-reduce (docs/torch-backend-bench.md). Point-to-point operations are always issued
        asynchronously: a send blocking until its receive is posted could deadlock a batch."""
        if lane_of(self.group) is None:
            for call in calls:
                call(async_op=False)
            return _Work([], result)
        return _Work([call(async_op=True) for call in calls], result)

    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._run(tensors, [partial(_c.all_reduce, t, op, group=self.group)
                                   for t in tensors])

    def broadcast(self, tensors, opts):
        return self._run(tensors, [partial(_c.broadcast, t, group=self.group,
                                           group_src=opts.rootRank) for t in tensors])

    def reduce(self, tensors, opts):
        return self._run(tensors, [partial(_c.reduce, t, op=opts.reduceOp, group=self.group,
                                           group_dst=opts.rootRank) for t in tensors])

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._run(output_tensors, [partial(_c.all_gather, out, inp, group=self.group)
                                          for out, inp in zip(output_tensors, input_tensors)])

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output, input, opts=None):
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._run(outputs, [partial(_c.all_gather_into_tensor, o, i, group=self.group)
                                   for o, i in zip(outputs, inputs)])

    def reduce_scatter(self, output_tensors, input_lists, opts):
        return self._run(output_tensors, [
            partial(_c.reduce_scatter, out, inputs, opts.reduceOp, group=self.group)
            for out, inputs in zip(output_tensors, input_lists)])

    def reduce_scatter_single(self, output, input, opts):
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return self._run(outputs, [
            partial(_c.reduce_scatter_tensor, o, i, opts.reduceOp, group=self.group)
            for o, i in zip(outputs, inputs)])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        return self._run([output], [partial(_c.all_to_all_single, output, input,
                                            list(output_split_sizes) or None,
                                            list(input_split_sizes) or None, group=self.group)])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._run(output_tensors, [partial(_c.all_to_all, output_tensors, input_tensors,
                                                  group=self.group)])

    def gather(self, output_lists, input_tensors, opts):
        out = output_lists[0] if self.rank() == opts.rootRank else None
        return self._run(output_lists, [partial(_c.gather, input_tensors[0], out,
                                                group=self.group, group_dst=opts.rootRank)])

    def scatter(self, output_tensors, input_lists, opts):
        inp = input_lists[0] if self.rank() == opts.rootRank else None
        return self._run(output_tensors, [partial(_c.scatter, output_tensors[0], inp,
                                                  group=self.group, group_src=opts.rootRank)])

    def allreduce_coalesced(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._run(tensors, [partial(_c.all_reduce_coalesced, tensors, op,
                                           group=self.group)])

    def barrier(self, opts=None):
        return self._run([], [partial(_c.barrier, group=self.group)])

    # ----- point-to-point ------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int):
        return _Work([_p2p.isend(t, group=self.group, tag=tag, group_dst=dst) for t in tensors],
                     tensors)

    def recv(self, tensors, src: int, tag: int):
        return _Work([_p2p.irecv(t, group=self.group, tag=tag, group_src=src) for t in tensors],
                     tensors)

    def recv_anysource(self, tensors, tag: int):
        works = [_p2p.irecv(t, group=self.group, tag=tag) for t in tensors]
        return _AnySourceWork(works, tensors, self.group)

    # ----- life ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        pass

    def abort(self) -> None:
        pass


class _AnySourceWork(_Work):
    def __init__(self, works, result, group):
        super().__init__(works, result)
        self._group = group

    def _source_rank(self) -> int:
        return self._group.group_rank(self._works[0].result())

    source_rank = _source_rank


# ----- data parallelism -------------------------------------------------------------------
def ddp_bucket_mb(model: torch.nn.Module, process_group=None) -> float:
    """The ``bucket_cap_mb`` to give ``DistributedDataParallel(model, process_group=...)`` on the
    commlib backend. Where the group's collectives can overlap the backward pass (a progress
    thread serves it: across hosts, or a host with a core free), the smallest all-reduce at 90%
    of the group's bandwidth in its cost model (:func:`commlib.tuning.bucket_sizes`, which also
    says why), at most half the gradients. Where they cannot (one host whose cores all compute:
    the process group runs each collective in the call), and for one rank, every gradient in
    one bucket beside DDP's first: each bucket is then a point where every rank waits for the
    slowest, and nothing is gained by issuing early (docs/torch-backend-bench.md).
    Local: no communication."""
    pg = process_group if process_group is not None else dist.group.WORLD
    if not isinstance(pg, ProcessGroupCommlib):
        raise CommArgumentError(
            f"ddp_bucket_mb: process_group {pg!r} is not a commlib process group. Fix: "
            f"init_process_group('commlib'), or pass a group made by new_group on it.")
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if not overlaps(pg.group):
        return max(grads, 1) / (1 << 20)
    dtype = next((p.dtype for p in model.parameters() if p.requires_grad), torch.float32)
    bucket, _, _ = bucket_sizes(pg.group, grads, dtype)
    return bucket / (1 << 20)


def allreduce_avg_hook(process_group, bucket):  # no annotations: DDP checks them as objects
    """A DDP communication hook (``ddp.register_comm_hook(None, allreduce_avg_hook)``, or with a
    process group as state): the bucket's mean over the ranks in one all-reduce with
    ``ReduceOp.AVG``, which commlib's shared-memory all-reduce divides while it reduces. Without
    a hook DDP divides the bucket by the world size itself, one more pass over the gradients
    (fused with its copy into the bucket, but a pass of its own with
    ``gradient_as_bucket_view=True``). The result is torch's default hook's up to rounding (a
    division of the sum, not a sum of divided gradients)."""
    pg = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, group=pg, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# ----- creation ---------------------------------------------------------------------------
def _world(store, rank: int, size: int):
    """commlib's world for torch's default process group (``rank`` of ``size``)."""
    if not is_initialized():
        if detect_backend() == "mpi":
            init("mpi")
        else:
            init_with(TorchBackend.over_store(store, rank, size), "torch")
    world = get_world_group()
    if (world.size, world.rank) != (size, rank):
        raise CommStateError(
            f"init_process_group('commlib'): torch's world is rank {rank} of {size}, commlib's is "
            f"rank {world.rank} of {world.size}. Fix: launch with one launcher (under mpirun, "
            f"let commlib.init() set RANK and WORLD_SIZE), or call commlib.finalize() before."
        )
    return world


def _create(options, pg_options):
    ranks = list(options.global_ranks_in_group)
    if not ranks:
        group = _world(options.store, options.group_rank, options.group_size)
    else:
        group = member_group(ranks, f"torch/{options.group_id}")
    return ProcessGroupCommlib(group, options.group_rank, options.group_size)


def mpi_environment() -> dict:
    """Under an MPI launcher, with commlib initialized on MPI: the variables torch's ``env://``
    rendezvous reads (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``: rank 0's address and a free port on it, broadcast), set
    where missing; returns them. Collective over the world. Rank 0's address is its host name's,
    or where no resolver knows the name its first network interface's that is not loopback;
    with neither, every rank raises ``CommConfigError`` (set ``MASTER_ADDR``)."""
    world = get_world_group()
    port = torch.zeros(1, dtype=torch.int64)
    addr = torch.zeros(256, dtype=torch.uint8)
    if world.rank == 0:
        name = _own_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port[0] = int(os.environ.get("MASTER_PORT") or s.getsockname()[1])
        addr[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    _c.broadcast(port, group_src=0)
    _c.broadcast(addr, group_src=0)
    if not addr.any():  # rank 0 found no address: every rank says so
        raise CommConfigError(
            "commlib.torch_backend.mpi_environment: rank 0's host name does not resolve to an "
            "address and its host has no network interface with one besides loopback, so the "
            "other ranks cannot reach torch's rendezvous there. Fix: set MASTER_ADDR to an "
            "address of rank 0's host that every rank reaches (mpiexec -genv MASTER_ADDR ...)")
    layout = world.resources.layout
    host = next((h for h in layout.hosts if world.rank in h), [world.rank]) if layout else [0]
    values = {
        "RANK": str(world.rank), "WORLD_SIZE": str(world.size),
        "LOCAL_RANK": str(list(host).index(world.rank)), "LOCAL_WORLD_SIZE": str(len(host)),
        "MASTER_ADDR": bytes(addr[addr != 0].tolist()).decode(), "MASTER_PORT": str(int(port)),
    }
    for k, v in values.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in values}


def _own_address() -> str:
    """An address of this host (rank 0's) for torch's rendezvous: ``MASTER_ADDR``, else what its
    host name resolves to, else its first network interface's address that is not loopback (a
    host name no resolver knows, as in a network namespace); '' if none."""
    name = os.environ.get("MASTER_ADDR")
    if name:
        return name
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return next((a for a in interface_addresses() if not a.startswith("127.")), "")


def register() -> None:
    """Register ``"commlib"`` with torch.distributed (done when commlib is imported)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


register()
