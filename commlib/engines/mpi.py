"""MPI through mpi4py.

CPU tensors reach MPI as NumPy views (no copy). CUDA tensors are handed over directly (DLPack /
``__cuda_array_interface__``) when MPI is CUDA-aware, after the current stream is synchronized so
that MPI reads finished data. Each communicator is duplicated twice at creation: one context for
commlib's collectives and algorithm steps, one for the user's point-to-point, so tags never clash.
"""

from __future__ import annotations

import functools
import os
import zlib
from typing import Sequence

import numpy as np
import torch
from mpi4py import MPI

from .. import config
from ..errors import CommBackendError, CommMismatchError
from ..ops import ReduceOp
from . import register_backend
from .base import Backend, mpi_world_ranks
from .lifeline import Lifelines

_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,  # divided by commlib afterwards
    ReduceOp.PRODUCT: MPI.PROD,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.BAND: MPI.BAND,
    ReduceOp.BOR: MPI.BOR,
    ReduceOp.BXOR: MPI.BXOR,
}

_DONE = MPI.REQUEST_NULL  # the handle of a call that already completed (Test() is True)

# MPICH's threshold for its single-copy intranode messages (MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD,
# 8 KiB by default): a planned blocking call below it reads no peer's memory, so skips the check.
_SINGLE_COPY_BYTES = int(os.environ.get("MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD", "8192") or 8192)


class _Memory:
    """``nbytes`` at address ``ptr``, for ``np.asarray``: an array over memory it does not own.
    (``np.ctypeslib.as_array`` makes a ctypes array type per length, which ctypes keeps for the
    process's life: ~1 KiB per distinct size, most of the Python heap growth in bench/soak.py.)"""

    __slots__ = ("__array_interface__",)

    def __init__(self, ptr: int, nbytes: int):
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}


def _host_lifelines(comm: "MPI.Comm") -> Lifelines | None:
    """The lifelines of this host's ranks of ``comm`` (collective over ``comm``), or None when
    no other rank is on this host."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        if local.Get_size() == 1:
            return None
        ranks = local.allgather(comm.Get_rank())
        return Lifelines.create(local.Get_rank(), local.Get_size(),
                                lambda: local.allgather(os.getpid()), ranks,
                                lambda name: local.bcast(name, 0), local.Barrier)
    finally:
        local.Free()

# Reductions need the element type; pure data movement goes as bytes, which covers every dtype
# (float16 and bfloat16 included, which MPI cannot reduce).
_BYTES = torch.uint8


def _cuda_aware() -> bool:
    forced = config.get("cuda_aware_mpi")
    if forced is not None:
        return bool(forced)
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query else False
    except Exception:  # noqa: BLE001 - an MPI without the query is simply not known to be aware
        return False


class _AnySource:
    """An ``Irecv`` from MPI.ANY_SOURCE that keeps its status to tell the sender."""

    __slots__ = ("req", "status", "done")

    def __init__(self, req):
        self.req = req
        self.status = MPI.Status()
        self.done = False

    def test(self) -> bool:
        if not self.done:
            self.done = self.req.Test(self.status)
        return self.done


@register_backend("mpi")
class MPIBackend(Backend):
    devices = frozenset({"cpu", "cuda"})

    def __init__(self, comm: "MPI.Comm", lines: Lifelines | None = None):
        self.comm = comm.Dup()
        self.user = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._cuda_aware: bool | None = None
        # This host's lifelines (commlib/engines/lifeline.py): after each completion, a member on
        # this host that died during it fails the operation instead of leaving zeros in its result
        self._lines = lines
        self._watch = lines.watch(self.global_ranks()) if lines is not None else None
        self._owns_lines = False

    @classmethod
    def create_world(cls, **options) -> "MPIBackend":
        if not MPI.Is_initialized():
            MPI.Init()
        world = cls(MPI.COMM_WORLD, _host_lifelines(MPI.COMM_WORLD))
        world._owns_lines = True
        return world

    def new_subgroup(self, ranks: Sequence[int]) -> "MPIBackend | None":
        ranks = list(ranks)
        member = self.rank in ranks
        color = 0 if member else MPI.UNDEFINED
        key = ranks.index(self.rank) if member else 0
        sub = self.comm.Split(color, key)
        if sub == MPI.COMM_NULL:
            return None
        try:
            return MPIBackend(sub, self._lines)
        finally:
            sub.Free()

    def member_subgroup(self, ranks, key):
        incl = self.comm.Get_group().Incl(list(ranks))
        try:  # MPI_Comm_create_group: collective over the new group's members only
            sub = self.comm.Create_group(incl, zlib.crc32(key.encode()) % 32768)
        finally:
            incl.Free()
        try:
            return MPIBackend(sub, self._lines)
        finally:
            sub.Free()

    def split_lines(self, lines):
        for color, line in enumerate(lines):
            if self.rank in line:
                sub = self.comm.Split(color, list(line).index(self.rank))
                try:
                    return MPIBackend(sub, self._lines)
                finally:
                    sub.Free()
        raise ValueError(f"rank {self.rank} is in no line of {lines}")

    def global_ranks(self) -> list[int]:
        return mpi_world_ranks(MPI, self.comm)

    def close(self) -> None:
        for comm in (self.comm, self.user):
            if comm != MPI.COMM_NULL and not MPI.Is_finalized():
                comm.Free()
        if self._owns_lines and self._lines is not None:
            self._lines.close()

    def abort(self, code: int = 1) -> None:
        MPI.COMM_WORLD.Abort(code)

    # ----- buffers ------------------------------------------------------------------------
    def _buf(self, t: torch.Tensor, raw: bool = False):
        """A buffer MPI can read: a NumPy view for CPU, the tensor itself for CUDA."""
        if raw and t.dtype is not _BYTES:
            t = t.view(-1).view(_BYTES)
        if not t.is_cuda:
            return t.numpy()
        if self._cuda_aware is None:
            self._cuda_aware = _cuda_aware()
        if not self._cuda_aware:
            raise CommBackendError(
                "commlib: backend 'mpi' was given a CUDA tensor but this MPI is not CUDA-aware. "
                "Fix: init with backend='nccl' (or 'torch' over NCCL), set "
                "COMMLIB_CUDA_AWARE_MPI=1 if your MPI is CUDA-aware, or move the tensor to CPU."
            )
        torch.cuda.current_stream(t.device).synchronize()
        return t

    # ----- completion ---------------------------------------------------------------------
    # A message longer than its receive buffer (MPI_ERR_TRUNCATE) means the ranks called the
    # collective with different sizes: raised as CommMismatchError (the try costs nothing until
    # it raises).
    def test(self, handles: list) -> bool:
        try:
            for h in handles:
                if isinstance(h, _AnySource):
                    if not h.test():
                        return False
                elif not h.Test():
                    return False
        except MPI.Exception as exc:
            self._truncated(exc)
            raise
        if self._watch is not None:
            self._watch.check()
        return True

    def wait(self, handles: list) -> None:
        try:
            for h in handles:
                if isinstance(h, _AnySource):
                    if not h.done:
                        h.req.Wait(h.status)
                        h.done = True
                else:
                    h.Wait()
        except MPI.Exception as exc:
            self._truncated(exc)
            raise
        if self._watch is not None:
            self._watch.check()

    def _truncated(self, exc: "MPI.Exception") -> None:
        if exc.Get_error_class() == MPI.ERR_TRUNCATE:
            raise CommMismatchError(
                f"commlib: rank {self.rank} of {self.size} received a message longer than its "
                f"receive buffer ({' '.join(str(exc).split())}): the ranks called a collective "
                f"with different sizes (bytes), or different collectives. Fix: make every rank "
                f"of the group call the same collective with the same shape, dtype, op and root "
                f"(COMMLIB_DEBUG=1 names each rank's call)") from exc

    def source_of(self, handle) -> int | None:
        return handle.status.Get_source() if isinstance(handle, _AnySource) else None

    # ----- point-to-point -----------------------------------------------------------------
    def isend(self, buf, peer, tag, user=False):
        comm = self.user if user else self.comm
        return comm.Isend(self._buf(buf, raw=True), peer, tag)

    def irecv(self, buf, peer, tag, user=False):
        comm = self.user if user else self.comm
        if peer is None:
            return _AnySource(comm.Irecv(self._buf(buf, raw=True), MPI.ANY_SOURCE, tag))
        return comm.Irecv(self._buf(buf, raw=True), peer, tag)

    # ----- native collectives -------------------------------------------------------------
    # Each runs the blocking MPI call when allowed (see Backend: the watchdog guards it; MPICH's
    # Iallreduce + polling costs 5-10% over Allreduce at 64 KiB here) and the non-blocking one
    # otherwise.
    def _run(self, blocking: bool, what: str, call, icall, *args):
        if not blocking:
            return icall(*args)
        self.inflight = what
        try:
            call(*args)
        finally:
            self.inflight = None
        return _DONE  # the runtime completes it through test() or wait(), which check lifelines

    def all_reduce(self, buf, op, blocking=False):
        data = buf.numpy() if not buf.is_cuda else self._buf(buf)  # inline: the latency path
        comm = self.comm
        return self._run(blocking, "all_reduce", comm.Allreduce, comm.Iallreduce, MPI.IN_PLACE,
                         data, _MPI_OPS[op])

    def prepare_all_reduce(self, buf, op, blocking=False):
        if buf.is_cuda:
            return None
        # A NumPy view of buf's memory that does not own it: the plan must not keep buf alive.
        view = np.asarray(_Memory(buf.data_ptr(), buf.nbytes)).view(buf.numpy().dtype)
        call = functools.partial(self.comm.Allreduce if blocking else self.comm.Iallreduce,
                                 MPI.IN_PLACE, view, _MPI_OPS[op])
        watch = self._watch
        if not blocking or watch is None or buf.nbytes < _SINGLE_COPY_BYTES:
            return call  # non-blocking: checked at completion (test, wait)

        def checked():
            call()
            watch.check()
            return _DONE
        return checked

    def broadcast(self, buf, root, blocking=False):
        return self._run(blocking, "broadcast", self.comm.Bcast, self.comm.Ibcast,
                         self._buf(buf, raw=True), root)

    def reduce(self, buf, op, root, blocking=False):
        comm = self.comm
        if self.rank == root:
            args = (MPI.IN_PLACE, self._buf(buf), _MPI_OPS[op], root)
        else:
            args = (self._buf(buf), None, _MPI_OPS[op], root)
        return self._run(blocking, "reduce", comm.Reduce, comm.Ireduce, *args)

    def all_gather(self, out, inp, blocking=False):
        return self._run(blocking, "all_gather", self.comm.Allgather, self.comm.Iallgather,
                         self._buf(inp, raw=True), self._buf(out, raw=True))

    def reduce_scatter(self, out, inp, op, blocking=False):
        comm = self.comm
        return self._run(blocking, "reduce_scatter", comm.Reduce_scatter_block,
                         comm.Ireduce_scatter_block, self._buf(inp), self._buf(out), _MPI_OPS[op])

    def all_to_all(self, out, inp, out_counts, in_counts, blocking=False):
        item = inp.element_size()
        scount = [c * item for c in in_counts]
        rcount = [c * item for c in out_counts]
        send = [self._buf(inp, raw=True), (scount, _displacements(scount)), MPI.BYTE]
        recv = [self._buf(out, raw=True), (rcount, _displacements(rcount)), MPI.BYTE]
        return self._run(blocking, "all_to_all", self.comm.Alltoallv, self.comm.Ialltoallv,
                         send, recv)

    def barrier(self, blocking=False):
        return self._run(blocking, "barrier", self.comm.Barrier, self.comm.Ibarrier)


def _displacements(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
