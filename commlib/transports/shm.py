"""The ``shm`` transport: collectives through one shared-memory segment per group, for groups whose
ranks all share a host (CPU tensors and NumPy arrays).

It rides on the group's engine (MPI or torch.distributed), which still moves everything else and
bootstraps the segment; this module only adds the data plane that the ``shm*`` algorithms of
``all_reduce`` (one-shot and two-shot), ``reduce_scatter``, ``all_gather`` and ``broadcast`` run on
(commlib/algorithms/shm.py). The copy-in, the flag handshake and the reduction are compiled
code, ``csrc/shm/`` (built into ``commlib.transports._shm`` by the package install), because on this machine
kind the latency to beat is a few microseconds; see there for the segment layout and the
memory-ordering argument.

Lifetime. Group rank 0 creates a POSIX shared-memory object, every rank maps it, and rank 0
unlinks its name as soon as all ranks have mapped it: the memory lives exactly as long as some
rank maps it, so no ``/dev/shm`` entry is left behind, whether the job ends normally or a rank is
killed.

Where the extension cannot be built or loaded, or ``/dev/shm`` cannot be used, groups simply get
no segment and every collective takes the engine's path; ``COMMLIB_LOG=INFO`` says why.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
import weakref

import torch

from .. import config
from ..errors import CommBackendError
from ..ops import ReduceOp, dtype_name
from ..topology.affinity import host_cpu_count
from .base import GroupFacts, Transport, refusal, register_transport

__all__ = ["available", "why_unavailable", "ShmTransport", "KIND", "DTYPE_CODES", "OP_CODES",
           "CALL_DTYPES", "decode_call", "run_op", "wait_policy"]

log = logging.getLogger("commlib")

try:
    from . import _shm as _ext
    _WHY: str | None = None
except ImportError as exc:  # not built (no compiler at install) or not loadable here
    _ext = None
    _WHY = f"the C extension commlib.transports._shm is not available ({exc}); reinstall with a C compiler " \
           f"and Python headers (pip install -e .)"

# Operation kinds of csrc/shm/shm.h (enum K_*).
KIND = {"oneshot": 0, "twoshot": 1, "reduce_scatter": 2, "all_gather": 3, "broadcast": 4}

# torch dtype -> csrc/reduce_math.h dtype code. bool arrives as uint8 (commlib maps its ops).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int8: 4,
    torch.uint8: 5, torch.int16: 6, torch.int32: 7, torch.int64: 8,
}

# ReduceOp -> csrc/reduce_math.h op code. AVG runs as SUM with the division done in C, in the
# accumulation type, before the single rounding (what commlib.kernels defines).
OP_CODES: dict[ReduceOp, int] = {
    ReduceOp.SUM: 0, ReduceOp.AVG: 0, ReduceOp.PRODUCT: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3,
    ReduceOp.BAND: 4, ReduceOp.BOR: 5, ReduceOp.BXOR: 6,
}

# The caller's dtype in the call a rank publishes with each step (csrc/shm/protocol.c,
# Agreement), by code: the reduction codes, then dtypes that only move as bytes.
CALL_DTYPES: tuple[torch.dtype, ...] = (*DTYPE_CODES, torch.bool, torch.complex64,
                                        torch.complex128)
_CALLS = {0: ("all_reduce", "shm_oneshot"), 1: ("all_reduce", "shm_twoshot"),
          2: ("reduce_scatter_tensor", "shm"), 3: ("all_gather_into_tensor", "shm"),
          4: ("broadcast", "shm")}
_OP_NAMES = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG")  # the op byte (AVG: 7)


def decode_call(kind: int, dtype: int, op: int, root: int, nbytes: int,
                first_step: int) -> tuple[str, dict]:
    """A call as a rank published it (``Segment.on_mismatch``'s rows): the collective's name and
    its fields as debug mode lists them (``count`` in elements, ``dtype``, ``op`` of reductions,
    ``root`` of broadcast, ``algorithm``)."""
    fn, algorithm = _CALLS.get(kind, (f"<kind {kind}>", "shm"))
    t = CALL_DTYPES[dtype] if dtype < len(CALL_DTYPES) else torch.uint8
    size = torch.empty((), dtype=t).element_size()
    fields: dict = {"count": nbytes // size, "dtype": dtype_name(t)}
    if kind in (0, 1, 2):
        fields["op"] = _OP_NAMES[op] if op < len(_OP_NAMES) else op
    if kind == 4:
        fields["root"] = root
    fields["algorithm"] = algorithm
    return fn, fields


def available() -> bool:
    return _ext is not None


def why_unavailable() -> str | None:
    return _WHY


def wait_policy(size: int) -> tuple[int, bool, int]:
    """How a rank of a ``size``-rank group waits for its peers: the polls it spins before giving
    its core away, whether it then sleeps on the peer's flag (futex) or yields
    (``sched_yield``), and for how many microseconds of a wait it yields before that sleep.

    With a core per rank: spin 2000 polls (~50 us here; 20000 burnt 0.5 ms on every step whenever
    another job pushed the peer onto the same core, 200 was slower from 16 B to 1 MiB), then yield
    for up to :data:`YIELD_BEFORE_SLEEP_US`, then sleep, which leaves the core to whoever has work
    when a peer is far behind (it is computing, or loading data). Sleeping at once lost the waits
    inside one large call: at 2 ranks a 64 MiB two-shot all-reduce took 8.1-8.3 ms sleeping
    after the spin, 6.4 ms yielding, 7.2-7.9 ms yielding 1 ms then sleeping (docs/shm.md,
    "Waiting"); and ranks a launcher bound one per CPU, which count as outnumbering the cores and
    yield, ran 1.2x faster than the same ranks bound by ``commlib.init``. When ranks outnumber
    cores a spinning rank only delays the peer it waits for: spin 50 polls, then yield. Measured
    at 4 ranks on 2 cores: yielding took 7.5 us per 8-byte all-reduce against 34 us for sleeping
    (a futex wake-up per step) and 20 us for MPI's Allreduce, and was as fast or faster up to
    256 MiB. ``COMMLIB_SHM_SPIN`` overrides the spin count."""
    if size <= host_cpu_count():
        spin, sleep, yield_us = 2000, True, YIELD_BEFORE_SLEEP_US
    else:
        spin, sleep, yield_us = 50, False, 0
    forced = config.get("shm_spin")
    return (spin if forced is None else forced), sleep, yield_us


#: With a core per rank, a wait yields this long before it sleeps (see :func:`wait_policy`).
YIELD_BEFORE_SLEEP_US = 20_000


@register_transport("shm")
class ShmTransport(Transport):
    """The group's shared-memory segment (``segment``, a ``commlib.transports._shm.Segment``) and the shared
    buffers of ``commlib.shared_empty`` (``share``): the peers' mappings live as long as the
    transport, until ``commlib.finalize``."""

    def __init__(self, segment, engine, group_name: str):
        self.segment, self.engine, self.group_name = segment, engine, group_name
        self.peer_buffers: list[torch.Tensor] = []

    @property
    def buffers(self):
        return self.segment

    @classmethod
    def attach(cls, engine, group_name: str, facts: GroupFacts) -> "ShmTransport | str":
        """Collective over ``engine``: the group's segment, or why the group does not qualify
        (one rank, several hosts, disabled, extension missing, /dev/shm unusable)."""
        size = engine.size
        why = refusal(engine, "cpu", "shm")
        if why is not None:
            return why
        limit = _ext.MAX_RANKS if _ext is not None else 64
        if size > limit:
            return f"{size} ranks, at most {limit}"
        if not facts.one_host:
            return f"ranks on {facts.host_count} hosts"
        if not all(facts.shm_ext):
            return _WHY or f"the C extension is missing on rank {facts.shm_ext.index(False)}"
        slot = config.get("shm_slot_bytes")
        spin, sleep, yield_us = wait_policy(size)
        # Rank 0 names and creates the segment; the name travels as 64 bytes through the engine.
        name_buf = torch.zeros(64, dtype=torch.uint8)
        seg, error = None, ""
        if engine.rank == 0:
            name = f"/commlib-{os.getpid()}-{uuid.uuid4().hex[:16]}"
            try:
                seg = _ext.Segment(name, 0, size, slot, True, spin, group_name, CommBackendError)
                name_buf[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
            except OSError as exc:
                error = str(exc)
        engine.wait([engine.broadcast(name_buf, 0, True)])
        name = bytes(name_buf.tolist()).rstrip(b"\0").decode()
        if name and engine.rank != 0:
            try:
                seg = _ext.Segment(name, engine.rank, size, slot, False, spin, group_name,
                                   CommBackendError)
            except OSError as exc:
                error = str(exc)
        mapped = engine.all_gather_ints([int(seg is not None)])
        if engine.rank == 0 and name:
            _ext.unlink(name)  # every rank has mapped it (or failed): the name is no longer needed
        if not all(k for (k,) in mapped):
            if seg is not None:
                seg.close()
            log.warning("group %s: no shared-memory segment (%s); collectives use the %s engine",
                        group_name, error or "another rank could not map it", engine.name)
            return f"the segment could not be mapped ({error or 'on another rank'})"
        seg.sleep, seg.yield_us = sleep, yield_us
        stream = config.get("shm_stream_bytes")
        if stream is not None:
            seg.nt_min = stream
        log.info("group %s: shared-memory segment of %d bytes (%d ranks x 2 x %d), spin %d, then %s",
                 group_name, seg.nbytes, size, slot, spin,
                 f"yield for {yield_us} us, then sleep" if sleep else "yield")
        return cls(seg, engine, group_name)

    def close(self) -> None:
        self.segment.close()
        self.peer_buffers = []

    def share(self, nbytes: int) -> torch.Tensor | None:
        """Collective over the group (every rank, the same ``nbytes``, in the same order): a
        uint8 tensor of ``nbytes`` in a shared-memory file of this rank that every rank of the
        group maps, registered with the segment (``Segment.share``) so that collectives read it
        in place. None where the segment is closed or a rank could not create or map a file
        (logged).

        Each rank creates its file, every rank maps every file, then each rank unlinks its own
        name, as for the segment: nothing stays in /dev/shm, and the memory lives as long as a
        mapping. The peers' mappings live as long as the transport: a buffer's memory returns to
        the system when the group goes, not when its tensor does."""
        seg, engine, group_name = self.segment, self.engine, self.group_name
        if seg.closed:
            return None
        size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        name = f"/dev/shm/commlib-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        mine, mapping, error = None, None, ""
        try:
            mine, mapping = _map(name, size, True)
        except OSError as exc:
            error = str(exc)
            _unlink(name)
        raw = torch.zeros(96, dtype=torch.uint8)
        if mine is not None:
            raw[:len(name)] = torch.frombuffer(bytearray(name.encode()), dtype=torch.uint8)
        paths = [bytes(row.tolist()).rstrip(b"\0").decode() for row in engine.all_gather_rows(raw)]
        views = [None] * engine.size
        if all(paths):
            for j, path in enumerate(paths):
                try:
                    views[j] = mine if j == engine.rank else _map(path, size, False)[0]
                except OSError as exc:
                    error = str(exc)
                    break
        mapped = engine.all_gather_ints([int(all(v is not None for v in views))])
        if mine is not None:
            _unlink(name)  # every rank has mapped it (or failed): the name is no longer needed
        if not all(k for (k,) in mapped):
            log.warning("group %s: no shared buffer of %d bytes (%s); a private one instead",
                        group_name, nbytes, error or "another rank could not create or map its file")
            return None
        index = seg.share([v.data_ptr() for v in views], size)
        # the own buffer's address range may be reused once its tensor is gone: stop looking it up
        weakref.finalize(mapping, seg.unshare, index)
        self.peer_buffers.extend(v for j, v in enumerate(views) if j != engine.rank)
        return mine[:nbytes]


def run_op(ctx, seg, op, name: str):
    """Run ``op`` (a ``commlib.transports._shm.ShmOp``) for an algorithm: to completion in C when the call
    may block (returning no handles), else start it and return it as the handle the poll loop
    and ``Work`` test (it answers MPI's ``Test``/``Wait`` and torch's ``is_completed``/``wait``)."""
    if ctx.blocking:
        res = ctx.res
        res.inflight = name  # the watchdog's view (COMMLIB_TIMEOUT_MODE=abort)
        try:
            op()
        finally:
            res.inflight = None
        return []
    op.start()
    return [op]


def _map(path: str, nbytes: int, create: bool) -> tuple[torch.Tensor, mmap.mmap]:
    """A uint8 tensor over ``nbytes`` of the shared-memory file ``path`` (created and its pages
    reserved when ``create``: a full /dev/shm fails here with ENOSPC, not later with SIGBUS), and
    the mapping, which the tensor keeps alive."""
    fd = os.open(path, (os.O_RDWR | os.O_CREAT | os.O_EXCL) if create else os.O_RDWR, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise OSError(f"{path} has {os.fstat(fd).st_size} bytes, not {nbytes}")
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8), mm


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
