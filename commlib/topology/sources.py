"""Live topology sources, registered by name; :func:`discover` runs them.

A source contributes to one :class:`~commlib.topology.build.Builder`: ``sysfs`` lays down NUMA
nodes, CPUs and the PCI tree with GPUs and NICs; ``nvml`` adds (or, alone, creates) GPUs with
NVLinks, compute capability, P2P status and PCIe state. Each works alone; together, NVML's GPUs are
matched to sysfs's by bus id. ``COMMLIB_TOPO_FILE`` (or ``discover(path=...)``) replaces the live
sources with a file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from ..errors import arg_error
from .build import Builder
from .host import host_id
from .model import Topology, TopologyError

log = logging.getLogger("commlib")


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


def discover(path=None, sources=None) -> Topology:
    """This host's topology: from ``path`` or ``COMMLIB_TOPO_FILE`` when given, else from the live
    sources (default: sysfs then NVML; each one that is unavailable is skipped and named in
    ``Topology.notes``). Raises when no source could run."""
    from .formats import load

    path = path or os.environ.get("COMMLIB_TOPO_FILE") or None
    if path:
        topo = load(path)
        log.info("commlib topology: from file %s (%s)", path, topo.source)
        return topo
    names = tuple(sources) if sources is not None else DEFAULT_SOURCES
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise arg_error("topology.discover", "sources", names, f"{unknown} are not registered sources",
                        f"use names from {sorted(SOURCES)}", cls=TopologyError)
    b = Builder("live:" + "+".join(names))
    used, skipped = [], []
    for name in names:
        try:
            SOURCES[name].contribute(b)
            used.append(name)
        except SourceUnavailable as exc:
            skipped.append(f"{name}: {exc}")
    if not used:
        raise TopologyError("commlib.topology.discover(): no topology source could run here ("
                            + "; ".join(skipped) + "). Fix: set COMMLIB_TOPO_FILE to a topology file "
                            "(see topology/ for real systems' files)")
    for s in skipped:
        b.note("source-unavailable", s)
    b.source = "live:" + "+".join(used)
    topo = b.finish(hosts=[host_id()])
    log.info("commlib topology: %r (skipped: %s)", topo, "; ".join(skipped) or "none")
    return topo


# Sources register on import (one file each).
from . import nvml as _nvml  # noqa: E402,F401
from . import sysfs as _sysfs  # noqa: E402,F401
