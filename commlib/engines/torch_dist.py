"""torch.distributed process groups (gloo on CPU, nccl on GPU).

The world communicator drives the default process group: the one the program created
with ``torch.distributed.init_process_group``, or one commlib creates from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Native collectives and the user's
point-to-point run on it, so ``commlib.send`` matches a ``torch.distributed.recv`` on the other
side.

Each communicator owns a second process group for commlib's algorithm steps (``user=False``), so its
tags never meet the user's. Process groups below the world are built directly from the default
store (``ProcessGroupGloo(PrefixStore(...), rank, size)``) rather than with
``torch.distributed.new_group``, for two reasons: ``new_group`` must be entered by every rank of the
job while ``Backend.new_subgroup`` is collective over the parent communicator only (a ``Mesh`` on a
subgroup), and ``new_group`` sorts its ranks while commlib keeps the order it is given. The store
prefix is derived from the parent's id and a per-parent counter, the same on every member.

Handles are torch ``Work`` objects, wrapped only where the engine needs help (table below).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from .. import config
from ..errors import CommBackendError, CommStateError
from ..ops import ReduceOp
from . import register_backend
from .base import Backend

__all__ = ["TorchBackend"]

log = logging.getLogger("commlib")

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # divided by commlib afterwards, like every backend
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}

# Local math for reductions the engine cannot do (see _LACKS).
_LOCAL = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}

_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
_HALF = frozenset({torch.float16, torch.bfloat16})

# ----- what each process-group engine does, with the special cases next to it --------------
# gloo: measured on torch 2.13 and held by tests/test_torch_backend.py; nccl: from
# ProcessGroupNCCL's documented limits (not run here: no GPU).
#
# devices: what the engine moves.
_DEVICES = {"gloo": frozenset({"cpu"}), "nccl": frozenset({"cuda"})}
# native_reduce_dtypes: gloo reduces float16/bfloat16 but rounds to half precision at every step
# of its ring, so commlib's float32 accumulation is better: not listed. NCCL accumulates them well.
_REDUCE_DTYPES = {"gloo": Backend.native_reduce_dtypes,
                  "nccl": Backend.native_reduce_dtypes | _HALF}
# Reductions the engine lacks, done here as an all-gather plus a local reduction:
#   nccl: no bitwise ops ("Cannot use ReduceOp.BAND with NCCL"); commlib turns bool SUM/PRODUCT
#   into BOR/BAND, so bool reductions land here too.
#   gloo: has every op on every dtype commlib passes (bitwise on floats and AVG on integers are
#   rejected by the API layer before they get here).
_LACKS: dict[str, frozenset] = {"gloo": frozenset(), "nccl": _BITWISE}
# gloo's reduce uses the non-root ranks' buffers as scratch (they end up holding partial sums),
# while commlib promises they are left unchanged: non-roots reduce a copy.
_REDUCE_CLOBBERS_INPUT = {"gloo": True, "nccl": False}
# gloo's send/recv Work never reports is_completed() until someone calls wait() on it (the pair
# finishes in gloo's I/O thread but nothing marks the Work done), so a non-blocking test() hands
# the Work to a waiter thread that blocks in wait() for it. nccl's Works poll a CUDA event.
_P2P_POLLABLE = {"gloo": False, "nccl": True}
# gloo's reduce_scatter has the same defect (its Work stays not-completed until wait()), so on
# gloo it runs as an all-reduce of a copy of the input and a slice, which polls (it moves the whole
# input instead of one block per rank; gloo is the CPU fallback, not the fast path).
_REDUCE_SCATTER_POLLABLE = {"gloo": False, "nccl": True}
# Messages to oneself never reach the engine: gloo has no pair to itself ("Pair is not
# connected"), so they are matched locally, by (channel, tag), in posting order.

_TIMEOUT = timedelta(seconds=1800)  # torch's default for gloo: with COMMLIB_TIMEOUT 0 (none)
# The engine's own timeout past commlib's: commlib raises first, with its message.
_TIMEOUT_MARGIN = 10.0


def engine_timeout() -> timedelta:
    """The timeout of the process groups commlib creates: ``COMMLIB_TIMEOUT`` plus
    :data:`_TIMEOUT_MARGIN`, else torch's 30 minutes. An operation commlib has given up on (a
    ``CommTimeoutError`` in raise mode, a peer that raised instead of calling) stays pending in
    gloo until the engine's own timeout; destroying the group joins gloo's threads, which wait for
    it, and with every rank's socket still open until its own join returns, ranks that each had
    one pending waited for one another: a restart (``destroy_process_group`` then ``init``) hung
    for torch's 30 minutes (seen in CI: tests/test_faults.py, gloo under torchrun, raise mode, the
    second round). With the engine's timeout just past commlib's, such an operation fails there
    and the join returns."""
    seconds = config.get("timeout")
    return timedelta(seconds=seconds + _TIMEOUT_MARGIN) if seconds else _TIMEOUT
# How long closing the world waits for waiter threads still inside a point-to-point wait: peers
# that exit at about the same time end those waits within it.
_WAITERS_GRACE = 2.0


def _kind(pg) -> str:
    """'gloo' or 'nccl' for a process group (a mixed 'cpu:gloo,cuda:nccl' counts as gloo on CPU
    and nccl on CUDA; commlib's own groups then use nccl when CUDA is present)."""
    name = str(dist.get_backend(pg)).lower()
    if "nccl" in name and torch.cuda.is_available():
        return "nccl"
    if "gloo" in name:
        return "gloo"
    raise CommBackendError(
        f"commlib.init(): backend 'torch': the default process group uses {name!r}, which "
        f"commlib cannot drive. Fix: init_process_group with backend 'gloo' or 'nccl'."
    )


def _make_pg(kind: str, store, rank: int, size: int):
    if kind == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, engine_timeout())
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = engine_timeout()
    return dist.ProcessGroupNCCL(store, rank, size, opts)


# ----- handles ------------------------------------------------------------------------------
class _Waiters:
    """Threads that block in ``Work.wait()`` for works that cannot be polled. Idle threads are
    reused; a new one starts when all are busy, so a receive that waits long (an any-source
    receive, a peer that is late) never delays the completion of later works.

    Every thread ends in :meth:`stop` (the world communicator's ``close``, so ``commlib.finalize``
    and exit): a thread still inside ``wait()`` when the interpreter finalizes is ended by Python
    (``pthread_exit``) the moment the wait returns, inside pybind11's ``noexcept`` GIL guard, and
    the process aborts ("terminate called without an active exception", PyTorch issue 38228). A
    peer that exits while this rank finalizes returns such a wait; a thread freeing a ``Work``
    (whose destructor releases the GIL too) is the same hazard, so waiters keep no reference to a
    work once it is done."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []
        self._closing = False

    def submit(self, handle: "_P2P") -> None:
        with self._lock:
            q = self._idle.pop() if self._idle else None
            if q is None:
                q = queue.SimpleQueue()
                thread = threading.Thread(target=self._loop, args=(q,), name="commlib-torch-wait",
                                          daemon=True)
                self._threads.append(thread)
                thread.start()
        q.put(handle)

    def _loop(self, q: queue.SimpleQueue) -> None:
        while True:
            handle = q.get()
            if handle is None:
                return
            try:
                handle.work.wait()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the owner's thread
                handle.error = exc
            handle.done = True
            handle.event.set()
            del handle  # none kept while idle: nothing of it is freed here later (at exit)
            with self._lock:
                if self._closing:
                    return
                self._idle.append(q)

    def stop(self, grace: float) -> list[threading.Thread]:
        """End every thread: idle ones at once, one still waiting for its work within ``grace``
        seconds (a peer exiting meanwhile ends that wait). Returns the threads still waiting:
        works nobody completed."""
        with self._lock:
            self._closing = True
            idle, self._idle = self._idle, []
            threads, self._threads = self._threads, []
        for q in idle:
            q.put(None)
        deadline = time.monotonic() + grace
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t for t in threads if t.is_alive()]


class _P2P:
    """A send/recv Work of an engine whose Works cannot be polled (gloo)."""

    __slots__ = ("work", "waiters", "event", "error", "done")

    def __init__(self, work, waiters: _Waiters):
        self.work, self.waiters = work, waiters
        self.event, self.error, self.done = None, None, False

    def test(self) -> bool:
        if self.event is None:
            self.event = threading.Event()
            self.waiters.submit(self)
            return False
        if self.done and self.error is not None:
            raise self.error
        return self.done

    def wait(self) -> None:
        if self.event is None:
            self.done = True
            self.event = threading.Event()
            self.work.wait()
            return
        self.event.wait()
        if self.error is not None:
            raise self.error

    def wait_for(self, seconds: float) -> bool:
        """Block up to ``seconds`` until done, on the waiter's event (commlib's progress thread
        waits here instead of polling); True when done."""
        if self.event is None:
            return False  # not handed to a waiter yet: test() does that
        return self.event.wait(seconds)

    def source(self) -> int:
        return _source_rank(self.work)


class _Composite:
    """Works that complete together, then a local step (``finish``) runs once."""

    __slots__ = ("works", "finish", "keep", "done")

    def __init__(self, works, finish=None, keep=None):
        self.works, self.finish, self.keep, self.done = works, finish, keep, False

    def _complete(self) -> None:
        for w in self.works:
            w.wait()  # already complete: raises the engine's error, if any
        if self.finish is not None:
            self.finish()
        self.done, self.keep, self.works = True, None, ()

    def test(self) -> bool:
        if not self.done:
            for w in self.works:
                if not w.is_completed():
                    return False
            self._complete()
        return True

    def wait(self) -> None:
        if not self.done:
            for w in self.works:
                w.wait()
            self._complete()


class _Local:
    """A message from this rank to itself."""

    __slots__ = ("buf", "done")

    def __init__(self, buf, done=False):
        self.buf, self.done = buf, done


def _wait_for(work, seconds: float) -> None:
    """Block up to ``seconds`` in a gloo collective's ``wait()``. Its timeout ("Operation timed
    out!") ends only the wait: the Work goes on. A Work that failed raises here too, and again
    from ``test()``, which waits on it once it reports completed."""
    try:
        work.wait(timedelta(seconds=seconds))
    except RuntimeError:
        pass


def _source_rank(work) -> int:
    fn = getattr(work, "_source_rank", None) or work.source_rank
    return int(fn())


# ----- the backend --------------------------------------------------------------------------
_generation = 0  # per create_world: store prefixes never reuse a previous world's keys


@register_backend("torch")
class TorchBackend(Backend):
    """A communicator over torch.distributed process groups.

    Attributes:
        group: the process group of native collectives and the user's point-to-point.
        internal: the process group of commlib's algorithm steps.
        kind: ``"gloo"`` or ``"nccl"``.
    """

    def __init__(self, group, internal, kind: str, world_ranks: Sequence[int], ident: str,
                 waiters: _Waiters | None = None):
        self.group, self.internal, self.kind = group, internal, kind
        # a world owns the waiter threads of its point-to-point; its subgroups share them
        self._owns_waiters = waiters is None
        self._waiters = waiters or _Waiters()
        self.rank, self.size = group.rank(), group.size()
        self._world_ranks = list(world_ranks)
        self._id, self._children = ident, 0
        self.devices = _DEVICES[kind]
        self.native_reduce_dtypes = _REDUCE_DTYPES[kind]
        self._lacks = _LACKS[kind]
        self._clobbers = _REDUCE_CLOBBERS_INPUT[kind]
        self._pollable = _P2P_POLLABLE[kind]
        self.progress_in_thread = kind == "gloo"  # torch's current CUDA stream is per thread
        self._rs_native = _REDUCE_SCATTER_POLLABLE[kind]
        self._sent: dict[tuple[bool, int], list] = {}  # messages to self, by (user, tag)
        self._posted: list[tuple[tuple[bool, int], _Local]] = []
        # both lists are matched by the caller's thread and by commlib's progress thread
        self._local = threading.Lock()

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def create_world(cls, **options) -> "TorchBackend":
        global _generation
        if not dist.is_available():
            raise CommBackendError(
                "commlib.init(): backend 'torch': this torch build has no torch.distributed. "
                "Fix: install a torch wheel with distributed support, or use backend='mpi'."
            )
        if not dist.is_initialized():
            _init_from_env()
        world = dist.group.WORLD
        kind = _kind(world)
        _generation += 1
        ident = f"commlib/{_generation}"
        size = dist.get_world_size()
        internal = _make_pg(kind, _store(ident + "/internal"), dist.get_rank(), size)
        return cls(world, internal, kind, range(size), ident)

    @classmethod
    def over_store(cls, store, rank: int, size: int) -> "TorchBackend":
        """A world communicator of gloo process groups over ``store`` (a torch ``Store`` every rank
        shares), for a world that is not torch's default process group: commlib's own process
        group under torchrun (:mod:`commlib.torch_backend`), whose creation runs before torch has
        a default group."""
        global _generation
        _generation += 1
        ident = f"commlib/{_generation}"
        group = _make_pg("gloo", dist.PrefixStore(ident + "/native/", store), rank, size)
        internal = _make_pg("gloo", dist.PrefixStore(ident + "/internal/", store), rank, size)
        return cls(group, internal, "gloo", range(size), ident)

    def member_subgroup(self, ranks, key):
        ranks = list(ranks)
        ident = f"{self._id}/{key}"
        rank, size = ranks.index(self.rank), len(ranks)
        group = _make_pg(self.kind, _store(ident + "/native"), rank, size)
        internal = _make_pg(self.kind, _store(ident + "/internal"), rank, size)
        return TorchBackend(group, internal, self.kind, [self._world_ranks[r] for r in ranks],
                            ident, self._waiters)

    def new_subgroup(self, ranks: Sequence[int]) -> "TorchBackend | None":
        ranks = list(ranks)
        self._children += 1
        ident = f"{self._id}.{self._children}"
        if self.rank not in ranks:
            return None
        rank, size = ranks.index(self.rank), len(ranks)
        group = _make_pg(self.kind, _store(ident + "/native"), rank, size)
        internal = _make_pg(self.kind, _store(ident + "/internal"), rank, size)
        return TorchBackend(group, internal, self.kind, [self._world_ranks[r] for r in ranks],
                            ident, self._waiters)

    def global_ranks(self) -> list[int]:
        return list(self._world_ranks)

    def close(self) -> None:
        # The default process group belongs to the program (or stays for a later init()); the
        # groups commlib built are released with their last reference.
        self.internal = None
        if self.group is not dist.group.WORLD:
            self.group = None
        if self._owns_waiters:
            stuck = self._waiters.stop(_WAITERS_GRACE)
            if stuck:
                log.warning(
                    "commlib: rank %d: %d point-to-point operation(s) on backend 'torch' were "
                    "never completed (their peers neither sent nor exited within %g s); if a peer "
                    "exits while this process shuts down, torch may abort it. Fix: wait() every "
                    "isend/irecv handle before finalize or exit.", self.rank, len(stuck),
                    _WAITERS_GRACE)

    # ----- completion ---------------------------------------------------------------------
    def test(self, handles: list) -> bool:
        for h in handles:
            if isinstance(h, (_P2P, _Composite)):
                if not h.test():
                    return False
            elif isinstance(h, _Local):
                if not h.done:
                    self._match()
                    if not h.done:
                        return False
            elif not h.is_completed():
                return False
            else:
                # A Work that failed (a peer's connection closed) is completed too: wait()
                # returns at once and raises its error, which is_completed() never does.
                h.wait()
        return True

    def wait(self, handles: list) -> None:
        for h in handles:
            if isinstance(h, _Local):
                if not h.done:
                    self._match()
                    if not h.done:
                        raise CommStateError(
                            f"commlib: rank {self.rank} waits for a message to itself that was "
                            f"never sent. Fix: post the matching isend to rank {self.rank} first."
                        )
            else:
                h.wait()

    def idle(self, handles: list, seconds: float) -> bool:
        # A gloo transfer completes on its waiter thread (point-to-point) or on gloo's worker
        # threads (collectives): block until it does rather than spin, which would only take the
        # core (and the GIL) from the threads that complete it. Measured at 3 ranks on 2 cores
        # (bench/soak.py): spinning on is_completed() left steps of 3-28 s in which gloo's
        # workers waited for a core.
        for h in handles:
            if isinstance(h, _P2P):
                if not h.done and h.event is not None:
                    h.wait_for(seconds)
                    return True
            elif not self._pollable and isinstance(h, (dist.Work, _Composite)):
                for w in (h.works if isinstance(h, _Composite) else (h,)):
                    if not w.is_completed():
                        _wait_for(w, seconds)
                        return True
        return False

    def source_of(self, handle) -> int | None:
        if isinstance(handle, _P2P):
            return handle.source()
        if isinstance(handle, _Local):
            return self.rank
        try:
            return _source_rank(handle)
        except (AttributeError, RuntimeError):
            return None

    # ----- point-to-point -----------------------------------------------------------------
    def _p2p(self, work):
        return work if self._pollable else _P2P(work, self._waiters)

    def isend(self, buf, peer, tag, user=False):
        if peer == self.rank:
            copy = buf.clone()
            with self._local:
                self._sent.setdefault((user, tag), []).append(copy)
                self._match_locked()
            return _Local(None, done=True)
        pg = self.group if user else self.internal
        return self._p2p(pg.send([buf.view(-1)], peer, tag))

    def irecv(self, buf, peer, tag, user=False):
        pg = self.group if user else self.internal
        if peer is None:
            # An any-source receive is matched by the engine: it does not see messages to self.
            return self._p2p(pg.recv_anysource([buf.view(-1)], tag))
        if peer == self.rank:
            handle = _Local(buf)
            with self._local:
                self._posted.append(((user, tag), handle))
                self._match_locked()
            return handle
        return self._p2p(pg.recv([buf.view(-1)], peer, tag))

    def _match(self) -> None:
        with self._local:
            self._match_locked()

    def _match_locked(self) -> None:
        for key, handle in self._posted:
            sent = self._sent.get(key)
            if sent and not handle.done:
                handle.buf.view(-1).copy_(sent.pop(0).view(-1).view(handle.buf.dtype))
                handle.done = True
        self._posted = [p for p in self._posted if not p[1].done]

    # ----- native collectives -------------------------------------------------------------
    def all_reduce(self, buf, op, blocking=False):
        flat = buf.view(-1)
        if op in self._lacks:
            return self._emulated(flat, op, lambda res: flat.copy_(res))
        return self.group.allreduce([flat], _OPS[op])

    def broadcast(self, buf, root, blocking=False):
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.group.broadcast([buf.view(-1)], opts)

    def reduce(self, buf, op, root, blocking=False):
        flat = buf.view(-1)
        if op in self._lacks:
            return self._emulated(flat, op, flat.copy_ if self.rank == root else None)
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = root, _OPS[op]
        if self.rank != root and self._clobbers:
            scratch = flat.clone()
            return _Composite([self.group.reduce([scratch], opts)], keep=scratch)
        return self.group.reduce([flat], opts)

    def all_gather(self, out, inp, blocking=False):
        return self.group._allgather_base(out.view(-1), inp.view(-1))

    def reduce_scatter(self, out, inp, op, blocking=False):
        flat_out = out.view(-1)
        if op in self._lacks:
            n = flat_out.numel()
            lo = self.rank * n
            return self._emulated(inp.view(-1), op, lambda res: flat_out.copy_(res[lo:lo + n]))
        if not self._rs_native:
            full = inp.view(-1).clone()
            lo = self.rank * flat_out.numel()
            hi = lo + flat_out.numel()
            return _Composite([self.group.allreduce([full], _OPS[op])],
                              finish=lambda: flat_out.copy_(full[lo:hi]), keep=full)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _OPS[op]
        return self.group._reduce_scatter_base(flat_out, inp.view(-1), opts)

    def all_to_all(self, out, inp, out_counts, in_counts, blocking=False):
        return self.group.alltoall_base(out.view(-1), inp.view(-1), list(out_counts),
                                        list(in_counts), dist.AllToAllOptions())

    def barrier(self, blocking=False):
        return self.group.barrier(dist.BarrierOptions())

    def _emulated(self, flat, op, store_result):
        """A reduction the engine lacks: all-gather every rank's ``flat``, reduce locally (in
        rank order, the same on every rank), hand the result to ``store_result``."""
        gathered = torch.empty(self.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        work = self.group._allgather_base(gathered, flat)

        def finish():
            if store_result is not None:
                rows = gathered.view(self.size, -1).unbind(0)
                store_result(functools.reduce(_LOCAL[op], rows))

        return _Composite([work], finish=finish, keep=gathered)


def _store(prefix: str):
    return dist.PrefixStore(prefix + "/", dist.distributed_c10d._get_default_store())


_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _FROM_ENV:
    """The default process group commlib created from the environment: the rendezvous store
    (kept for restarts), how many restarts, and whether the current default group is commlib's."""
    store = None
    restarts = 0
    owns_default = False


def restart_store():
    """The store for a new default group in a process whose first one commlib made from the
    environment (None if it did not): that world's store, since rank 0's server still holds
    MASTER_PORT, under a key space of its own, since the store keeps the previous worlds' keys."""
    if _FROM_ENV.store is None:
        return None
    _FROM_ENV.restarts += 1
    return dist.PrefixStore(f"commlib/restart/{_FROM_ENV.restarts}", _FROM_ENV.store)


def release_default_group() -> None:
    """Destroy torch's default process group if commlib created it from the environment
    (``commlib.destroy_process_group``), so that the next ``init()`` makes a new one: after a
    failure the old group's engine state is unknown (a timed-out operation may still be pending
    on some ranks and not others), and reusing it would match the wrong operations."""
    if _FROM_ENV.owns_default and dist.is_initialized():
        dist.destroy_process_group()
    _FROM_ENV.owns_default = False


def _init_from_env() -> None:
    """``init_process_group`` from torchrun's variables: nccl when CUDA is usable, else gloo."""
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise CommBackendError(
            f"commlib.init(): backend 'torch': torch.distributed is not initialized and the "
            f"environment lacks {missing}. Fix: launch with torchrun, call "
            f"torch.distributed.init_process_group() before commlib.init(), or set "
            f"{', '.join(_ENV)}."
        )
    kind = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    kwargs = {"timeout": engine_timeout()}
    if kind == "nccl":
        fallback = int(os.environ["RANK"]) % torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_RANK", fallback))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    try:
        if _FROM_ENV.store is None:
            dist.init_process_group(kind, init_method="env://", **kwargs)
            _FROM_ENV.store = dist.distributed_c10d._get_default_store()
        else:  # a restart in the same process (destroy_process_group, then init)
            dist.init_process_group(kind, store=restart_store(), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), **kwargs)
        _FROM_ENV.owns_default = True
    except (RuntimeError, ValueError) as exc:
        raise CommBackendError(
            f"commlib.init(): backend 'torch': init_process_group({kind!r}) from the environment "
            f"(MASTER_ADDR={os.environ['MASTER_ADDR']}, MASTER_PORT={os.environ['MASTER_PORT']}, "
            f"RANK={os.environ['RANK']}, WORLD_SIZE={os.environ['WORLD_SIZE']}) failed: {exc}. "
            f"Fix: check that every rank uses the same MASTER_ADDR/MASTER_PORT and that the port "
            f"is free on rank 0."
        ) from exc
