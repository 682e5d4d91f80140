"""Binding the ranks of each host at ``commlib.init`` (``COMMLIB_AFFINITY``; the decision and the
system calls are :mod:`commlib.topology.affinity`).

Collective over the world: one all-gather of every rank's host and CPU mask. On a host whose ranks
all have the same mask of more than one CPU, nobody bound them (a container's cpuset is the same
mask for all); a launcher that binds gives each rank a different mask, or one CPU. Only the first
case is bound, each rank to :func:`commlib.topology.affinity.plan`'s share.
"""

from __future__ import annotations

import os
import zlib

import torch

from .. import config
from ..topology import affinity
from ..topology.host import host_hash

__all__ = ["apply", "release", "decide"]


def decide(rows, rank: int) -> tuple[int, int] | str:
    """From every rank's ``(host hash, mask key, mask size)`` (``rows``, indexed by rank):
    ``(local_rank, local_size)`` of ``rank`` among its host's ranks when they are to be bound,
    else why not."""
    host, key, size = rows[rank]
    mine = [r for r, row in enumerate(rows) if row[0] == host]
    if len(mine) == 1:
        return "the host's only rank"
    if size <= 1:
        return "bound to one CPU already"
    if any(rows[r][1] != key for r in mine):
        return "the host's ranks have different CPU masks (bound by the launcher)"
    return mine.index(rank), len(mine)


def apply(engine) -> str:
    """Collective over ``engine`` (the world's, before its group is built, so that the cost
    model's probe and the waiting policies see the binding): bind this rank if its host's ranks
    are unbound and ``COMMLIB_AFFINITY`` is ``auto``. Returns what was done, for the log."""
    if not hasattr(os, "sched_setaffinity"):  # not Linux: every rank of the job returns here
        return "not bound: no CPU affinity calls on this platform"
    mask = sorted(os.sched_getaffinity(0))
    key = zlib.crc32(",".join(map(str, mask)).encode())
    # gathered whatever COMMLIB_AFFINITY says: a rank whose environment differs still matches
    rows = engine.all_gather_ints([host_hash(), key, len(mask)])
    if config.get("affinity") == "off":
        return "not bound: COMMLIB_AFFINITY=off"
    place = decide(rows, engine.rank)
    if isinstance(place, str):
        return f"not bound: {place}"
    cpus = affinity.plan(affinity.cores(mask), *place)
    affinity.bind(cpus)
    # torch's intra-op threads follow the share, unless the user chose their number
    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > len(cpus):
        _threads_before[0] = torch.get_num_threads()
        torch.set_num_threads(len(cpus))
    return f"bound to CPUs {list(cpus)} (rank {place[0]} of {place[1]} on this host)"


_threads_before = [None]  # torch's intra-op thread count before apply() limited it


def release() -> None:
    """Undo :func:`apply` (``commlib.finalize``): the mask and torch's thread count."""
    affinity.restore()
    if _threads_before[0] is not None:
        torch.set_num_threads(_threads_before[0])
        _threads_before[0] = None
