"""Sequence layouts: which chunks of the global sequence each rank of a sequence-parallel group holds.

A layout cuts the global sequence into ``chunks_per_rank * N`` equal chunks and gives rank r the
chunks ``chunks(r, N)``, concatenated in that order (each list ascending, so a causal mask inside a
rank's own block is the ordinary lower triangle):

* ``contiguous``: N chunks, rank r holds chunk r.
* ``zigzag``: 2N chunks, rank r holds chunks r and 2N-1-r. Under a causal mask every rank then
  does the same amount of work (the early chunk sees few keys, the late one many).

Adding a layout is one registration in :data:`LAYOUTS`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["Layout", "LAYOUTS", "layout_of", "global_chunks", "positions", "gather_order"]


class Layout(NamedTuple):
    name: str
    chunks_per_rank: int
    chunks: Callable[[int, int], tuple[int, ...]]  # (rank, size) -> global chunk indices, in order


LAYOUTS: dict[str, Layout] = {
    "contiguous": Layout("contiguous", 1, lambda r, n: (r,)),
    "zigzag": Layout("zigzag", 2, lambda r, n: (r, 2 * n - 1 - r)),
}


def layout_of(name: str) -> Layout:
    return LAYOUTS[name]


def global_chunks(layout: str, rank: int, size: int) -> tuple[int, ...]:
    return LAYOUTS[layout].chunks(rank, size)


def positions(layout: str, rank: int, size: int, seq_local: int) -> torch.Tensor:
    """Global token positions of rank ``rank``'s ``seq_local`` tokens (int64)."""
    chunks = global_chunks(layout, rank, size)
    c = seq_local // len(chunks)
    return torch.cat([torch.arange(g * c, (g + 1) * c) for g in chunks])


def gather_order(layout: str, size: int) -> list[int]:
    """For the rank-ordered concatenation of every rank's chunks, the global chunk index of each
    slot: slot i of the gathered tensor holds global chunk ``gather_order[i]``."""
    return [g for r in range(size) for g in global_chunks(layout, r, size)]
