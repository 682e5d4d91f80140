"""A group's topology across hosts: every rank describes its host, hosts are gathered and joined.

Topology is the bottom layer, so it does not call collectives itself: the caller passes
``exchange(bytes) -> list[bytes]`` (one entry per rank, in rank order), e.g. an all-gather over the
group's communicator (``commlib.group`` supplies one). Ranks on one host (same host hash) send the
same description; the first rank of each host is kept, so the result is the same on every rank.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from ..errors import arg_error
from .build import parse_cpulist
from .catalog import compose
from .formats import read_json, write_json
from .host import host_hash, host_id
from .model import Topology, TopologyError


def rank_locality(topo: Topology | None = None) -> tuple[int, int, int]:
    """This process's locality key ``(host hash, NVLink domain, NUMA node)``: the NUMA node holding
    the first CPU this process may run on; the NVLink domain of its GPU (-1 without one)."""
    numa = -1
    try:
        first = min(os.sched_getaffinity(0))
    except (AttributeError, OSError, ValueError):
        first = 0
    base = "/sys/devices/system/node"
    try:
        for entry in sorted(os.listdir(base)):
            if entry.startswith("node") and entry[4:].isdigit():
                with open(os.path.join(base, entry, "cpulist")) as f:
                    if first in parse_cpulist(f.read().strip()):
                        numa = int(entry[4:])
                        break
    except OSError:
        pass
    return (host_hash(), -1, numa)


def gather_topology(local: Topology, exchange: Callable[[bytes], list[bytes]]) -> tuple[Topology, list[int]]:
    """The group's topology: ``(cluster, host_of_rank)`` where ``host_of_rank[r]`` indexes
    ``cluster.hosts``. ``local`` is this rank's host (``discover()``)."""
    if not isinstance(local, Topology):
        raise arg_error("topology.gather_topology", "local", local, "must be a Topology",
                        "pass commlib.topology.discover()", cls=TopologyError)
    payload = json.dumps({"host": host_id(), "hash": host_hash(), "topo": write_json(local)}).encode()
    blobs = exchange(payload)
    hosts: dict[int, int] = {}
    names, topos, host_of_rank = [], [], []
    for blob in blobs:
        item = json.loads(bytes(blob).decode())
        if item["hash"] not in hosts:
            hosts[item["hash"]] = len(topos)
            topos.append(read_json(item["topo"], f"rank {len(host_of_rank)}"))
            names.append(item["host"])
        host_of_rank.append(hosts[item["hash"]])
    return compose(topos, names), host_of_rank
