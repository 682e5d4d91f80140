"""Collective algorithms over a backend's point-to-point, registered by name.

An algorithm is a generator function ``fn(ctx, *buffers)`` that posts non-blocking operations on
``ctx.backend`` and yields the list of handles it needs completed before its next step (an
algorithm that completes in one step may instead be a plain function returning that list). Buffers are
contiguous torch tensors of any shape (algorithms that slice them call ``buf.view(-1)`` first);
reductions already run in the accumulation dtype (bool arrives as uint8). Signatures per
collective::

    all_reduce(ctx, buf)                        in place
    broadcast(ctx, buf, root)                   root's buf to every rank
    reduce(ctx, buf, root)                      result in root's buf; others' buf unchanged
    all_gather(ctx, out, inp)                   out = size blocks of inp.numel(), block i from rank i
    reduce_scatter(ctx, out, inp)               inp = size blocks of out.numel(); rank i gets block i
    all_to_all(ctx, out, inp, out_counts, in_counts)
    barrier(ctx)

Adding one is a new module with ``@register_algorithm("name", "all_reduce", ...)`` on its
functions and its name in ``_MODULES``.
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import torch

from ..backends.base import Backend
from ..ops import ReduceOp

__all__ = ["Ctx", "register_algorithm", "get_algorithm", "algorithm_names", "COLLECTIVES",
           "chunk_bounds"]

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "barrier")

_MODULES = ("native", "ring", "recursive_doubling", "rabenseifner", "binomial", "shm",
            "hierarchical")

_REGISTRY: dict[str, dict[str, Callable]] = {c: {} for c in COLLECTIVES}


class Ctx(NamedTuple):
    """What an algorithm needs: the communicator, its rank and size, the message tag of this
    call (unique per call on the group), the reduction op, and whether the call may block in the
    engine (a blocking call under ``COMMLIB_TIMEOUT_MODE=abort``; engines' native collectives
    then run as their blocking variant, guarded by the watchdog)."""

    backend: Backend
    rank: int
    size: int
    tag: int
    op: ReduceOp | None
    blocking: bool = False

    def isend(self, buf: torch.Tensor, peer: int):
        return self.backend.isend(buf, peer, self.tag)

    def irecv(self, buf: torch.Tensor, peer: int):
        return self.backend.irecv(buf, peer, self.tag)


def register_algorithm(name: str, *collectives: str):
    def deco(fn):
        for c in collectives:
            if c not in _REGISTRY:
                raise ValueError(f"unknown collective {c!r}")
            _REGISTRY[c][name] = fn
        return fn

    return deco


_loaded = False


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in _MODULES:
            importlib.import_module(f"{__name__}.{module}")
        _loaded = True


def get_algorithm(collective: str, name: str) -> Callable | None:
    _load()
    return _REGISTRY[collective].get(name)


def algorithm_names(collective: str) -> list[str]:
    _load()
    return sorted(_REGISTRY[collective])


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Boundaries splitting ``n`` elements into ``parts`` contiguous chunks whose sizes differ by
    at most one (the first ``n % parts`` chunks are one longer). Length ``parts + 1``."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds
