"""NCCL through CuPy, for programs launched by ``mpirun`` that hold GPU arrays.

MPI (mpi4py) bootstraps: the first rank of a communicator creates NCCL's unique id and broadcasts
it, every rank joins with ``NcclCommunicator(size, id, rank)``. Each communicator has two NCCL
communicators: one for collectives and commlib's algorithm steps, one for the user's
point-to-point, so the two kinds of messages never match each other.

Everything runs on the current CuPy stream (ordered after torch's current stream when the two
differ); a handle is a CUDA event recorded after the operation: ``test`` is ``event.done``,
``wait`` is ``event.synchronize()``.

What NCCL does not have, and what happens instead:

* tags: NCCL matches a pair's messages in posting order. Sends and receives between two ranks on
  one channel must be posted in the same order on both sides (as with torch's NCCL groups).
* any-source receives: none; ``irecv(peer=None)`` raises ``CommUnsupportedError``.
* bitwise reductions (BAND/BOR/BXOR, and bool SUM/PRODUCT which commlib turns into them): none;
  they raise ``CommUnsupportedError`` naming the fixes.
* point-to-point outside a group: a lone ``ncclSend`` waits for its receiver on the stream, so a
  rank that sends then receives while its peer does the same deadlocks on the GPU. Sends and
  receives are therefore collected into an open ``groupStart()`` and launched together
  (``groupEnd()``) when any handle is tested or waited for, or before the next collective.

The module imports without CuPy or a GPU: CuPy is imported by ``create_world``. Its decisions
(dtype and op codes, element counts, the all-to-all schedule) are pure functions at the top,
tested on machines without a GPU.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..errors import CommBackendError, CommUnsupportedError
from ..ops import ReduceOp, dtype_name
from . import register_backend
from .base import Backend, mpi_world_ranks

__all__ = ["NCCLBackend", "nccl_dtype", "nccl_op", "reduction_args", "movement_args",
           "plan_all_to_all", "P2PStep", "device_for_local_rank"]

# ----- tables: NCCL's ABI values (nccl.h), so that planning needs neither CuPy nor NCCL -----------
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3

_NCCL_DTYPES = {
    torch.int8: NCCL_INT8,
    torch.uint8: NCCL_UINT8,
    torch.int32: NCCL_INT32,
    torch.int64: NCCL_INT64,
    torch.float16: NCCL_FLOAT16,
    torch.bfloat16: NCCL_BFLOAT16,  # NCCL >= 2.10
    torch.float32: NCCL_FLOAT32,
    torch.float64: NCCL_FLOAT64,
    # bool is never reduced here: the API layer reduces it as uint8; data movement goes as bytes.
}

_NCCL_OPS = {
    ReduceOp.SUM: NCCL_SUM,
    ReduceOp.AVG: NCCL_SUM,  # commlib divides afterwards, as on every backend (not ncclAvg)
    ReduceOp.PRODUCT: NCCL_PROD,
    ReduceOp.MIN: NCCL_MIN,
    ReduceOp.MAX: NCCL_MAX,
    # BAND, BOR, BXOR: NCCL has no bitwise reductions (see nccl_op).
}


def nccl_dtype(dtype: torch.dtype) -> int:
    """NCCL's datatype code for a reduction on ``dtype``."""
    code = _NCCL_DTYPES.get(dtype)
    if code is None:
        raise CommUnsupportedError(
            f"commlib: backend 'nccl' cannot reduce dtype {dtype_name(dtype)}. "
            f"Fix: use one of {sorted(dtype_name(d) for d in _NCCL_DTYPES)}."
        )
    return code


def nccl_op(op: ReduceOp, dtype: torch.dtype | None = None) -> int:
    """NCCL's reduction code for ``op``; bitwise ops raise, naming the fixes."""
    code = _NCCL_OPS.get(op)
    if code is None:
        what = "" if dtype is None else f" on {dtype_name(dtype)} (bool arrives as uint8)"
        raise CommUnsupportedError(
            f"commlib: backend 'nccl': NCCL has no bitwise reductions, so {op.name}{what} cannot "
            f"run as a native collective. Fix: pass algorithm='ring' (commlib's point-to-point "
            f"algorithms reduce locally and support every op), reduce 0/1 values with MAX "
            f"(= BOR) or MIN (= BAND), or use backend='mpi'."
        )
    return code


def reduction_args(dtype: torch.dtype, numel: int, op: ReduceOp) -> tuple[int, int, int]:
    """(count, datatype, op) for a reduction of ``numel`` elements of ``dtype``."""
    return numel, nccl_dtype(dtype), nccl_op(op, dtype)


def movement_args(numel: int, itemsize: int) -> tuple[int, int]:
    """(count, datatype) for moving ``numel`` elements of ``itemsize`` bytes: as bytes, which
    covers every dtype (bool, and bfloat16 on an NCCL without it)."""
    return numel * itemsize, NCCL_UINT8


class P2PStep(NamedTuple):
    """One send or receive of an all-to-all: ``nbytes`` at byte ``offset`` of the input (send)
    or output (recv) buffer, to or from ``peer``."""

    kind: str  # "send" | "recv"
    peer: int
    offset: int
    nbytes: int


def plan_all_to_all(rank: int, out_counts: Sequence[int], in_counts: Sequence[int],
                    itemsize: int) -> list[P2PStep]:
    """The sends and receives of an all-to-all with per-peer element counts, in one NCCL group.

    Peers are visited starting from this rank (rank, rank+1, ...), so ranks do not all hammer
    rank 0 first; empty blocks are skipped (NCCL would accept them, but they cost a launch). The
    block to oneself is a send/recv pair to self, which NCCL supports inside a group.
    """
    size = len(in_counts)
    if len(out_counts) != size:
        raise ValueError(f"out_counts has {len(out_counts)} entries, in_counts {size}")
    send_off = [0] * size
    recv_off = [0] * size
    for i in range(1, size):
        send_off[i] = send_off[i - 1] + in_counts[i - 1] * itemsize
        recv_off[i] = recv_off[i - 1] + out_counts[i - 1] * itemsize
    steps = []
    for k in range(size):
        peer = (rank + k) % size
        if in_counts[peer]:
            steps.append(P2PStep("send", peer, send_off[peer], in_counts[peer] * itemsize))
        src = (rank - k) % size
        if out_counts[src]:
            steps.append(P2PStep("recv", src, recv_off[src], out_counts[src] * itemsize))
    return steps


def device_for_local_rank(local_rank: int, device_count: int) -> int:
    """The GPU a rank uses: ranks on a node share its GPUs round-robin."""
    if device_count < 1:
        raise CommBackendError(
            "commlib.init(): backend 'nccl' found no CUDA device. Fix: run on a machine with "
            "GPUs (check CUDA_VISIBLE_DEVICES), or use backend='mpi' for CPU ranks."
        )
    return local_rank % device_count


# ----- the engine -------------------------------------------------------------------------------
def _mpi():
    """mpi4py's MPI, imported on first use: importing it initializes MPI, which a process that
    only imports this module (tests of the engine's pure parts, planning) must not do."""
    from mpi4py import MPI

    return MPI


def _import_cupy():
    """CuPy with NCCL and a visible GPU, or CommBackendError saying what is missing."""
    try:  # optional dependency (the 'cuda' extra): imported only by this engine's users
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise CommBackendError(
            f"commlib.init(): backend 'nccl' needs CuPy with NCCL ({exc}). Fix: pip install "
            f"cupy-cuda12x (the 'cuda' extra) on a machine with NVIDIA GPUs, or use "
            f"backend='mpi' (CPU and CUDA-aware MPI) or 'torch'."
        ) from exc
    if not getattr(nccl, "available", True):
        raise CommBackendError(
            "commlib.init(): backend 'nccl': this CuPy was built without NCCL. Fix: install a "
            "CuPy wheel that includes NCCL (cupy-cuda12x), or use backend='mpi' or 'torch'."
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError without a driver
        raise CommBackendError(
            f"commlib.init(): backend 'nccl': CUDA is not usable here ({exc}). Fix: run on a "
            f"machine with an NVIDIA driver and GPUs, or use backend='mpi' for CPU ranks."
        ) from exc
    return cupy, nccl, count


class _Event:
    """A handle: the CUDA event recorded on the stream after the operation."""

    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event


class _Batch:
    """Point-to-point calls collected in an open NCCL group; launched by ``flush``."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = None


class _P2P:
    __slots__ = ("batch",)

    def __init__(self, batch):
        self.batch = batch


@register_backend("nccl")
class NCCLBackend(Backend):
    devices = frozenset({"cuda"})
    native_reduce_dtypes = Backend.native_reduce_dtypes | {torch.float16, torch.bfloat16}
    native_ops = frozenset(_NCCL_OPS) - {ReduceOp.AVG}
    progress_in_thread = False  # streams are per thread; the open p2p group is not thread safe

    def __init__(self, mpi_comm, cupy, nccl):
        self._cupy, self._nccl = cupy, nccl
        self.mpi = mpi_comm.Dup()  # bootstrap and subgroup creation only
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        ids = [nccl.get_unique_id(), nccl.get_unique_id()] if self.rank == 0 else None
        ids = self.mpi.bcast(ids, root=0)
        self.comm = nccl.NcclCommunicator(self.size, ids[0], self.rank)
        self.user = nccl.NcclCommunicator(self.size, ids[1], self.rank)
        self._batch: _Batch | None = None
        self._scratch = cupy.zeros(1, dtype=cupy.float32)  # barrier

    @classmethod
    def create_world(cls, **options) -> "NCCLBackend":
        cupy, nccl, count = _import_cupy()
        try:
            MPI = _mpi()
        except ImportError as exc:
            raise CommBackendError(
                f"commlib.init(): backend 'nccl' bootstraps over MPI ({exc}). Fix: pip install "
                f"mpi4py (the 'mpich' extra) and launch with mpirun."
            ) from exc
        if not MPI.Is_initialized():
            MPI.Init()
        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            cupy.cuda.Device(device_for_local_rank(node.Get_rank(), count)).use()
        finally:
            node.Free()
        return cls(MPI.COMM_WORLD, cupy, nccl)

    def new_subgroup(self, ranks: Sequence[int]) -> "NCCLBackend | None":
        MPI = _mpi()
        ranks = list(ranks)
        member = self.rank in ranks
        key = ranks.index(self.rank) if member else 0
        sub = self.mpi.Split(0 if member else MPI.UNDEFINED, key)
        if sub == MPI.COMM_NULL:
            return None
        try:
            return NCCLBackend(sub, self._cupy, self._nccl)
        finally:
            sub.Free()

    def global_ranks(self) -> list[int]:
        return mpi_world_ranks(_mpi(), self.mpi)

    def close(self) -> None:
        self.flush()
        for comm in (self.comm, self.user):
            comm.destroy()
        if not _mpi().Is_finalized():
            self.mpi.Free()

    def abort(self, code: int = 1) -> None:
        _mpi().COMM_WORLD.Abort(code)

    # ----- streams and buffers ------------------------------------------------------------
    def _stream(self):
        """The current CuPy stream, ordered after torch's current stream when they differ (the
        tensors commlib receives were written on torch's)."""
        stream = self._cupy.cuda.get_current_stream()
        torch_ptr = torch.cuda.current_stream().cuda_stream
        if torch_ptr != stream.ptr:
            ready = self._cupy.cuda.Event(disable_timing=True)
            ready.record(self._cupy.cuda.ExternalStream(torch_ptr))
            stream.wait_event(ready)
        return stream

    def _ptr(self, t: torch.Tensor) -> int:
        if not t.is_cuda:
            raise CommBackendError(
                f"commlib: backend 'nccl' moves GPU memory only and was given a CPU tensor "
                f"(shape {tuple(t.shape)}). Fix: move it to the GPU (t.cuda()), or use "
                f"backend='mpi' for CPU tensors."
            )
        return t.data_ptr()

    def _done(self, stream) -> _Event:
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return _Event(event)

    # ----- completion ---------------------------------------------------------------------
    def flush(self) -> None:
        """Launch the open group of point-to-point calls."""
        batch = self._batch
        if batch is not None:
            self._batch = None
            self._nccl.groupEnd()
            batch.event = self._done(self._cupy.cuda.get_current_stream()).event

    def test(self, handles: list) -> bool:
        for h in handles:
            if type(h) is _P2P:
                if h.batch.event is None:
                    self.flush()
                if not h.batch.event.done:
                    return False
            elif not h.event.done:
                return False
        return True

    def wait(self, handles: list) -> None:
        for h in handles:
            if type(h) is _P2P:
                if h.batch.event is None:
                    self.flush()
                h.batch.event.synchronize()
            else:
                h.event.synchronize()

    # ----- point-to-point -----------------------------------------------------------------
    def _p2p(self, kind: str, buf, peer, user: bool) -> _P2P:
        if peer is None:
            raise CommUnsupportedError(
                "commlib.irecv(): backend 'nccl' has no any-source receive (NCCL matches each "
                "pair's messages in order). Fix: pass src=<the sender's rank>."
            )
        ptr = self._ptr(buf)
        if self._batch is None:
            stream = self._stream()  # order after torch before the group opens
            self._batch = _Batch()
            self._nccl.groupStart()
        else:
            stream = self._cupy.cuda.get_current_stream()
        comm = self.user if user else self.comm
        count, datatype = movement_args(buf.numel(), buf.element_size())
        getattr(comm, kind)(ptr, count, datatype, peer, stream.ptr)
        return _P2P(self._batch)

    def isend(self, buf, peer, tag, user=False):
        return self._p2p("send", buf, peer, user)

    def irecv(self, buf, peer, tag, user=False):
        return self._p2p("recv", buf, peer, user)

    # ----- native collectives -------------------------------------------------------------
    def _begin(self):
        self.flush()  # point-to-point posted before a collective is launched before it
        return self._stream()

    def all_reduce(self, buf, op, blocking=False):
        count, datatype, code = reduction_args(buf.dtype, buf.numel(), op)
        stream = self._begin()
        ptr = self._ptr(buf)
        self.comm.allReduce(ptr, ptr, count, datatype, code, stream.ptr)
        return self._done(stream)

    def broadcast(self, buf, root, blocking=False):
        count, datatype = movement_args(buf.numel(), buf.element_size())
        stream = self._begin()
        ptr = self._ptr(buf)
        self.comm.broadcast(ptr, ptr, count, datatype, root, stream.ptr)
        return self._done(stream)

    def reduce(self, buf, op, root, blocking=False):
        # NCCL writes recvbuff on the root only: other ranks' buffers stay unchanged.
        count, datatype, code = reduction_args(buf.dtype, buf.numel(), op)
        stream = self._begin()
        ptr = self._ptr(buf)
        self.comm.reduce(ptr, ptr, count, datatype, code, root, stream.ptr)
        return self._done(stream)

    def all_gather(self, out, inp, blocking=False):
        count, datatype = movement_args(inp.numel(), inp.element_size())
        stream = self._begin()
        self.comm.allGather(self._ptr(inp), self._ptr(out), count, datatype, stream.ptr)
        return self._done(stream)

    def reduce_scatter(self, out, inp, op, blocking=False):
        count, datatype, code = reduction_args(out.dtype, out.numel(), op)
        stream = self._begin()
        self.comm.reduceScatter(self._ptr(inp), self._ptr(out), count, datatype, code,
                                stream.ptr)
        return self._done(stream)

    def all_to_all(self, out, inp, out_counts, in_counts, blocking=False):
        steps = plan_all_to_all(self.rank, out_counts, in_counts, inp.element_size())
        stream = self._begin()
        send_ptr, recv_ptr = self._ptr(inp), self._ptr(out)
        self._nccl.groupStart()
        try:
            for step in steps:
                if step.kind == "send":
                    self.comm.send(send_ptr + step.offset, step.nbytes, NCCL_UINT8, step.peer,
                                   stream.ptr)
                else:
                    self.comm.recv(recv_ptr + step.offset, step.nbytes, NCCL_UINT8, step.peer,
                                   stream.ptr)
        finally:
            self._nccl.groupEnd()
        return self._done(stream)

    def barrier(self, blocking=False):
        # NCCL has no barrier: a one-element all-reduce, complete when every rank has joined.
        stream = self._begin()
        ptr = self._scratch.data.ptr
        self.comm.allReduce(ptr, ptr, 1, NCCL_FLOAT32, NCCL_SUM, stream.ptr)
        return self._done(stream)
