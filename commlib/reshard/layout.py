"""Where the pieces of a tensor live: placements and layouts in DTensor's vocabulary.

A :class:`Layout` is a mesh of world ranks (an N-D array of ranks, or a ``commlib.Mesh``) and one
placement per mesh dimension: :class:`Shard` (the tensor dimension ``dim`` is split along that
mesh dimension), :class:`Replicate` (every rank along it holds the same piece) or
:class:`Partial` (the tensor is the *sum* over that mesh dimension; sources only).

Shards follow ``torch.chunk`` and DTensor: a dimension of n elements split in k takes chunks of
``ceil(n / k)``, so the trailing shards may be smaller or empty. A tensor dimension sharded by
several mesh dimensions is split in mesh-dimension order: first by the lower mesh dimension, then
each piece by the next. Pure: nothing here communicates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from commlib.api.groups import Mesh, _unravel
from commlib.errors import CommTypeError, arg_error

__all__ = ["Shard", "Replicate", "Partial", "Layout", "chunk"]

Box = tuple[tuple[int, int], ...]  # (lo, hi) per tensor dimension


@dataclass(frozen=True)
class Shard:
    """The tensor's dimension ``dim`` is split along this mesh dimension."""
    dim: int

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank along this mesh dimension holds the same piece."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    """The tensor is the sum of the pieces along this mesh dimension (a source placement)."""
    reduce_op: str = "sum"

    def __repr__(self) -> str:
        return f'Partial("{self.reduce_op}")'


def chunk(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """Piece ``index`` of ``[lo, hi)`` cut in ``parts`` as ``torch.chunk`` cuts: chunks of
    ceil(n / parts), the trailing ones smaller or empty."""
    n = hi - lo
    size = -(-n // parts) if n else 0
    return lo + min(index * size, n), lo + min((index + 1) * size, n)


def _mesh_ranks(fn: str, arg: str, ranks) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, flat row-major world ranks) of a nested list / array / tensor / Mesh."""
    if isinstance(ranks, Mesh):
        order = [ranks.rank_at(_unravel(i, ranks.shape)) for i in range(math.prod(ranks.shape))]
        return tuple(ranks.shape), tuple(order)
    try:
        t = torch.as_tensor(ranks.tolist() if hasattr(ranks, "tolist") else ranks)
    except (TypeError, ValueError, RuntimeError):
        raise arg_error(fn, arg, ranks, "must be a nested list (or array) of world ranks with a "
                        "regular shape, or a commlib.Mesh",
                        "pass e.g. [[0, 1], [2, 3]] for a 2x2 mesh", CommTypeError) from None
    if t.dim() == 0 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise arg_error(fn, arg, ranks, "must be a non-empty nested list of integer world ranks",
                        "pass e.g. [0, 1] or [[0, 1], [2, 3]]", CommTypeError)
    flat = tuple(int(r) for r in t.flatten().tolist())
    if len(set(flat)) != len(flat) or min(flat) < 0:
        raise arg_error(fn, arg, ranks, "must list distinct non-negative world ranks",
                        "list each rank of the mesh once")
    return tuple(t.shape), flat


class Layout:
    """A tensor's layout: ``ranks`` (an N-D nested list / array of world ranks, or a
    ``commlib.Mesh``) and one placement per mesh dimension.

    >>> Layout([[0, 1], [2, 3]], [Shard(0), Replicate()])   # rows split over mesh rows
    """

    def __init__(self, ranks, placements: Sequence):
        fn = "reshard.Layout"
        self.shape, self.ranks = _mesh_ranks(fn, "ranks", ranks)
        if isinstance(placements, (Shard, Replicate, Partial)):
            placements = [placements]
        try:
            placements = tuple(placements)
        except TypeError:
            raise arg_error(fn, "placements", placements, "must be a sequence of placements",
                            f"pass one of Shard(d), Replicate(), Partial() per mesh dimension "
                            f"({len(self.shape)})", CommTypeError) from None
        if len(placements) != len(self.shape):
            raise arg_error(fn, "placements", list(placements),
                            f"has {len(placements)} entries for a {len(self.shape)}-dimensional "
                            f"mesh of shape {self.shape}",
                            "give one placement per mesh dimension")
        for p in placements:
            if not isinstance(p, (Shard, Replicate, Partial)):
                raise arg_error(fn, "placements", list(placements),
                                f"holds {p!r}, not Shard(d), Replicate() or Partial()",
                                "use commlib.reshard.Shard / Replicate / Partial", CommTypeError)
            if isinstance(p, Shard) and (not isinstance(p.dim, int) or p.dim < 0):
                raise arg_error(fn, "placements", list(placements),
                                f"holds Shard({p.dim!r}): the dimension must be an int >= 0",
                                "pass Shard(d) with d a tensor dimension (0, 1, ...)")
            if isinstance(p, Partial) and p.reduce_op != "sum":
                raise arg_error(fn, "placements", list(placements),
                                f'holds Partial("{p.reduce_op}"): only "sum" is supported',
                                'use Partial("sum")')
        self.placements = placements
        self._index = {r: i for i, r in enumerate(self.ranks)}

    # ----- facts ---------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, ...] | None:
        i = self._index.get(rank)
        return None if i is None else _unravel(i, self.shape)

    def __contains__(self, rank: int) -> bool:
        return rank in self._index

    @property
    def partial_dims(self) -> tuple[int, ...]:
        return tuple(d for d, p in enumerate(self.placements) if isinstance(p, Partial))

    def check(self, fn: str, arg: str, ndim: int | None, *, source: bool) -> None:
        """Placements that fit a tensor of ``ndim`` dimensions (None: not known yet) and no
        Partial unless a source."""
        for p in self.placements:
            if isinstance(p, Shard) and ndim is not None and p.dim >= ndim:
                raise arg_error(fn, arg, self, f"shards dimension {p.dim} of a {ndim}-dimensional "
                                "tensor", f"use Shard(d) with d < {ndim}")
            if isinstance(p, Partial) and not source:
                raise arg_error(fn, arg, self, "has a Partial placement: a destination holds "
                                "values, not partial sums",
                                "use Replicate() (the sum on every rank) or Shard(d)")

    def box(self, rank: int, global_shape: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
        """The index range ``(lo, hi)`` per tensor dimension that ``rank`` holds, or None when it
        is not in the layout."""
        c = self.coords(rank)
        if c is None:
            return None
        box = [(0, int(n)) for n in global_shape]
        for d, p in enumerate(self.placements):  # mesh-dimension order: nested splits
            if isinstance(p, Shard):
                lo, hi = box[p.dim]
                box[p.dim] = chunk(lo, hi, self.shape[d], c[d])
        return tuple(box)

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor | None:
        """``rank``'s piece of the ``full`` tensor (a copy): its box; along Partial mesh dimensions
        the whole value at coordinate 0 and zeros elsewhere (one way to split a sum)."""
        box = self.box(rank, full.shape)
        if box is None:
            return None
        piece = full[tuple(slice(lo, hi) for lo, hi in box)].clone()
        c = self.coords(rank)
        if any(c[d] for d in self.partial_dims):
            piece.zero_()
        return piece

    def key(self) -> tuple:
        return (self.shape, self.ranks, self.placements)

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        mesh = "x".join(map(str, self.shape))
        return f"Layout({mesh} ranks={list(self.ranks)}, {list(self.placements)})"
