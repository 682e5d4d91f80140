"""CPU affinity: each rank of a host on its own share of the host's cores.

Unbound, the scheduler moves ranks between cores; when ranks wait for one another (every
collective does), a rank that lost its core delays all of them. With more ranks than cores the
cost is large: the same 1 MiB two-shot all-reduce at 4 ranks on 2 cores took ~230 or ~900 µs a
call for a whole run depending on how the ranks happened to start, ~265 µs every time bound
(docs/shm.md). Launchers bind only when asked (MPICH's ``-bind-to core``; torchrun never), so
commlib binds the ranks it finds unbound.

The decision is :func:`plan`, a pure function of the host's cores and the rank's place among the
host's ranks; :func:`cores` reads the cores (sysfs), :func:`bind` and :func:`restore` apply and undo
it. The collective part (which ranks share a host, and whether they were bound already) is
``commlib.runtime.affinity``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["plan", "cores", "bind", "restore", "host_cpu_count"]

# The mask the process had before commlib bound it (absent: not bound).
_saved: dict = {}


def plan(units: Sequence[Sequence[int]], local_rank: int, local_size: int) -> tuple[int, ...]:
    """The CPUs for rank ``local_rank`` of ``local_size`` ranks sharing ``units`` (the host's
    cores, each the tuple of its hardware threads, in an order that keeps neighbours close).

    With at least one core per rank, rank k gets the ``len(units) // local_size`` cores from
    ``k * that``: a contiguous share, every hardware thread of it (cores left over by the
    division stay unused rather than given to some ranks only). With more ranks than cores, rank
    k gets core ``k % len(units)``: ranks on one core take turns, ranks on different cores run
    at once, as ``mpiexec -bind-to core`` places them."""
    if not units:
        raise ValueError("plan(): no cores")
    if not 0 <= local_rank < local_size:
        raise ValueError(f"plan(): local_rank {local_rank} not in 0..{local_size - 1}")
    per = len(units) // local_size
    if per == 0:
        return tuple(units[local_rank % len(units)])
    return tuple(cpu for unit in units[local_rank * per:(local_rank + 1) * per] for cpu in unit)


def cores(allowed: Sequence[int], root: str = "/sys") -> list[tuple[int, ...]]:
    """The physical cores among the CPUs ``allowed``: each the sorted tuple of its hardware
    threads (sysfs ``topology/physical_package_id`` and ``core_id``), ordered by (package,
    core). A CPU whose topology sysfs does not say is a core of its own."""
    groups: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(allowed):
        base = os.path.join(root, f"devices/system/cpu/cpu{cpu}/topology")
        try:
            with open(os.path.join(base, "physical_package_id")) as f:
                package = int(f.read())
            with open(os.path.join(base, "core_id")) as f:
                core = int(f.read())
        except (OSError, ValueError):
            package, core = -1, cpu
        groups.setdefault((package, core), []).append(cpu)
    return [tuple(v) for _, v in sorted(groups.items(), key=lambda kv: (kv[0], kv[1][0]))]


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _set_every_thread(cpus) -> None:
    """Bind every thread of this process to ``cpus`` (Linux sets affinity per thread)."""
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that exited meanwhile
            pass


def bind(cpus: Sequence[int]) -> None:
    """Bind every thread of this process to ``cpus`` (threads started later inherit it),
    remembering the mask to :func:`restore`."""
    _saved.setdefault("mask", os.sched_getaffinity(0))
    _set_every_thread(cpus)


def restore() -> None:
    """Undo :func:`bind`: every thread back on the mask the process had."""
    mask = _saved.pop("mask", None)
    if mask is not None:
        _set_every_thread(mask)


def host_cpu_count() -> int:
    """The CPUs this process could use before commlib bound it (the share of the host its ranks
    run on): what waiting policies and progress threads compare the host's rank count with."""
    mask = _saved.get("mask")
    if mask is None:
        try:
            mask = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            return os.cpu_count() or 1
    return len(mask)
