"""Lifelines: which processes of this host died, known before their memory is gone.

MPI libraries move intranode messages of 8 KiB or more with one copy, the receiver reading the
sender's memory with ``process_vm_readv`` (MPICH's and Open MPI's CMA path). When the sender is
killed inside the transfer, the kernel tears its memory down while the read may still run: the
read then succeeds on fresh zero pages, MPI reports no error, and the collective completes on the
survivors with the dead rank's contribution replaced by zeros and garbage (measured: 5 wrong
all-reduce results in 60 kills of one of 3 ranks, MPICH 5.0.2; none with
``MPIR_CVAR_CH4_CMA_ENABLE=0``, which makes its intranode messages 4-7x slower).

A lifeline tells the survivors. Every rank of a host holds, for as long as it runs, a robust
process-shared mutex in a small shared segment. When a process dies the kernel walks its robust
list and marks each mutex it holds ``FUTEX_OWNER_DIED`` in ``exit_mm`` *before* it releases the
process's memory; any wrong data read from that memory therefore reached a survivor after the
mark, and a survivor that looks at the marks after each completion (one 256-byte comparison,
~0.1 µs) finds every such case. A rank that leaves cleanly (``close``) unlocks its mutex, which is
not a death.

The segment is unlinked as soon as every local rank has mapped it: nothing stays in /dev/shm,
even when a rank is killed. Without glibc's robust mutexes (or /dev/shm) there are no lifelines
and the engine runs without this check.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import threading
from typing import Callable, Sequence

__all__ = ["Lifelines", "PeerDied"]

_SLOT = 64  # one pthread_mutex_t (40 bytes on 64-bit glibc) per cache line
_OWNER_DIED = 0x40000000  # FUTEX_OWNER_DIED, set by the kernel in the mutex's futex word
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1


class PeerDied(RuntimeError):
    """A process of this host that took part in the operation died during it (its data may have
    been read as zeros). A RuntimeError: the runtime reports it as the operation's
    ``CommBackendError``, naming the op and group."""


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for name in ("pthread_mutexattr_init", "pthread_mutexattr_setpshared",
                     "pthread_mutexattr_setrobust", "pthread_mutex_init", "pthread_mutex_lock",
                     "pthread_mutex_unlock"):
            getattr(libc, name)
        return libc
    except (OSError, AttributeError):
        return None


class Lifelines:
    """The lifelines of one host's ranks of a job: slot ``i`` is held by local rank ``i``."""

    def __init__(self, mem: mmap.mmap, index: int, pids: Sequence[int], ranks: Sequence[int],
                 libc):
        self._mem, self._libc, self._index = mem, libc, index
        self.pids, self.ranks = list(pids), list(ranks)  # per slot: process id, world rank
        self._slot = {r: i for i, r in enumerate(ranks)}
        self._held = ctypes.c_char.from_buffer(mem, index * _SLOT)
        self._words = memoryview(mem).cast("I")
        self._size = len(pids) * _SLOT
        self._expected = mem[:self._size]
        self._owner = threading.get_ident()

    @classmethod
    def create(cls, index: int, count: int, pid_of: Callable[[], list[int]],
               ranks: Sequence[int], share: Callable[[str | None], str],
               barrier: Callable[[], None]) -> "Lifelines | None":
        """Collective over one host's ranks (``index`` of ``count``; ``ranks``: their world ranks
        in slot order). ``share(name)`` returns local rank 0's ``name`` on every local rank,
        ``pid_of()`` every local rank's process id, ``barrier()`` synchronizes them. None (on
        every local rank) where lifelines cannot work: no glibc robust mutexes, no /dev/shm, or
        called from a thread other than the main one (a mutex dies with the thread holding it)."""
        libc = _libc()
        usable = libc is not None and os.path.isdir("/dev/shm") \
            and threading.current_thread() is threading.main_thread()
        name = share(f"/dev/shm/commlib-{os.getpid()}-lifelines-{secrets.token_hex(4)}"
                     if index == 0 and usable else None)
        if name is None or not usable:  # rank 0 decides for the host, so all agree (usable
            return None                 # differs only with the thread, the same for all here)
        size = max(count * _SLOT, mmap.PAGESIZE)
        fd = -1
        try:
            if index == 0:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, size)
            barrier()
            if index != 0:
                fd = os.open(name, os.O_RDWR)
            mem = mmap.mmap(fd, size)
        finally:
            if fd >= 0:
                os.close(fd)
            try:
                barrier()  # every local rank has mapped it (or failed): it needs no name any more
            finally:
                if index == 0:
                    os.unlink(name)
        attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t, with room to spare
        mutex = ctypes.c_char.from_buffer(mem, index * _SLOT)
        ok = (libc.pthread_mutexattr_init(attr) == 0
              and libc.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED) == 0
              and libc.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST) == 0
              and libc.pthread_mutex_init(ctypes.byref(mutex), attr) == 0
              and libc.pthread_mutex_lock(ctypes.byref(mutex)) == 0)
        del mutex
        pids = pid_of()
        barrier()  # every mutex is held: the segment's contents are final until one dies
        if not ok:
            mem.close()
            return None
        return cls(mem, index, pids, ranks, libc)

    def watch(self, world_ranks: Sequence[int]) -> "Watch | None":
        """The check for a group whose members have these world ranks: None when no other member
        is on this host."""
        slots = [self._slot[r] for r in world_ranks if r in self._slot and
                 self._slot[r] != self._index]
        return Watch(self, slots) if slots else None

    def dead(self, slots: Sequence[int]) -> int | None:
        """The first of ``slots`` whose holder died, or None."""
        words = self._words
        for s in slots:
            if words[s * _SLOT // 4] & _OWNER_DIED:
                return s
        return None

    def close(self) -> None:
        """Leave cleanly: unlock this rank's mutex (not a death) and unmap the segment."""
        if self._mem.closed:
            return
        if threading.get_ident() == self._owner:
            self._libc.pthread_mutex_unlock(ctypes.byref(self._held))
        del self._held
        self._words.release()
        self._mem.close()


class Watch:
    """One group's check after each completion: ``check()`` raises :class:`PeerDied` when a
    member on this host died."""

    __slots__ = ("_lines", "_slots", "_mem", "_size", "_expected")

    def __init__(self, lines: Lifelines, slots: list[int]):
        self._lines, self._slots = lines, slots
        self._mem, self._size, self._expected = lines._mem, lines._size, lines._expected

    def check(self) -> None:
        mem = self._mem
        if mem.closed or mem[:self._size] == self._expected:
            return  # the latency path: nothing has changed on this host
        s = self._lines.dead(self._slots)
        if s is not None:
            lines = self._lines
            raise PeerDied(
                f"rank {lines.ranks[s]} (pid {lines.pids[s]}) on this host died during the "
                f"operation; data it was sending may have been read as zeros, so the result is "
                f"not trusted")
