"""Plans from the graph: rings, double binary trees, the node hierarchy and a mesh's rank order.

Every planner is a pure function of its inputs (same topology, same plan on every rank). Searches
are bounded by a step budget, as NCCL's are (``NCCL_SEARCH_TIMEOUT`` counts steps, not seconds),
so that the bound cannot make ranks disagree; a plan found without exhausting the search says
``degraded=True`` and why.

Ring quality is the ring's bandwidth with shared links accounted for: each hop follows the best
path between its two GPUs, a link crossed by k hops in the same direction gives each 1/k of its
bandwidth, and the ring runs at the slowest hop. Ties go to the ring whose hops have the better
path classes (fewer PCIe bridges, no CPU crossings), then to the lexicographically first order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx

from ..errors import arg_error
from .model import PATH_RANK, Topology, TopologyError, register_operation

DEFAULT_BUDGET = 1 << 17
EPS = 1e-9


@dataclass
class RingPlan:
    """``order``: GPU indices (into ``topo.gpus``) in ring order; ``bandwidth``: GB/s per direction
    the ring sustains; ``hops``: ``(from, to, path class, GB/s)``; ``crossings``: for multi-host
    rings, ``(host, NIC out, host, NIC in)`` per host boundary; ``degraded``/``reason``."""
    order: list[int]
    bandwidth: float
    hops: list[tuple[int, int, str, float]]
    degraded: bool = False
    reason: str = ""
    steps: int = 0
    crossings: list[tuple] = field(default_factory=list)

    def __str__(self) -> str:
        kinds = sorted({h[2] for h in self.hops})
        s = f"ring {' -> '.join(map(str, self.order))} -> {self.order[0] if self.order else ''}: " \
            f"{self.bandwidth:.1f} GB/s, hops {'/'.join(kinds)}"
        if self.crossings:
            s += f", NICs {self.crossings}"
        if self.degraded:
            s += f" [degraded: {self.reason}]"
        return s


class _Hops:
    """Directed links of the best path between GPU pairs, and their capacities."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.cache: dict[tuple[str, str], tuple[int, list[tuple[str, str]]]] = {}

    def get(self, a: str, b: str):
        key = (a, b)
        if key not in self.cache:
            kind, nodes = self.topo.path(a, b)
            self.cache[key] = (PATH_RANK[kind], list(zip(nodes, nodes[1:])), kind)
        return self.cache[key]

    def cap(self, u: str, v: str) -> float:
        return self.topo.graph.edges[u, v]["bw"]


def _ring_value(hops: _Hops, seq: list[tuple[str, str]]) -> float:
    loads: dict[tuple[str, str], int] = {}
    for a, b in seq:
        for link in hops.get(a, b)[1]:
            loads[link] = loads.get(link, 0) + 1
    return min((hops.cap(*link) / k for link, k in loads.items()), default=float("inf"))


def _search_cycle(topo: Topology, nodes: list[str], budget: int):
    """Best Hamiltonian cycle over ``nodes`` (branch and bound). Returns (order, value, steps,
    exhausted)."""
    n = len(nodes)
    hops = _Hops(topo)
    if n <= 2:
        seq = [(nodes[i], nodes[(i + 1) % n]) for i in range(n)] if n == 2 else []
        return list(range(n)), (_ring_value(hops, seq) if seq else float("inf")), 0, True
    cand = {}
    for i in range(n):
        others = [j for j in range(n) if j != i]
        others.sort(key=lambda j: (hops.get(nodes[i], nodes[j])[0], -topo.bandwidth(nodes[i], nodes[j]), j))
        cand[i] = others
    min_rank = min(hops.get(nodes[i], nodes[j])[0] for i in range(n) for j in range(n) if i != j)
    best = {"order": None, "value": -1.0, "rank": 1 << 30}
    steps = 0
    exhausted = True
    loads: dict[tuple[str, str], int] = {}
    path = [0]
    used = [False] * n
    used[0] = True

    def value_now():
        return min((hops.cap(*link) / k for link, k in loads.items()), default=float("inf"))

    def push(a, b):
        for link in hops.get(nodes[a], nodes[b])[1]:
            loads[link] = loads.get(link, 0) + 1

    def pop(a, b):
        for link in hops.get(nodes[a], nodes[b])[1]:
            loads[link] -= 1
            if not loads[link]:
                del loads[link]

    def better(value, rank):
        if value > best["value"] + EPS:
            return True
        return abs(value - best["value"]) <= EPS and rank < best["rank"]

    def dfs(rank_sum):
        nonlocal steps, exhausted
        steps += 1
        if steps > budget:
            exhausted = False
            return
        v = value_now()
        if best["order"] is not None:
            remaining = n - len(path) + 1
            if v < best["value"] - EPS:
                return
            if abs(v - best["value"]) <= EPS and rank_sum + remaining * min_rank >= best["rank"]:
                return
        last = path[-1]
        if len(path) == n:
            push(last, 0)
            total = rank_sum + hops.get(nodes[last], nodes[0])[0]
            val = value_now()
            if better(val, total):
                best.update(order=list(path), value=val, rank=total)
            pop(last, 0)
            return
        for j in cand[last]:
            if used[j]:
                continue
            used[j] = True
            path.append(j)
            push(last, j)
            dfs(rank_sum + hops.get(nodes[last], nodes[j])[0])
            pop(last, j)
            path.pop()
            used[j] = False
            if steps > budget:
                return

    dfs(0)
    if best["order"] is None:
        return list(range(n)), _ring_value(hops, [(nodes[i], nodes[(i + 1) % n]) for i in range(n)]), steps, False
    return best["order"], best["value"], steps, exhausted


def _check_budget(budget) -> int:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise arg_error("Topology.ring", "budget", budget, "must be a positive int (search steps)",
                        f"pass e.g. {DEFAULT_BUDGET}", cls=TopologyError)
    return budget


@register_operation("plan_ring")
def plan_ring(topo: Topology, budget: int = DEFAULT_BUDGET) -> RingPlan:
    """The ring over all GPUs of ``topo`` that maximizes the bandwidth the ring sustains.

    On one host: branch and bound over GPU orders. Across hosts: each host's best cycle is cut
    where both ends are nearest to the same NIC index (rail), and hosts are chained through that
    rail's NICs, so every host boundary stays on one rail.
    """
    budget = _check_budget(budget)
    if not topo.gpus:
        raise arg_error("Topology.ring", "topology", topo, "has no GPUs to put in a ring",
                        "load a topology with GPUs (e.g. commlib.topology.load_catalog('dgx-a100'))",
                        cls=TopologyError)
    hosts = sorted({topo.host_of(g) for g in topo.gpus})
    index = {g: i for i, g in enumerate(topo.gpus)}
    if len(hosts) == 1:
        order, value, steps, exhausted = _search_cycle(topo, topo.gpus, budget)
        glob = [topo.gpus[i] for i in order]
        return _finish(topo, glob, index, steps, exhausted, budget)
    chains, crossings, steps, exhausted = [], [], 0, True
    per_host = {h: [g for g in topo.gpus if topo.host_of(g) == h] for h in hosts}
    cycles = {}
    for h in hosts:
        order, _v, s, ex = _search_cycle(topo, per_host[h], budget)
        cycles[h] = [per_host[h][i] for i in order]
        steps += s
        exhausted &= ex
    rail = _choose_rail(topo, cycles)
    for h in hosts:
        chains.append(_cut(topo, cycles[h], rail))
    glob = [g for c in chains for g in c]
    for k, h in enumerate(hosts):
        nxt = hosts[(k + 1) % len(hosts)]
        crossings.append((topo.hosts[h], _rail_nic(topo, h, rail), topo.hosts[nxt], _rail_nic(topo, nxt, rail)))
    plan = _finish(topo, glob, index, steps, exhausted, budget, rail)
    plan.crossings = crossings
    return plan


def _finish(topo, glob, index, steps, exhausted, budget, rail=None) -> RingPlan:
    hops = _Hops(topo)
    seq = list(zip(glob, glob[1:] + glob[:1])) if len(glob) > 1 else []
    paths = {}
    for a, b in seq:
        paths[(a, b)] = _hop_path(topo, a, b, rail)
    loads: dict[tuple[str, str], int] = {}
    for nodes in paths.values():
        for link in zip(nodes, nodes[1:]):
            loads[link] = loads.get(link, 0) + 1
    value = min((hops.cap(*lk) / k for lk, k in loads.items()), default=float("inf"))
    hop_list = []
    for a, b in seq:
        nodes = paths[(a, b)]
        bw = min(hops.cap(u, v) / loads[(u, v)] for u, v in zip(nodes, nodes[1:]))
        hop_list.append((index[a], index[b], topo.path_type(a, b), round(bw, 3)))
    reason = "" if exhausted else f"search stopped after {steps} steps (budget {budget}); best ring so far"
    return RingPlan([index[g] for g in glob], round(value, 3), hop_list, not exhausted, reason, steps)


def _hop_path(topo: Topology, a: str, b: str, rail) -> list[str]:
    if topo.host_of(a) == topo.host_of(b) or rail is None:
        return topo.path(a, b)[1]
    na, nb = _rail_nic(topo, topo.host_of(a), rail), _rail_nic(topo, topo.host_of(b), rail)
    net = next(x for x in topo.graph[na] if topo.graph.nodes[x]["kind"] == "NET")
    return topo.path(a, na)[1] + [net] + topo.path(nb, b)[1]


def _local_nics(topo: Topology, h: int) -> list[str]:
    return [n for n in topo.nics if topo.host_of(n) == h]


def _rail_nic(topo: Topology, h: int, rail: int) -> str:
    nics = _local_nics(topo, h)
    return nics[rail % len(nics)]


def _choose_rail(topo: Topology, cycles: dict) -> int:
    """The NIC index whose NIC is closest to some adjacent GPU pair of every host's ring."""
    counts = [len(_local_nics(topo, h)) for h in cycles]
    if not counts or min(counts) == 0:
        raise arg_error("Topology.ring", "topology", topo, "has a host without NICs in a multi-host ring",
                        "compose hosts that have NICs (commlib.topology.compose)", cls=TopologyError)
    best = None
    for r in range(min(counts)):
        score = 0
        for h, cyc in cycles.items():
            nic = _rail_nic(topo, h, r)
            score += min(_cut_cost(topo, cyc, k, nic) for k in range(len(cyc)))[0]
        if best is None or score < best[0]:
            best = (score, r)
    return best[1]


def _cut_cost(topo, cyc, k, nic):
    first, last = cyc[k], cyc[k - 1]
    worst = max(PATH_RANK[topo.path_type(first, nic)], PATH_RANK[topo.path_type(last, nic)])
    return worst, -min(topo.bandwidth(first, nic), topo.bandwidth(last, nic)), k


def _cut(topo, cyc, rail):
    nic = _rail_nic(topo, topo.host_of(cyc[0]), rail)
    k = min(range(len(cyc)), key=lambda k: _cut_cost(topo, cyc, k, nic))
    return cyc[k:] + cyc[:k]


# --- trees ---------------------------------------------------------------------------------------

def _btree(n: int, r: int):
    """NCCL's ncclGetBtree: (parent, [children]) of rank r in a binary tree over n ranks."""
    bit = 1
    while bit < n:
        if bit & r:
            break
        bit <<= 1
    if r == 0:
        return -1, ([bit >> 1] if n > 1 else [])
    up = (r ^ bit) | (bit << 1)
    if up >= n:
        up = r ^ bit
    low = bit >> 1
    d0 = -1 if low == 0 else r - low
    d1 = -1 if low == 0 else r + low
    while d1 >= n:
        d1 = -1 if low == 0 else r + low
        low >>= 1
    return up, [d for d in (d0, d1) if d >= 0]


@dataclass
class DoubleTree:
    """Two binary trees over hosts (NCCL's double binary tree: the second is the first mirrored,
    so that with an even host count a host is interior in at most one; shifted by one for an odd
    count, as NCCL does) and each
    host's GPU chain (the ring order inside the host). ``trees[t][h] = (parent, [children])``."""
    trees: list[dict[int, tuple[int, list[int]]]]
    chains: list[list[int]]
    degraded: bool = False
    reason: str = ""

    def __str__(self) -> str:
        s = []
        for t, tree in enumerate(self.trees):
            edges = ", ".join(f"{p}->{h}" for h, (p, _c) in sorted(tree.items()) if p >= 0)
            s.append(f"tree{t}: root {next(h for h, (p, _c) in tree.items() if p < 0)}; {edges or '(one host)'}")
        s.append("chains: " + "; ".join(" -> ".join(map(str, c)) for c in self.chains))
        return "\n".join(s)


def double_tree(n: int) -> list[dict[int, tuple[int, list[int]]]]:
    t0 = {r: _btree(n, r) for r in range(n)}
    t1 = {}
    for r in range(n):
        if n % 2:
            s = (r - 1 + n) % n
            p, ch = _btree(n, s)
            t1[r] = (-1 if p < 0 else (p + 1) % n, [(c + 1) % n for c in ch])
        else:
            m = n - 1 - r
            p, ch = _btree(n, m)
            t1[r] = (-1 if p < 0 else n - 1 - p, [n - 1 - c for c in ch])
    return [t0, t1]


@register_operation("plan_trees")
def plan_trees(topo: Topology, budget: int = DEFAULT_BUDGET) -> DoubleTree:
    ring = plan_ring(topo, budget)
    hosts = sorted({topo.host_of(g) for g in topo.gpus})
    chains = [[i for i in ring.order if topo.host_of(topo.gpus[i]) == h] for h in hosts]
    return DoubleTree(double_tree(len(hosts)), chains, ring.degraded, ring.reason)


# --- hierarchy and meshes ------------------------------------------------------------------------

@dataclass
class Hierarchy:
    """GPU indices grouped host -> NVLink domain -> NUMA node (nested lists, outermost first)."""
    levels: tuple[str, ...]
    groups: list  # hosts: [domains: [numa: [gpu indices]]]

    def __str__(self) -> str:
        out = []
        for h, doms in enumerate(self.groups):
            out.append(f"host {h}: " + " | ".join(
                "nvlink{" + " ".join("numa[" + ",".join(map(str, n)) + "]" for n in dom) + "}" for dom in doms))
        return "\n".join(out)


def nvlink_domains(topo: Topology) -> list[list[str]]:
    g = nx.Graph()
    g.add_nodes_from(topo.gpus)
    for a, b, d in topo.graph.edges(data=True):
        if d["type"] == "NVL" and a != b:
            g.add_edge(a, b)
    comps = []
    for comp in nx.connected_components(g):
        gpus = sorted((x for x in comp if x in set(topo.gpus)), key=topo.gpus.index)
        if gpus:
            comps.append(gpus)
    return sorted(comps, key=lambda c: topo.gpus.index(c[0]))


@register_operation("hierarchy")
def hierarchy(topo: Topology) -> Hierarchy:
    index = {g: i for i, g in enumerate(topo.gpus)}
    hosts = sorted({topo.host_of(g) for g in topo.gpus})
    out = []
    for h in hosts:
        doms = []
        for dom in nvlink_domains(topo):
            if topo.host_of(dom[0]) != h:
                continue
            by_cpu: dict[str, list[int]] = {}
            for g in dom:
                by_cpu.setdefault(topo.cpu_of(g), []).append(index[g])
            doms.append(list(by_cpu.values()))
        out.append(doms)
    return Hierarchy(("host", "nvlink", "numa"), out)


@dataclass
class MeshOrder:
    """``order[p]`` is the rank placed at row-major mesh position p; ``levels[d]`` names the
    smallest locality level (``numa``, ``nvlink``, ``host`` or ``network``) that every group along
    dimension d stays inside."""
    order: list[int]
    levels: list[str]
    degraded: bool = False
    reason: str = ""


LOCALITY = ("host", "nvlink", "numa")


def mesh_order(keys: list[tuple], shape) -> MeshOrder:
    """Place ranks on a row-major mesh of ``shape`` so that inner dimensions stay inside the
    fastest domain: ranks are sorted by their locality key ``(host, nvlink domain, numa node)``
    (then by rank), so consecutive positions share a host, then a domain, then a NUMA node.

    ``keys[r]`` is rank r's key. Pure: every rank computes the same order from the gathered keys.
    """
    shape = tuple(shape)
    n = len(keys)

    if math.prod(shape) != n:
        raise arg_error("mesh_order", "shape", shape, f"has {math.prod(shape)} positions for {n} ranks",
                        f"use a shape whose product is {n}", cls=TopologyError)
    order = sorted(range(n), key=lambda r: (tuple(keys[r]), r))
    levels = []
    degraded, reasons = False, []
    for d in range(len(shape)):
        stride = math.prod(shape[d + 1:])
        groups = []
        for start in range(n):
            coords_fixed = start
            if (coords_fixed // stride) % shape[d]:
                continue
            groups.append([order[start + k * stride] for k in range(shape[d])])
        level = "network"
        for depth in range(len(LOCALITY), 0, -1):
            if all(len({tuple(keys[r])[:depth] for r in grp}) == 1 for grp in groups):
                level = LOCALITY[depth - 1]
                break
        levels.append(level)
    per_host: dict = {}
    for k in keys:
        per_host[tuple(k)[:1]] = per_host.get(tuple(k)[:1], 0) + 1
    if levels and levels[-1] == "network" and shape[-1] <= min(per_host.values()):
        degraded = True
        reasons.append(f"the inner dimension ({shape[-1]}) crosses hosts although every host has "
                       f"{min(per_host.values())} ranks (hosts' rank counts do not divide evenly)")
    return MeshOrder(order, levels, degraded, "; ".join(reasons))
