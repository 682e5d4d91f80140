"""The watchdog of ``COMMLIB_TIMEOUT_MODE=abort``.

Blocking collectives then run as the engine's own blocking call (MPI_Allreduce, ...), which no
Python code can interrupt. A daemon thread samples every group's backend: when the same
collective (same ``inflight`` name, same sequence number) is still running after the group's
timeout, it prints a ``CommTimeoutError`` naming the op, the group and the sequence number, and
ends the whole job through the backend (``MPI_Abort``), as NCCL's watchdog does in PyTorch. The
engine call releases the GIL, so the thread runs while the main thread is blocked; sampling costs
the calls nothing but two attribute writes.
"""

from __future__ import annotations

import sys
import threading
import time

__all__ = ["start", "stop"]

_thread: threading.Thread | None = None
_stop = threading.Event()


def _message(group, what: str, seq: int, limit: float) -> str:
    return (
        f"commlib.CommTimeoutError: commlib.{what}: operation #{seq} on group {group.name!r} "
        f"(size {group.size}) did not complete within {limit:g} s on rank {group.rank}; "
        f"ending the job (COMMLIB_TIMEOUT_MODE=abort). The other ranks are calling a different "
        f"operation, or one of them stopped. Fix: run with COMMLIB_DEBUG=1 to name the ranks "
        f"that disagree, raise COMMLIB_TIMEOUT if the operation is just slow, or set "
        f"COMMLIB_TIMEOUT_MODE=raise to catch the error instead.\n"
    )


def _run(groups, period: float) -> None:
    seen: dict[int, tuple] = {}  # id(group) -> ((what, seq), first time seen)
    while not _stop.wait(period):
        now = time.monotonic()
        for group in tuple(groups()):
            backend = group.backend
            # what runs blocking: a planned call or shared-memory op (the group's resources), or
            # the engine's own blocking collective (set by the engine itself)
            what = (group.resources.inflight or backend.inflight) if backend is not None else None
            if what is None or group.timeout is None:
                seen.pop(id(group), None)
                continue
            key = (what, group.seq)
            first = seen.get(id(group))
            if first is None or first[0] != key:
                seen[id(group)] = (key, now)
            elif now - first[1] >= group.timeout:
                sys.stderr.write(_message(group, what, group.seq, group.timeout))
                sys.stderr.flush()
                # Let the launcher forward the message first: MPICH's hydra kills every process
                # on an abort and drops what is still in their pipes (1 run in ~15 lost it).
                time.sleep(0.5)
                backend.abort(1)


def start(groups) -> None:
    """Start the watchdog once; ``groups()`` returns the groups to watch."""
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    timeouts = [g.timeout for g in groups() if g.timeout]
    if not timeouts:
        return
    period = max(0.05, min(1.0, min(timeouts) / 8))
    _stop.clear()
    _thread = threading.Thread(target=_run, args=(groups, period), name="commlib-watchdog",
                               daemon=True)
    _thread.start()


def stop() -> None:
    """End the watchdog (``commlib.finalize``, so also at exit): no thread of commlib may be
    running when the interpreter finalizes, nor keep the last reference to a group."""
    global _thread
    thread, _thread = _thread, None
    if thread is not None:
        _stop.set()
        thread.join(timeout=5)
