"""Algorithm choice. For now a size threshold per (backend, collective); the cost-model issue
replaces :data:`THRESHOLD_TABLE` and :func:`auto_algorithm` with a calibrated model.

Precedence: the call's ``algorithm=`` keyword > ``COMMLIB_ALGO`` (when the collective has that
algorithm) > the table.
"""

from __future__ import annotations

import logging

from .. import config
from ..algorithms import algorithm_names, get_algorithm
from ..errors import arg_error

__all__ = ["THRESHOLD_TABLE", "select", "auto_algorithm"]

log = logging.getLogger("commlib")

# (backend, collective) -> (algorithm below COMMLIB_SMALL_MSG_BYTES, algorithm at or above it);
# pairs not listed delegate to the engine. Measured on this machine kind (2 ranks, one host,
# float32 all_reduce, median of 3): the engine's own collective wins at every size on both
# engines. MPICH: see bench/all_reduce.py --algorithm. gloo, native / best point-to-point
# algorithm: 1.0 / 3.3 ms (recursive doubling) at 8 B, 1.8 / 3.1 ms (binomial) at 1 MiB,
# 26 / 44 ms (binomial) at 16 MiB. Across slow links (the tuning issue) this will change.
THRESHOLD_TABLE: dict[tuple[str, str], tuple[str, str]] = {
    ("mpi", "all_reduce"): ("native", "native"),
    ("torch", "all_reduce"): ("native", "native"),
}

# Groups with a shared-memory segment (all ranks on one host, commlib/backends/shm.py):
# collective -> ((upper size bound in bytes, exclusive; algorithm), ...) for CPU tensors, checked
# in order; sizes beyond the last bound use THRESHOLD_TABLE. Bounds are powers of two (select()
# memoizes per power-of-two bucket). Measured with bench/all_reduce.py --compare (2 ranks, float32,
# bench/results/all_reduce_shm_np2.txt): one-shot 0.2-0.4x MPI's time up to 32 KiB, two-shot
# 0.55-0.77x from 256 KiB to 16 MiB. At 4 ranks on 2 cores (bench/results/all_reduce_shm_np4.txt)
# shm wins up to 32 KiB and loses at 256 KiB and 16 MiB in that noisy run: not yet re-measured.
SHM_TABLE: dict[str, tuple[tuple[int, str], ...]] = {
    "all_reduce": ((1 << 15, "shm_oneshot"), (1 << 40, "shm_twoshot")),
    "reduce_scatter": ((1 << 40, "shm"),),
    "all_gather": ((1 << 40, "shm"),),
    "broadcast": ((1 << 40, "shm"),),
}

_memo: dict[tuple, object] = {}


def shm_algorithm(collective: str, nbytes: int) -> str | None:
    """The shared-memory algorithm for ``nbytes`` on a group with a segment, or None."""
    for bound, name in SHM_TABLE.get(collective, ()):
        if nbytes < bound:
            return name
    return None


def auto_algorithm(backend: str, collective: str, nbytes: int, size: int) -> str:
    if size == 1:
        return "native"
    small, large = THRESHOLD_TABLE.get((backend, collective), ("native", "native"))
    return small if nbytes < config.get("small_msg_bytes") else large


def select(collective: str, nbytes: int, group, algorithm: str | None, fn: str):
    """The algorithm (its generator function) that runs ``collective`` of ``nbytes`` on
    ``group``. Memoized per (collective, power-of-two size bucket, group)."""
    if algorithm is not None:
        chosen = get_algorithm(collective, algorithm)
        if chosen is None:
            raise arg_error(fn, "algorithm", algorithm,
                            f"{collective} has no such algorithm",
                            f"use one of {algorithm_names(collective)} or None for automatic")
        return chosen
    key = (collective, nbytes.bit_length(), id(group))
    chosen = _memo.get(key)
    if chosen is None:
        forced = config.get("algo")
        if forced is not None and get_algorithm(collective, forced) is not None:
            name, why = forced, "COMMLIB_ALGO"
        else:
            name = shm_algorithm(collective, nbytes) if group.shm is not None else None
            why = "shared memory, SHM_TABLE"
            if name is None:
                name = auto_algorithm(group.backend.name, collective, nbytes, group.size)
                why = "size threshold"
        chosen = _memo[key] = get_algorithm(collective, name)
        log.info("%s of %d bytes on group %s: algorithm %s (%s)", collective, nbytes, group.name,
                 name, why)
    return chosen


def clear_cache() -> None:
    _memo.clear()
