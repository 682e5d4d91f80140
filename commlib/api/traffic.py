"""A process-wide counter of the bytes this rank sends through the layers above the collectives
(``commlib.nn``'s parallel layers, ``commlib.reshard``), each in its layer's logical convention:
``with commlib.nn.functional.traffic() as t: ...`` then ``t.sent`` and ``t.by_kind``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

__all__ = ["Traffic", "traffic", "count"]


@dataclass
class Traffic:
    """``sent``: bytes this rank sent inside the ``with`` block; ``by_kind``: per collective."""
    sent: int = 0
    by_kind: dict = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.sent += nbytes
        self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes


_ACTIVE: list[Traffic] = []  # process-wide: autograd may run backward on another thread


@contextlib.contextmanager
def traffic():
    """Count the bytes this rank sends through the layers above the collectives (commlib.nn,
    commlib.reshard) inside the block."""
    t = Traffic()
    _ACTIVE.append(t)
    try:
        yield t
    finally:
        _ACTIVE.remove(t)


def count(kind: str, nbytes: int) -> None:
    """Add ``nbytes`` of ``kind`` to every counter open in this process."""
    for t in _ACTIVE:
        t.add(kind, nbytes)
