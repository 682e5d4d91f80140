"""A group's topology gathered across (virtual) hosts, and a topology-aware mesh.

Run with MPMD so that ranks get different ``COMMLIB_TEST_HOST`` values; the layout (one letter per
rank) is the first argument: ``mpiexec -n 1 -env COMMLIB_TEST_HOST a python topology_gather.py
a,b,a,b : -n 1 -env COMMLIB_TEST_HOST b ...``.
"""

import hashlib
import os
import sys

import torch
from _harness import main

import commlib
from commlib.topology import discover, gather_topology

LAYOUT = sys.argv.pop(1).split(",")


def exchange(blob: bytes) -> list[bytes]:
    """All-gather variable-length bytes over the world (lengths first, then padded payloads)."""
    n = commlib.get_world_size()
    size = torch.tensor([len(blob)], dtype=torch.int64)
    sizes = torch.empty(n, dtype=torch.int64)
    commlib.all_gather_into_tensor(sizes, size)
    width = int(sizes.max())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = torch.empty(n * width, dtype=torch.uint8)
    commlib.all_gather_into_tensor(out, mine)
    return [bytes(out[r * width:r * width + int(sizes[r])].tolist()) for r in range(n)]


def case_gather_across_hosts():
    rank = commlib.get_rank()
    assert os.environ["COMMLIB_TEST_HOST"] == LAYOUT[rank]
    local = discover()
    topo, host_of_rank = gather_topology(local, exchange)
    letters = sorted(set(LAYOUT))
    assert len(topo.hosts) == len(letters)
    assert topo.hosts == [f"test:{x}" for x in dict.fromkeys(LAYOUT)]
    for r, letter in enumerate(LAYOUT):
        assert topo.hosts[host_of_rank[r]] == f"test:{letter}"
    assert len(topo.nics) == len(letters) * len(local.nics)
    assert len(topo.cpus) == len(letters) * len(local.cpus)
    a, b = topo.cpus[0], topo.cpus[-1]
    assert topo.path_type(a, b) == "NET"
    if local.nics:  # hosts joined through rail 0
        assert topo.path(a, b)[1][len(topo.path(a, b)[1]) // 2].startswith("NET/rail")
    digest = hashlib.sha256(topo.to_json().encode()).digest()
    assert len(set(exchange(digest))) == 1, "ranks gathered different topologies"


def case_mesh_from_topology():
    rank = commlib.get_rank()
    n = commlib.get_world_size()
    hosts = list(dict.fromkeys(LAYOUT))
    per_host = n // len(hosts)
    mesh = commlib.Mesh.from_topology((len(hosts), per_host), ("dp", "tp"))
    inner = mesh.group("tp").ranks
    assert sorted(inner) == [r for r in range(n) if LAYOUT[r] == LAYOUT[rank]]
    assert mesh.levels[1] != "network" and mesh.levels[0] == "network"
    outer = mesh.group("dp").ranks
    assert len({LAYOUT[r] for r in outer}) == len(hosts)
    t = torch.tensor([float(rank)])
    commlib.all_reduce(t, group=mesh.group("tp"))
    assert t.item() == sum(r for r in range(n) if LAYOUT[r] == LAYOUT[rank])


if __name__ == "__main__":
    main(globals())
