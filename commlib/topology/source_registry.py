"""The registry of live topology sources: :func:`register_source` and :data:`SOURCES`.

Kept apart from :mod:`commlib.topology.sources`, which runs the sources (``discover``), so that the
source modules (``sysfs.py``, ``nvml.py``) register here and ``sources`` imports them without an
import circle. ``commlib.topology.sources`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .build import Builder

__all__ = ["Source", "SOURCES", "DEFAULT_SOURCES", "SourceUnavailable", "register_source"]


class SourceUnavailable(Exception):
    """A source cannot run here; the message says why (no package, no driver, no sysfs)."""


@dataclass(frozen=True)
class Source:
    name: str
    contribute: Callable[[Builder], None]
    doc: str


SOURCES: dict[str, Source] = {}
DEFAULT_SOURCES = ("sysfs", "nvml")


def register_source(name: str, doc: str = ""):
    def deco(fn):
        SOURCES[name] = Source(name, fn, doc or (fn.__doc__ or "").strip().splitlines()[0])
        return fn
    return deco
