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

from ..errors import arg_error
from .build import Builder
from .formats import load
from .host import host_id
from .model import Topology, TopologyError

# The registry lives in source_registry (re-exported here, its names' first home), so that the
# source modules, which register on import (one module each), need not import this one.
from .source_registry import DEFAULT_SOURCES, SOURCES, Source, SourceUnavailable, register_source  # noqa: F401
from . import nvml as _nvml  # noqa: F401  (registers "nvml")
from . import sysfs as _sysfs  # noqa: F401  (registers "sysfs")

log = logging.getLogger("commlib")


def discover(path=None, sources=None) -> Topology:
    """This host's topology: from ``path`` or ``COMMLIB_TOPO_FILE`` when given, else from the live
    sources (default: sysfs then NVML; each one that is unavailable is skipped and named in
    ``Topology.notes``). Raises when no source could run."""
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

