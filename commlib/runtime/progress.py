"""Driving operations to completion: ``Work``, the poll loop, the timeout, the progress thread.

Every operation is a generator that yields lists of backend handles and finishes its local work
(copy-back, AVG division) after the last one. Two things advance them:

* :func:`drive`, in the caller's thread, completes a blocking call or ``Work.wait()``: it polls
  ``backend.test``, and every few polls blocks in ``backend.idle`` where the engine can wait
  without spinning (a gloo transfer, which its waiter thread completes: spinning there took the
  cores and the GIL from the threads that complete it, and 4 ranks on 2 cores then ran blocking
  collectives up to 20x slower, past the timeout) or else calls ``sched_yield`` (a pure spin
  starves the other ranks when they outnumber the cores), checking the deadline every 64 polls,
  so a stuck operation becomes ``CommTimeoutError`` naming the op, the group and its sequence
  number; with no timeout and nothing else pending it blocks in the engine instead. While one
  operation waits, every other pending asynchronous operation is advanced too, so ranks that
  wait on asynchronous multi-step operations in different orders cannot deadlock.
* the **progress threads** advance pending ``Work``s while the caller's thread computes, so that
  communication issued with ``async_op=True`` overlaps compute (started with the first
  asynchronous operation). ``COMMLIB_PROGRESS=auto``, the default, uses them where they can hide
  something (:func:`choose_lane`): for every group across hosts, whose data the network moves
  while the cores compute, and for a group on one host only when the host has more cores than
  ranks, since there the progress is copying by the cores themselves and a thread with no free
  core can only take time from the compute; ``thread`` uses them everywhere, ``wait`` nowhere.
  They never spin: when a pass over the pending works completes nothing, a thread blocks in the
  engine where the engine can wait without spinning (a shared-memory step sleeps in a futex until
  the lagging peer publishes; a gloo transfer waits on its waiter thread's event; neither
  advances anything: only passes do, and the caller's thread keeps the passes off while it
  drives), and otherwise sleeps between passes, from ``COMMLIB_PROGRESS_MIN_US`` doubling to
  ``COMMLIB_PROGRESS_MAX_US`` (1 ms) while nothing completes; the thread serving groups across
  hosts keeps to ``COMMLIB_PROGRESS_REMOTE_FAST_US`` (100 us) for the first 10 ms after an
  operation is issued or advances, and while the process's other threads are nearly idle (the
  caller waits for the result), since MPI over TCP answers a message's handshake and pushes its
  fragments only inside its calls
  (MPI moves data only inside its calls, and MPICH's own asynchronous-progress thread spins a
  core). Two threads, two lanes (:class:`_Lanes`): groups on one host are served by a niced
  thread, since their progress is copying on the cores the compute uses; groups across hosts by
  a thread at normal priority, which must answer the network promptly, run as a batch task so
  that its many wake-ups do not preempt the compute (:func:`set_batch`). A thread holds the GIL
  only while it tests handles and runs an operation's next step (torch compute releases the
  GIL), and stays off while the caller's thread drives operations itself (``_DRIVING``).
  Engines that cannot be driven from a second thread (``Backend.progress_in_thread`` False: the
  GPU engines, whose current stream is per thread) are left to the caller's thread; their
  device work runs on its own. docs/overlap.md has the measurements behind these choices.

Each ``Work`` has a lock: whichever thread advances it holds it (the caller's ``wait`` blocks on
it, the progress thread only tries it), so one generator never runs in two threads. Engines are
used from both threads: MPI runs at ``MPI_THREAD_MULTIPLE``, torch's process groups are thread
safe, and the shared-memory segment serialises its own progress (csrc/shm: the segment lock). A
failure met by the progress thread is stored in the ``Work`` and raised, the same typed error,
by ``wait()`` and ``is_completed()``.

Blocking calls run the generator directly, without allocating a ``Work``: this path is the
latency of every small collective.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import queue
import re
import threading
import time
from typing import Generator, NoReturn

import torch

from .. import config
from ..errors import CommBackendError, CommError, CommStateError, CommTimeoutError
from ..topology.affinity import host_cpu_count
from .group import state

__all__ = ["Work", "completed_work", "drive", "overlaps", "set_progress", "shutdown", "start",
           "unusable"]

log = logging.getLogger("commlib")
_yield = os.sched_yield if hasattr(os, "sched_yield") else (lambda: time.sleep(0))
_clock = time.monotonic
_IDLE_S = 0.005  # longest block in the engine between polls (other pending works, the deadline)
# After an operation across hosts is issued or advances, its thread polls at the fast pace for
# this long: MPI over TCP answers a message's rendezvous and pushes its fragments only inside
# calls, which a DDP bucket's steps (a few ms each at 1 Gb/s) wait on; past it a transfer is
# streaming, and polling faster only takes the cores from the compute (docs/overlap.md).
FAST_WINDOW_S = 0.010
# ... and while the process's other threads together use less than this share of a core: its
# caller is waiting for the communication (DDP's reducer once the backward has ended), not
# computing, so the fast pace takes nothing from the compute.
IDLE_SHARE = 0.1
# A caller waiting on an operation of a group across hosts polls without pause for this long, then
# sleeps the remote lane's fast pace (``COMMLIB_PROGRESS_REMOTE_FAST_US``) between polls: an
# operation that takes longer is moving bytes over the network, and MPI's polls (epoll, a recv into
# its buffer) then only burn the core that the rank's other threads and the kernel's TCP work need.
# Measured on 2 hosts x 1 rank at 1 Gb/s, 12 all-reduces of about 1 MiB (108 ms): 107-108 ms of
# CPU per rank spinning, 34-44 ms napping, 13-18 ms on gloo (bench/wait_cpu.py, docs/overlap.md).
# (With no timeout, COMMLIB_TIMEOUT=0, a lone wait blocks in the engine: MPI_Wait, which spins.)
WAIT_SPIN_S = 0.001
# Linux wakes a sleeping thread up to its timer slack late (50 µs by default) so that wake-ups
# coalesce: the remote thread's 100 µs pause took 156 µs, 107 µs with this slack. Across hosts that
# pace is what moves MPI's bytes while DDP's reducer waits for its last bucket (MPI over TCP moves
# data only inside calls): the slowest rank's tail of a DDP step at 2 x 1 took 119 ms with it,
# 129-135 without (docs/torch-backend-bench.md). The progress threads set it for themselves only.
TIMER_SLACK_NS = 1000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30

# Outstanding asynchronous works of every group, in issue order.
_PENDING: list["Work"] = []

# What operations that failed (timed out) left with the engine: their requests and buffers. The
# engine may still complete them (a late rank joins) and write into the buffers, and freeing an
# active collective request is erroneous in MPI (it crashed MPICH with a double free): keep both
# alive for the life of the process. Only failures add here; the group is unusable afterwards.
_ABANDONED: list = []


def _expire(group, what: str, seq: int, limit: float):
    message = (
        f"commlib.{what}: operation #{seq} on group {group.name!r} (size {group.size}) did not "
        f"complete within {limit:g} s on rank {group.rank}. The other ranks are calling a "
        f"different operation, or one of them stopped. Fix: run with COMMLIB_DEBUG=1 to name the "
        f"ranks that disagree, or raise COMMLIB_TIMEOUT if the operation is just slow."
    )
    group.broken = (f"operation #{seq} ({what}) timed out, leaving the engine's state unknown. "
                    f"Fix: restart the job")
    raise CommTimeoutError(message)


# How engines report a peer gone: gloo's closed or reset connection, MPICH's and Open MPI's
# failed process or broken socket.
_PEER_LOST = re.compile(r"closed by peer|connection (?:closed|reset|refused)|broken pipe|"
                        r"end of file|process(?:es)? (?:failed|died|terminated)|"
                        r"peer.*(?:exit|died)|"
                        r"socket closed|communication error with rank|MPI_ERR_PROC_FAILED",
                        re.IGNORECASE)


def engine_failure(exc: BaseException, group, what: str, seq: int) -> BaseException:
    """An engine's own error (gloo's "Connection closed by peer", an ``MPI.Exception``: both
    RuntimeErrors) as the ``CommBackendError`` commlib promises, naming the op, the group and its
    sequence number; the group is unusable afterwards. commlib's own errors pass unchanged."""
    if isinstance(exc, CommError) or not isinstance(exc, RuntimeError):
        return exc
    engine = group.backend.name if group.backend is not None else "?"
    text = " ".join(str(exc).split())
    group.broken = (f"operation #{seq} ({what}) failed in the {engine} engine ({text}). Fix: "
                    f"restart (commlib.destroy_process_group(), then commlib.init())")
    if _PEER_LOST.search(text):
        why = ("A peer process exited or was killed. Fix: find why that rank ended (its own "
               "output), then")
    else:
        why = "Fix: see the engine's message above and each rank's own output, then"
    error = CommBackendError(
        f"commlib.{what}: operation #{seq} on group {group.name!r} (size {group.size}) failed on "
        f"rank {group.rank} in the {engine} engine: {type(exc).__name__}: {text}. {why} "
        f"restart (commlib.destroy_process_group(), then commlib.init()) or relaunch the job.")
    error.__cause__ = exc
    return error


def raise_engine_failure(exc: BaseException, group, what: str, seq: int) -> NoReturn:
    """Raise ``exc`` as :func:`engine_failure` has it (from the ``except`` block that caught it)."""
    failure = engine_failure(exc, group, what, seq)
    if failure is exc:
        raise exc
    raise failure from exc


# Held by the caller's thread while it drives operations (and advances every pending one), so
# that the progress thread stays off meanwhile instead of competing for the GIL; and by the
# progress thread for each pass over the pending operations.
_DRIVING = threading.Lock()


def drive(gen, handles, group, what: str, seq: int, limit: float | None, me=None):
    """Complete ``gen`` (currently waiting on ``handles``); return its value. ``gen`` None: a
    one-step operation, done when ``handles`` are."""
    if not _PENDING:  # the latency path: no asynchronous operation, no progress thread at work
        return _drive(gen, handles, group, what, seq, limit, me)
    with _DRIVING:
        return _drive(gen, handles, group, what, seq, limit, me)


def _drive(gen, handles, group, what: str, seq: int, limit: float | None, me):
    backend = group.backend
    try:
        if limit is None and not (_PENDING and any(w is not me for w in _PENDING)):
            while True:  # no deadline and nothing else to advance: block in the engine
                backend.wait(handles)
                if gen is None:
                    return None
                handles = gen.send(None)
        deadline = None
        polls = 0
        test, idle = backend.test, backend.idle
        nap = None  # wait_nap(group), read once this wait has polled a few times
        napping, naps_from = False, 0.0
        while True:
            if test(handles):
                if gen is None:
                    return None
                handles = gen.send(None)
                continue
            polls += 1
            if _PENDING and not (napping and polls & 3):  # napping: every 4th nap (MPI's
                for other in tuple(_PENDING):             # progress is the process's own)
                    if other is not me:
                        other._advance()
            if polls & 3 and not napping:
                continue  # poll again at once: a handoff between ranks takes under a microsecond
            if polls & 63 == 0 and limit is not None:
                if getattr(backend, "local_only", False):
                    backend.wait(handles)  # nothing else can complete it: raises, saying why
                    continue
                now = _clock()
                if deadline is None:
                    deadline = now + limit
                elif now > deadline:
                    _expire(group, what, seq, limit)
            # Every 4th poll, block in the engine where it can wait without spinning, else give
            # the core away: when ranks outnumber cores, the peer this rank waits for may need it
            # (measured: yielding every poll costs ~4% at 64 KiB, never yielding costs 500x when
            # oversubscribed). Across hosts, past WAIT_SPIN_S, sleep between polls instead.
            if idle(handles, _IDLE_S):
                continue
            if not napping:
                if nap is None:
                    nap, naps_from = wait_nap(group), _clock() + WAIT_SPIN_S
                elif nap and _clock() >= naps_from:
                    napping = True
            if napping:
                time.sleep(nap)
            else:
                _yield()
    except StopIteration as done:
        return done.value
    except BaseException as exc:
        _ABANDONED.append((gen, handles))
        raise_engine_failure(exc, group, what, seq)


def wait_nap(group) -> float:
    """The pause between a waiting caller's polls past :data:`WAIT_SPIN_S`: the remote lane's fast
    pace for a group across hosts on an engine driven from any thread (MPI), else 0 (spin and
    yield: on one host the peers' progress is the cores' own work, and the GPU engines wait on
    their device)."""
    if not (group.backend.progress_in_thread and _group_facts(group)[0]):
        return 0.0
    return min(config.get("progress_remote_fast_us"), config.get("progress_max_us")) * 1e-6


def _one_step(handles):
    yield handles


class Work:
    """Handle of an operation, as returned with ``async_op=True`` (torch.distributed's ``Work``)."""

    __slots__ = ("_gen", "_fin", "_keep", "_handles", "_group", "_what", "_seq", "_done",
                 "_result", "_timeout", "_lock", "_error", "_steps", "_lane", "_callbacks",
                 "_deadline")

    def __init__(self, gen: Generator, finish, keep, group, what: str, seq: int,
                 timeout: float | None):
        self._keep = keep  # the buffers the engine reads and writes, alive until completion
        if type(gen) is list:  # a one-step operation returned its handles directly
            gen = _one_step(gen)
        self._gen, self._fin, self._group, self._what, self._seq = gen, finish, group, what, seq
        self._timeout = timeout
        self._done = False
        self._result = None
        self._error: BaseException | None = None
        self._steps = 0  # steps completed: the progress thread's measure of progress
        self._lock = threading.Lock()  # held by the thread advancing it
        # the progress thread that serves it; None when issued with COMMLIB_PROGRESS=wait, or
        # where auto chose none (a thread already running must leave it to wait, too)
        self._lane = lane_of(group)
        self._callbacks: list | None = None
        self._deadline: float | None = None  # of a work only a callback waits for
        try:
            self._handles = next(gen)  # post the first step now
        except StopIteration as done:
            self._finish(done.value)

    def _finish(self, result, failed: bool = False) -> None:
        if failed:
            _ABANDONED.append((self._gen, self._handles, self._keep))
        self._handles = None
        self._result = self._fin() if (self._fin is not None and not failed) else result
        self._keep = None
        # Last: wait() and is_completed() read _done without the lock, and return at once once it
        # is set, so the result (the copy-back into the caller's tensor) must be in place first.
        self._done = True
        try:
            _PENDING.remove(self)
        except ValueError:
            pass
        if self._callbacks:
            _CALLBACKS.run(self, self._callbacks)
            self._callbacks = None

    def add_done_callback(self, fn) -> None:
        """Call ``fn(work)`` once the operation has finished (completed or failed), on commlib's
        callback thread, never while commlib holds its locks (so ``fn`` may call commlib); at once
        if it has finished already. The operation is then served by a progress thread whatever
        ``COMMLIB_PROGRESS`` says: a callback has no caller whose ``wait()`` would drive it
        (torch futures, :mod:`commlib.torch_backend`); and the progress thread enforces the
        group's timeout, counted from here: the operation fails with ``CommTimeoutError``."""
        with self._lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                    if self._timeout is not None:
                        self._deadline = _clock() + self._timeout
                self._callbacks.append(fn)
                if self._lane is None:
                    self._lane = _forced_lane(self._group)
                _PROGRESS.threads[self._lane].kick()
                return
        _CALLBACKS.run(self, [fn])

    def _poll(self) -> bool:
        """Advance as far as possible without blocking; True when done. The caller holds the
        lock. A failure is stored (``_error``) and raised."""
        if self._done:
            return True
        backend = self._group.backend
        try:
            while backend.test(self._handles):
                self._steps += 1
                self._handles = next(self._gen)
        except StopIteration as done:
            self._finish(done.value)
        except BaseException as exc:
            self._error = failure = engine_failure(exc, self._group, self._what, self._seq)
            self._finish(None, failed=True)
            if failure is exc:
                raise
            raise failure from exc
        return self._done

    def _expire_if_late(self, now: float) -> None:
        """Fail with ``CommTimeoutError`` if only callbacks wait for it and its deadline passed
        (the progress thread's check; a caller's ``wait()`` has its own)."""
        if self._deadline is None or now <= self._deadline or self._done:
            return
        if not self._lock.acquire(False):
            return
        try:
            if not self._done:
                try:
                    _expire(self._group, self._what, self._seq, self._timeout)
                except CommTimeoutError as exc:
                    self._error = exc
                    self._finish(None, failed=True)
        finally:
            self._lock.release()

    def _advance(self) -> None:
        """Advance if no other thread is doing so; a failure stays in the Work for ``wait``."""
        if self._done or not self._lock.acquire(False):
            return
        try:
            self._poll()
        except BaseException:  # noqa: BLE001 - stored in _error, raised by wait/is_completed
            pass
        finally:
            self._lock.release()

    def _raise(self) -> bool:
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the operation has finished (and its output is ready); never blocks (beyond
        the moment the progress thread may hold it). Raises the operation's error, if it failed."""
        if self._done:
            return self._raise()
        with self._lock:
            done = self._poll()
        return done

    def exception(self) -> BaseException | None:
        """The error the operation failed with (as ``wait`` raises it), or None."""
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation completes; ``timeout`` in seconds or a ``timedelta``
        (default: the group's ``COMMLIB_TIMEOUT``). Raises ``CommTimeoutError`` when it
        expires, or the error the operation failed with. Returns True."""
        if self._done:
            return self._raise()
        limit = self._timeout if timeout is None else _seconds(timeout)
        with self._lock:  # the progress thread keeps off while this thread drives it
            if self._done:
                return self._raise()
            try:
                result = drive(self._gen, self._handles, self._group, self._what, self._seq,
                               limit, me=self)
            except BaseException as exc:
                self._error = exc
                self._finish(None, failed=True)
                raise
            self._finish(result)
        return True

    def result(self):
        """What the operation returned (the sender's world rank for ``irecv``), after waiting."""
        self.wait()
        return self._result

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "completed") if self._done else "pending"
        return f"<commlib.Work {self._what} #{self._seq} on {self._group.name!r} ({state})>"


class _Completed(Work):
    """A Work that finished at creation (empty tensors)."""

    __slots__ = ()

    def __init__(self, result=None):
        self._done, self._result, self._handles, self._fin, self._keep = True, result, None, None, None
        self._error, self._lane, self._callbacks, self._deadline = None, None, None, None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "<commlib.Work (completed)>"


def completed_work(result=None) -> Work:
    return _Completed(result)


def _seconds(timeout) -> float | None:
    if hasattr(timeout, "total_seconds"):  # datetime.timedelta, as torch's Work.wait takes
        timeout = timeout.total_seconds()
    timeout = float(timeout)
    return None if timeout <= 0 else timeout


def unusable(group, what: str):
    """Raise: ``group`` cannot run operations any more (``group.broken`` says why and the fix:
    an earlier timeout left its engine state unknown, or ``commlib.finalize()`` released it)."""
    raise CommStateError(f"commlib.{what}: group {group.name!r} is unusable: {group.broken}.")


def start(gen: Generator, finish, keep, group, what: str, seq: int, async_op: bool):
    """Run an operation: block until done and return its value, or return its ``Work``.

    ``gen`` is the algorithm's generator, or, for an algorithm that completes in one step, the
    list of its handles; ``finish`` (or None) runs after the last step and its return value is the
    operation's result. ``keep`` holds every buffer the engine uses (the caller's tensors and
    commlib's temporaries): engines do not keep them alive, so the operation must until it ends.
    The caller has checked that the group is usable (:func:`unusable`) before posting anything.
    """
    if async_op:
        work = Work(gen, finish, keep, group, what, seq, group.timeout)
        if not work._done:
            _PENDING.append(work)
            if work._lane is not None:
                _PROGRESS.threads[work._lane].kick()
        return work
    if type(gen) is list:
        handles, gen = gen, None
    else:
        try:
            handles = next(gen)
        except StopIteration as done:
            return finish() if finish is not None else done.value
    try:
        value = drive(gen, handles, group, what, seq, group.timeout)
    except BaseException:
        _ABANDONED.append(keep)
        raise
    return finish() if finish is not None else value


class _Callbacks:
    """The thread that runs ``Work`` done-callbacks, in completion order, outside commlib's locks
    (a callback that issues another operation must not find the progress lock held by its own
    thread)."""

    def __init__(self):
        self._queue = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, work: Work, fns: list) -> None:
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._queue,),
                                                name="commlib-callbacks", daemon=True)
                self._thread.start()
            q = self._queue
        for fn in fns:
            q.put((fn, work))

    @staticmethod
    def _loop(q) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fn, work = item
            try:
                fn(work)
            except BaseException:  # noqa: BLE001 - a callback's failure is its caller's to report
                log.exception("commlib: a done-callback of %r raised", work)
            del item, fn, work  # nothing the callback kept dies later on this thread

    def stop(self) -> None:
        """End the thread once the callbacks queued so far have run (``shutdown``)."""
        with self._lock:
            q, self._queue, thread, self._thread = self._queue, None, self._thread, None
        if q is not None:
            q.put(None)
            thread.join(timeout=5)


_CALLBACKS = _Callbacks()


def set_timer_slack(ns: int) -> int | None:
    """Set the calling thread's timer slack to ``ns`` nanoseconds (Linux ``prctl``); the slack
    the kernel then reports for the thread, or None where there is no ``prctl``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0)
        slack = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    except (OSError, AttributeError):
        return None
    return slack if slack >= 0 else None


def set_nice(nice: int) -> bool:
    """Set the calling thread's niceness (on Linux a thread is a task: this is the thread's own,
    not the process's); whether that took."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True


def set_batch() -> bool:
    """Make the calling thread a batch task (Linux ``SCHED_BATCH``, same priority): the kernel
    then never preempts a running thread to run it when it wakes; it runs at the running one's
    next switch or on an idle core. Whether that took (False where there is no such policy)."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(threading.get_native_id(), policy, os.sched_param(0))
    except OSError:
        return False
    return True


def _idle(work: Work, seconds: float) -> None:
    """Wait up to ``seconds`` for ``work`` to make progress, always blocking, never spinning: in
    the engine where its pending handle can wait that way (``wait_for``: a shared-memory step
    sleeps until the lagging peer publishes, a gloo transfer on its waiter's event), else asleep
    (an MPI request, whose data moves only inside MPI calls). An error met here is raised again
    by the next poll, which stores it in the Work."""
    for h in work._handles or ():
        wait_for = getattr(h, "wait_for", None)
        if wait_for is None:
            break
        try:
            if not wait_for(seconds):
                return  # it blocked until the peer moved, or for ``seconds``
        except BaseException:  # noqa: BLE001 - the next poll raises it where it is stored
            return
    time.sleep(seconds)


class _Progress:
    """A progress thread: advances the pending ``Work``s of its lane while the caller's thread
    computes (see the module docstring). Started by the lane's first asynchronous operation,
    stopped by ``finalize``. ``nice``: the thread's niceness (Linux; 0 elsewhere);
    ``batch_option``: the option that makes it a batch task (:func:`set_batch`)."""

    def __init__(self, lane: str, nice: int, fast_option: str | None = None,
                 batch_option: str | None = None):
        self.lane, self.nice, self.fast_option = lane, nice, fast_option
        self.batch_option = batch_option
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.timer_slack_ns: int | None = None  # the thread's, once it runs (TIMER_SLACK_NS)
        self.batch = False  # whether it runs as a batch task (``batch_option``, set_batch)

    def kick(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name=f"commlib-progress-{self.lane}",
                                            daemon=True)
            self._thread.start()
        if not self._wake.is_set():
            self._wake.set()

    def pauses(self) -> tuple[float, float, float]:
        """(first, fast, longest) pause in seconds between passes that complete nothing: from
        ``COMMLIB_PROGRESS_MIN_US`` doubling up to ``fast`` for :data:`FAST_WINDOW_S` after an
        operation was issued or advanced or while the caller waits (:func:`next_pause`), else up
        to ``COMMLIB_PROGRESS_MAX_US``; ``fast`` is this lane's (``COMMLIB_PROGRESS_REMOTE_FAST_US``
        across hosts, else the longest). The first never exceeds the fast one."""
        hi = config.get("progress_max_us") * 1e-6
        fast = min(config.get(self.fast_option) * 1e-6, hi) if self.fast_option else hi
        return min(config.get("progress_min_us") * 1e-6, fast), fast, hi

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # communication is not differentiated (and per thread)
        if self.nice:
            set_nice(self.nice)
        if self.batch_option is not None and config.get(self.batch_option):
            self.batch = set_batch()
        self.timer_slack_ns = set_timer_slack(TIMER_SLACK_NS)  # its pauses as asked
        lo, fast, hi = self.pauses()
        interval = lo
        moved = _clock()  # when an operation was last issued or advanced
        lane = self.lane
        others = _OthersBusy() if fast < hi else None  # a lane with one pace needs no signal
        while not self._stop:
            pending = tuple(w for w in _PENDING if w._lane == lane)
            if not pending:
                self._wake.wait()
            if self._wake.is_set():  # an operation was issued: answer its first step promptly
                self._wake.clear()
                interval, moved = lo, _clock()
            if not pending:
                continue
            with _DRIVING:  # waits while the caller's thread drives (it advances them all)
                steps = sum(w._steps for w in pending)
                for w in pending:
                    w._advance()
                progressed = (any(w._done for w in pending)
                              or sum(w._steps for w in pending) != steps)
            now = _clock()
            if progressed:
                interval, moved = lo, now
                continue
            for w in pending:
                w._expire_if_late(now)
            _idle(pending[0], interval)
            busy = others.share() if others is not None else 1.0
            interval = next_pause(interval, fast, hi, now - moved, busy)

    def stop(self) -> None:
        thread = self._thread
        if thread is not None:
            self._stop = True
            self._wake.set()
            thread.join(timeout=5)
            self._thread = None


def next_pause(interval: float, fast: float, hi: float, since_moved: float,
               others_share: float) -> float:
    """The pause after one that completed nothing (pure): doubled, up to ``fast`` within
    :data:`FAST_WINDOW_S` of an operation's last issue or advance (``since_moved``, seconds) or
    while the process's other threads used under :data:`IDLE_SHARE` of a core over the last pause
    (``others_share``: the caller waits, nothing computes), else up to ``hi``."""
    quick = since_moved < FAST_WINDOW_S or others_share < IDLE_SHARE
    return min(2 * interval, fast if quick else hi)


class _OthersBusy:
    """The share of a core the process's other threads (the caller's compute) used since the last
    call: process CPU time less this thread's, over the wall time."""

    def __init__(self):
        self._last = (_clock(), time.process_time(), time.thread_time())

    def share(self) -> float:
        now = (_clock(), time.process_time(), time.thread_time())
        (t0, p0, o0), self._last = self._last, now
        wall = now[0] - t0
        return ((now[1] - p0) - (now[2] - o0)) / wall if wall > 0 else 1.0


class _Lanes:
    """The two progress threads. Operations of a group whose ranks share one host go to the
    ``local`` thread, niced (``COMMLIB_PROGRESS_NICE``): their progress is copying (shared
    memory, or the engine's own shared-memory path) on the cores the compute uses, so it runs
    where the compute leaves room instead of taking a core from it. Operations of a group that
    spans hosts go to the ``remote`` thread, at normal priority (it must answer the network
    promptly), as a batch task (``COMMLIB_PROGRESS_REMOTE_BATCH``): at its fast pace it wakes
    hundreds of times a DDP step, and each wake-up of a normal task preempted the caller's
    compute on its core. Engines that cannot be driven from another thread
    (``Backend.progress_in_thread`` False) get neither."""

    def __init__(self):
        self.mode = config.get("progress")
        self.threads = {"local": _Progress("local", config.get("progress_nice")),
                        "remote": _Progress("remote", 0, "progress_remote_fast_us",
                                            "progress_remote_batch")}

    def stop(self) -> None:
        for thread in self.threads.values():
            thread.stop()
        self.mode = config.get("progress")


_PROGRESS = _Lanes()
PROGRESS_MODES = ("auto", "thread", "wait")


def choose_lane(mode: str, spans_hosts: bool, ranks_on_host: int, cores: int) -> str | None:
    """Which progress thread serves a group's asynchronous operations (pure: the facts in, the
    lane out): ``"remote"`` for a group across hosts, ``"local"`` for one on a single host, or
    None (they advance in ``wait()`` and the other commlib calls).

    ``mode`` is ``COMMLIB_PROGRESS``: ``wait`` never uses a thread, ``thread`` always does, and
    ``auto`` uses one where it can hide something. Across hosts it always can: the network
    moves the data while the cores compute. On one host the progress is copying by the cores
    themselves, so a thread hides it only if a core is free of compute: ``ranks_on_host`` (the
    world's ranks on this host, each computing) below ``cores`` (this process's usable cores).
    Without a free core the thread's copies take the compute's time and add switches and cache
    misses (2-9% slower than waiting, measured in docs/overlap.md), and ``wait`` does the same
    copies without that cost."""
    if mode == "wait":
        return None
    if spans_hosts:
        return "remote"
    return "local" if mode == "thread" or ranks_on_host < cores else None


def _ranks_on_host(group) -> int:
    """The world's ranks on this rank's host (all of them compute), else ``group``'s."""
    for g in (state.world, group):
        layout = getattr(getattr(g, "resources", None), "layout", None)
        if layout is not None and g.rank >= 0:
            return next(len(h) for h in layout.hosts if g.rank in h)
    return group.size


def lane_of(group) -> str | None:
    """Which progress thread serves ``group``'s asynchronous operations now (:func:`choose_lane`
    under the current mode), or None; always None for an engine driven from the caller's thread
    only. The group's facts are read once and kept in its resources."""
    if _PROGRESS.mode == "wait" or not group.backend.progress_in_thread:
        return None
    return choose_lane(_PROGRESS.mode, *_group_facts(group))


def _group_facts(group) -> tuple[bool, int, int]:
    """(spans hosts, the world's ranks on this host, this process's cores) for ``group``, read
    once and kept in its resources."""
    facts = group.resources.state.get("progress_facts") if group.resources else None
    if facts is None:
        layout = getattr(group.resources, "layout", None)
        facts = (layout is not None and len(layout.hosts) > 1, _ranks_on_host(group),
                 host_cpu_count())
        if group.resources is not None:
            group.resources.state["progress_facts"] = facts
    return facts


def overlaps(group) -> bool:
    """Whether ``group``'s collectives can run behind the caller's compute: it has peers and a
    progress thread serves it (:func:`lane_of`). Where not (one host whose cores all compute,
    ``COMMLIB_PROGRESS=wait``, one rank), issuing early gains nothing: the layers above run
    such a group's work in the call (DDP's buckets and hooks)."""
    return group.size > 1 and lane_of(group) is not None


def _forced_lane(group) -> str:
    """The lane of an operation that must progress without a caller's ``wait()`` (a done-callback):
    :func:`lane_of`'s under ``thread``."""
    layout = getattr(group.resources, "layout", None)
    return choose_lane("thread", layout is not None and len(layout.hosts) > 1, 0, 1)


def shutdown() -> None:
    """Stop the progress threads (``commlib.finalize``, and at exit, before the engines finalize);
    operations nobody waited for are abandoned with their buffers. The next asynchronous
    operation starts them again."""
    _PROGRESS.stop()
    _CALLBACKS.stop()
    for work in tuple(_PENDING):
        _ABANDONED.append((work._gen, work._handles, work._keep))
    _PENDING.clear()


def set_progress(mode: str) -> str:
    """Switch how asynchronous operations advance from now on: ``"auto"``, ``"thread"`` or
    ``"wait"`` (as ``COMMLIB_PROGRESS``; bench/overlap.py compares them in one run). Returns the
    previous mode. Operations already pending keep going either way (``wait`` always completes
    them)."""
    if mode not in PROGRESS_MODES:
        raise ValueError(f"set_progress: mode {mode!r}: expected one of {PROGRESS_MODES}")
    previous, _PROGRESS.mode = _PROGRESS.mode, mode
    return previous


atexit.register(_PROGRESS.stop)
