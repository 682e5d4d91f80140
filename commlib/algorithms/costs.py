"""Shared pieces of the algorithms' cost formulas (the α-β-γ model of docs/tuning.md).

A formula gets ``p`` ranks, ``n`` bytes and a ``link``: ``link.step(m)`` is one point-to-point step
of ``m`` bytes (``α + mβ``, or the calibrated step curve), ``link.gamma`` the seconds per byte
reduced locally, ``link.alpha`` and ``link.beta`` the line itself."""

from __future__ import annotations

import math

__all__ = ["doubling_shape", "ceil_log2", "halving"]


def doubling_shape(p: int) -> tuple[int, int, int]:
    """(p2, log2 p2, f): the largest power of two <= p, its log, and 1 when p is not a power of
    two (the doubling algorithms' fold, commlib/algorithms/_fold.py)."""
    p2 = 1 << (p.bit_length() - 1)
    return p2, int(math.log2(p2)), int(p != p2)


def ceil_log2(p: int) -> int:
    return (p - 1).bit_length()


def halving(k: int, n: float, link) -> float:
    """The recursive-halving (or, reversed, doubling) steps: messages n/2, n/4, ... n/2^k."""
    return sum(link.step(n / (1 << i)) for i in range(1, k + 1))
