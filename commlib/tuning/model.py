"""The α-β-γ cost model: predicted seconds of each algorithm for (collective, bytes, ranks, link).

Every point-to-point step costs ``S(m) = α + m·β`` (α the per-message latency of the link class,
β its seconds per byte, ``m`` the bytes of the message; a calibrated link replaces the line by its
measured step curve) and every local reduction of ``m`` bytes costs ``m·γ``. For p ranks and n
bytes (n is the size of the per-rank buffer the collective's busbw is measured on: the reduced
buffer for all_reduce, the whole output for all_gather, the whole input for reduce_scatter), with
``L = ceil(log2 p)``, ``p2`` the largest power of two <= p and ``f = 1 if p != p2 else 0`` (the
non-power-of-two fold of commlib's doubling algorithms)::

    all_reduce  ring                2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ
                recursive_doubling  log2(p2)·(α + nβ + nγ) + f·(2α + 2nβ + nγ)
                rabenseifner        2·log2(p2)·α + 2(p2-1)/p2·nβ + (p2-1)/p2·nγ + f·(2α + 2nβ + nγ)
                                    (halving steps of n/2, n/4, ... n/p2, then doubling back)
                binomial            2L·(α + nβ) + L·nγ              (binomial reduce, then broadcast)
    reduce_scatter ring             (p-1)α + (p-1)/p·nβ + (p-1)/p·nγ
                rabenseifner        log2(p2)·α + (p2-1)/p2·n·(β + γ) + f·(2α + (1 + 1/p)·nβ + nγ)
    all_gather  ring                (p-1)α + (p-1)/p·nβ
                recursive_doubling  log2(p2)·α + (p2-1)/p2·nβ + f·(2α + (1 + 1/p)·nβ)
    broadcast   binomial            L·(α + nβ)
    reduce      binomial            L·(α + nβ + nγ)

For a group spanning hosts (``local`` ranks on each of ``h = p/local`` hosts), flat algorithms pay
the inter-host link on every step, and::

    all_reduce  hierarchical        RS_ring(local, n; intra) + min_alg AR_alg(h, n/local; inter)
                                    + AG_ring(local, n; intra)

These are the classic formulas of Thakur, Rabenseifner & Gropp (2005), written for the exact step
structure of commlib's algorithms: each formula sits in its algorithm's file, in the algorithm's
record (``commlib/algorithms/``, ``cost=``), and this module prices whatever is registered. Algorithms
that run on a transport (``shm``, ``cuda_ipc``) are priced on that transport's link class
(``Table.shm``, ``Table.cuda_ipc``). The engine's own collective
(``native``) is not modelled by a formula: it is priced from its measured curve (see
:class:`Curve`) when calibration has one, else as the best of the formulas above (engines run one
of these algorithms).

The model is pure: no communication, no clock, no group. :func:`predict` returns one :class:`Prediction`
per algorithm, cheapest first.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ..algorithms.registry import Algorithm, records

__all__ = ["LinkCost", "Curve", "Prediction", "Table", "cost_names", "predict", "DEFAULT_LINKS",
           "HOP_LATENCY_US", "BASE_LATENCY_GPU", "gpu_table"]


@dataclass(frozen=True)
class LinkCost:
    """The cost of one link class: ``alpha`` seconds per message, ``beta`` seconds per byte moved,
    ``gamma`` seconds per byte reduced locally (the reduction runs on the receiving side), and
    ``busy``, the share of a transfer's time during which it keeps a core of its host busy: what
    computation running beside it loses (0 for a DMA engine's link; ``bench/calibrate.py``
    measures it for the link between hosts; copies through shared memory are the cores' work)."""

    alpha: float
    beta: float
    gamma: float = 0.0
    curve: "Curve | None" = None  # measured seconds per step by message size, if calibrated
    busy: float = 0.0

    def step(self, nbytes: float) -> float:
        """Seconds of one point-to-point step moving ``nbytes`` each way: the measured curve
        when calibration has one (it captures what a straight line misses: cache effects,
        protocol switches), else ``α + nβ``."""
        if self.curve is not None:
            return self.curve(nbytes)
        return self.alpha + nbytes * self.beta

    @classmethod
    def from_bandwidth(cls, latency_us: float, gbytes_per_s: float,
                       reduce_gbytes_per_s: float | None = None) -> "LinkCost":
        gamma = 0.0 if not reduce_gbytes_per_s else 1.0 / (reduce_gbytes_per_s * 1e9)
        return cls(latency_us * 1e-6, 1.0 / (gbytes_per_s * 1e9), gamma)


# Per-hop latency (α, µs) per link class: NCCL's ring hardware latencies for the LL protocol
# (../shared/reference/collectives.md §1.2: NVLink 0.6, PCI 1.0, NET 2.7), which is what small
# messages use; bandwidths come from the topology graph (NCCL's constants) and large messages use
# the Simple protocol at that bandwidth. BASE_LATENCY_GPU is NCCL's ring base latency (LL, 6.6 µs),
# paid once per collective. Reductions on a GPU run far faster than its links: γ = 0.
HOP_LATENCY_US = {"NVL": 0.6, "NVB": 0.6, "C2C": 0.6, "PIX": 1.0, "PXB": 1.0, "PHB": 1.0,
                  "NODE": 1.0, "SYS": 1.0, "NET": 2.7}
BASE_LATENCY_GPU = 6.6e-6

# Defaults when nothing is calibrated, for CPU ranks. ``shm``: a point-to-point step between ranks
# of one host through the engine and commlib's step loop (measured on this machine kind: ~8 µs a
# step, and about three single-thread copies per byte: MPICH's bounce buffer in and out, plus the
# step's bookkeeping); ``shm_sync``: commlib's own shared-memory collectives (a flag handshake in
# C, ~1 µs; one copy per byte). The built-in probe replaces the copy and reduce bandwidths by this
# host's. ``net``: a 100 Gb/s NIC (NCCL's NET_BW, 12 GB/s).
DEFAULT_LINKS: dict[str, LinkCost] = {
    "shm": LinkCost.from_bandwidth(8.0, 6.0 / 3, 6.0),
    "shm_sync": LinkCost.from_bandwidth(1.0, 6.0, 6.0),
    "net": LinkCost.from_bandwidth(HOP_LATENCY_US["NET"], 12.0),
}


class Curve:
    """A measured time curve ``nbytes -> seconds`` (e.g. the engine's native collective at one
    group size), made non-decreasing, interpolated linearly in log-log space between measured
    points and extrapolated with the α-β line through the two nearest points beyond either end."""

    def __init__(self, points: dict[int, float] | list[tuple[int, float]]):
        items = sorted(dict(points).items())
        if len(items) < 2:
            raise ValueError("a curve needs at least two measured sizes")
        self.sizes = [max(1, int(s)) for s, _ in items]
        # Moving more bytes never takes less time, so a time measured at a larger size bounds
        # every smaller one: each point is the minimum over itself and all larger sizes. This
        # removes the upward spikes a shared machine puts into single measurements.
        times = [float(t) for _, t in items]
        for i in range(len(times) - 2, -1, -1):
            times[i] = min(times[i], times[i + 1])
        self.times = times

    def __call__(self, nbytes: int) -> float:
        s, t = self.sizes, self.times
        n = max(1, nbytes)
        i = bisect.bisect_left(s, n)
        if i < len(s) and s[i] == n:
            return t[i]
        if i == 0 or i == len(s):  # outside: straight line (α + nβ) through the end points
            a, b = (0, 1) if i == 0 else (len(s) - 2, len(s) - 1)
            slope = (t[b] - t[a]) / (s[b] - s[a])
            return max(t[a] + slope * (n - s[a]), min(t[a], t[b]) * 0.5)
        x0, x1 = math.log(s[i - 1]), math.log(s[i])
        y0, y1 = math.log(t[i - 1]), math.log(t[i])
        return math.exp(y0 + (y1 - y0) * (math.log(n) - x0) / (x1 - x0))

    def to_json(self) -> dict[str, float]:
        return {str(s): t for s, t in zip(self.sizes, self.times)}

    @classmethod
    def from_json(cls, points: dict[str, float]) -> "Curve":
        return cls({int(n): t for n, t in points.items()})


class Prediction(NamedTuple):
    algorithm: str
    seconds: float
    how: str  # "formula" or "measured"


def cost_names(collective: str) -> list[str]:
    """Algorithms of ``collective`` with a single-level formula for CPU tensors (shared-memory ones
    included)."""
    return [r.name for r in records(collective) if r.cost is not None and "cpu" in r.devices]


@dataclass
class Table:
    """What the model knows about one group.

    ``link``: the cost of a step between ranks of one host (intra-host class). For a group that
    spans hosts, ``local`` ranks per host and ``inter``, the cost of a step between hosts: flat
    algorithms then pay ``inter`` on every step (a step ends with its slowest hop), while
    ``hierarchical`` pays each stage on its own class (the inter-host stage on ``shard_inter``).
    ``base``: a fixed cost per collective of the engine (NCCL's launch and base latency); the
    transports' own algorithms pay their link's α instead. ``curves``: measured
    time curves per collective and algorithm (calibration measures the engine's ``native`` ones
    and the shared-memory ones: what no step formula describes well); a measured curve wins over
    the formula."""

    link: LinkCost
    curves: dict[str, dict[str, Curve]] = field(default_factory=dict)
    local: int | None = None
    inter: LinkCost | None = None
    base: float = 0.0
    #: The hierarchical inter-host stage: the link one rank's shard crosses hosts on, while every
    #: local rank's shard crosses at once (shards share the hosts' NICs). Default: ``inter``.
    shard_inter: LinkCost | None = None
    #: The shared-memory algorithms' costs (flag handshake, copy, read-and-reduce), when they
    #: differ from ``link`` (the engine's point-to-point step). Default: ``link``.
    shm: LinkCost | None = None
    #: The CUDA IPC kernels' costs (a launch and a flag handshake; a peer read per byte). Default:
    #: ``link``.
    cuda_ipc: LinkCost | None = None

    def flat_link(self, p: int) -> LinkCost:
        spans = self.inter is not None and self.local is not None and self.local < p
        return self.inter if spans else self.link

    def link_of(self, algorithm: Algorithm, p: int) -> LinkCost:
        """The link class ``algorithm`` is priced on: its transport's, else the flat link; across
        hosts, the hosts' link shared by their ranks for an algorithm whose ranks all cross at
        once (``Algorithm.shares_host_link``)."""
        if algorithm.transport is not None:
            return getattr(self, algorithm.transport, None) or self.flat_link(p)
        link = self.flat_link(p)
        if algorithm.shares_host_link and link is self.inter and self.shard_inter is not None:
            return self.shard_inter
        return link


def gpu_table(gbytes_per_s: float = 150.0) -> Table:
    """The model for CUDA tensors of one host's GPUs, from NCCL's constants (no calibration
    measures GPUs here): NVLink steps (``HOP_LATENCY_US["NVL"]``, ``gbytes_per_s``), NCCL's base
    latency paid by the engine's own collective, and the CUDA IPC kernels' link: a kernel launch
    and flag handshake (~3 µs, vLLM's custom all-reduce at 8 B) and peer reads at NVLink speed."""
    nvl = LinkCost.from_bandwidth(HOP_LATENCY_US["NVL"], gbytes_per_s)
    return Table(nvl, base=BASE_LATENCY_GPU, cuda_ipc=LinkCost.from_bandwidth(3.0, gbytes_per_s))


def predict(collective: str, nbytes: int, p: int, table: Table,
            eligible: list[str] | None = None, extra: list[Prediction] = ()) -> list[Prediction]:
    """Predicted time of each algorithm of ``collective`` (those in ``eligible`` when given; else
    every algorithm with a formula, a measured curve, and ``native``) for ``nbytes`` on ``p``
    ranks, and the ``extra`` ones priced elsewhere, cheapest first (measured curves within
    ``LATENCY_TIE`` of the cheapest in the latency regime: by formula, see :func:`_latency_tie`).
    A measured curve wins over a formula; ``native`` without a curve is priced as the cheapest
    formula (engines run one of these algorithms)."""
    if p <= 1:
        return [Prediction("native", 0.0, "formula")]
    measured = table.curves.get(collective, {})
    algos = {r.name: r for r in records(collective)}
    formulas = {n: r for n, r in algos.items() if r.cost is not None}
    engine_costs = {n: r.cost for n, r in formulas.items() if r.prices_native}
    local = table.local
    two_level = table.inter is not None and local is not None and 1 < local < p and p % local == 0
    hier = {n: r for n, r in algos.items() if r.cost_two_level is not None} if two_level else {}

    def formula(name: str, n: int) -> float | None:
        """``name``'s formula on its own link (``native``: the cheapest engine formula), or None."""
        if name == "native":
            flat = [formula(f, n) for f in engine_costs]
            return min(flat) if flat else None
        if name not in formulas:
            return None
        return formulas[name].cost(p, n, table.link_of(formulas[name], p))

    if eligible is None:
        names = {n for n, r in formulas.items() if r.transport is None and "cpu" in r.devices}
        names |= set(hier) | set(measured) | {"native"}
    else:
        names = set(eligible)
    out = []
    for name in sorted(names - {"native"}):
        if name in measured:
            out.append(Prediction(name, measured[name](nbytes), "measured"))
        elif name in formulas:
            # the engine's fixed cost, not paid by a transport's own algorithm
            base = table.base if formulas[name].transport is None else 0.0
            out.append(Prediction(name, base + formula(name, nbytes), "formula"))
        elif name in hier:
            shard = table.shard_inter or table.inter
            cost = hier[name].cost_two_level(p, local, nbytes, table.link, shard, engine_costs)
            out.append(Prediction(name, table.base + cost, "formula"))
    if "native" in names:
        if "native" in measured:
            out.append(Prediction("native", measured["native"](nbytes), "measured"))
        else:
            # engines run one of the point-to-point algorithms: priced as the cheapest of them,
            # eligible here or not (on CUDA tensors they are not offered, the engine runs them)
            flat = [(table.base + formula(name, nbytes), name) for name in engine_costs]
            if flat:
                seconds, name = min(flat)
                out.append(Prediction("native", seconds, f"formula ({name})"))
    # On a tie the engine's own collective wins: it is at least as good as the formula it equals.
    out = sorted([*out, *extra], key=lambda x: (x.seconds, x.algorithm != "native", x.algorithm))
    return _latency_tie(out, nbytes, formula)


# Measured curves within this share of the fastest are a tie when every one of them is
# latency-bound by its formula (the per-byte part under half its time); the formulas' order
# decides it.
LATENCY_TIE = 0.10


def _latency_tie(out: list[Prediction], nbytes: int, formula) -> list[Prediction]:
    """Break ties among measured curves in the latency regime by the formulas: a flag handshake
    or a message counts exactly in a formula, while a 1 µs measurement moves 10-20% between two
    runs of the same code here (calibration measured the two-shot all-reduce 9% faster than the
    one-shot at 512 B on 2 ranks; the accuracy run then measured it 20% slower, as its second
    handshake says it must be)."""
    if len(out) < 2 or out[0].how != "measured":
        return out
    band = [x for x in out if x.how == "measured" and x.seconds <= out[0].seconds * (1 + LATENCY_TIE)]
    if len(band) < 2:
        return out
    cost = {}
    for x in band:
        t, t0 = formula(x.algorithm, nbytes), formula(x.algorithm, 1)
        if t is None or t - t0 > 0.5 * t:  # no formula, or bandwidth-bound: the curves decide
            return out
        cost[x.algorithm] = t
    pick = min(band, key=lambda x: (cost[x.algorithm], x.algorithm != "native", x.algorithm))
    if pick is out[0]:
        return out
    rest = [x for x in out if x is not pick]
    return [pick._replace(how=f"measured; within {LATENCY_TIE:.0%} of {out[0].algorithm}'s, "
                              f"latency-bound: the formulas decide")] + rest
