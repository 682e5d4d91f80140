"""Plan a reshard without communicating: unit tasks, senders, modes, bytes and predicted time.

**Unit tasks** (the cross-mesh resharding paper, Zhuang et al. 2023). Every source rank holds a
box of the global tensor (its shard; replicas hold the same box), every destination rank wants
one. A unit task is the intersection of a source box and a destination box: a tile, its
*senders* (the source ranks holding that box, any of which can send it), its *receivers* (the
destination ranks wanting it). A receiver that holds the tile in its own source shard copies it
(``local``); the others receive it over the network.

**Senders** are load-balanced: tasks in decreasing size, each to the candidate whose estimated
busy time (its earlier tasks, priced on each message's link class) ends first, ties to the lower
rank (Alpa's greedy); then a bounded search moves single tasks to another candidate while that
lowers the busiest sender's time. Deterministic: every rank computes the same plan.

**Modes** per task with m network receivers (one receiver: a send): ``sendrecv`` (the sender sends
the tile to each receiver), ``broadcast`` (a pipelined chain, NCCL's broadcast: the sender sends
the tile to the first receiver, each receiver forwards every chunk of ``CHUNK`` bytes to the next
as it lands; the chain runs through the sender's host-mates, then host by host, so it enters every
other host once),
``allgather`` (the sender sends 1/m of the tile to each receiver, across the slow link once, and
the receivers all-gather the parts among themselves, Alpa's local all-gather: here each receiver
forwards its part in chunks of ``CHUNK`` bytes as they arrive, so the all-gather runs under the
scatter and only the last chunk's forwarding follows it). ``auto`` prices
the three on the cost model (``commlib.tuning``: the group's link between ranks of a host and
between hosts) and takes the cheapest; ``strategy=`` forces one for comparison.

**Partial sources** are first summed over their Partial mesh dimensions (one all-reduce per
group of replicas); then every replica is a sender.

**Bytes** are *logical* (what the executor counts, ``commlib.nn.functional.traffic()``'s
``reshard.cross`` / ``reshard.intra``): a send of n bytes costs the sender n; the broadcast
chain costs each of its ranks but the last n; the all-gather mode costs the sender the tile once
(n, in parts of ceil(E/m) elements, the last ones smaller or empty) and each receiver its part m-1
times; a Partial all-reduce over g ranks costs each 2(g-1)/g·n (floored). A byte is ``cross``
when its two ranks are on different hosts (the chain: a rank and the next; an all-reduce: a rank
and its successor in the group's order).

**Time**: the Partial all-reduces, then the longest of every rank's sends (serial at the rank)
and every host link's bytes (shared by the ranks of a host), then the longest all-gather stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from commlib.api.groups import is_initialized, resolve_group
from commlib.errors import CommTypeError, arg_error
from commlib.tuning.model import DEFAULT_LINKS, LinkCost

from .layout import Layout

__all__ = ["Task", "ReshardPlan", "plan", "STRATEGIES"]

STRATEGIES = ("auto", "sendrecv", "broadcast", "allgather")
CHUNK = 1 << 20  # the all-gather mode forwards parts in chunks of this many bytes
_SEARCH_PASSES = 8  # the bounded search after the greedy: at most this many improving sweeps


@dataclass(frozen=True)
class Task:
    """One tile: ``box`` ((lo, hi) per dimension), ``nbytes``, the candidate ``senders``, the
    chosen ``sender`` (None when every receiver copies locally), the network ``receivers`` (in
    the broadcast mode in chain order: :func:`chain`), the receivers that copy from their own
    source shard (``local``), and the ``mode``."""
    box: tuple
    nbytes: int
    senders: tuple
    sender: int | None
    receivers: tuple
    local: tuple
    mode: str

    @property
    def numel(self) -> int:
        return math.prod(hi - lo for lo, hi in self.box)

    def part(self) -> int:
        """The all-gather mode's part: ceil(numel / receivers) elements."""
        return -(-self.numel // max(len(self.receivers), 1))

    def span(self, i: int) -> tuple[int, int]:
        """Elements [lo, hi) of the flattened tile in the all-gather mode's part i."""
        part = self.part()
        return min(i * part, self.numel), min((i + 1) * part, self.numel)


@dataclass
class ReshardPlan:
    """What :func:`reshard` will do, on every rank alike. ``partial``: the groups of source ranks
    that first all-reduce their Partial pieces (each (ranks, nbytes)); ``sent``: logical bytes
    each world rank sends; ``bytes_by_link``: all ranks' bytes by link class; ``predicted_s``:
    the cost model's time."""
    global_shape: tuple
    dtype: torch.dtype
    src: Layout
    dst: Layout
    strategy: str
    tasks: list
    partial: list
    sent: dict
    bytes_by_link: dict
    predicted_s: float
    hosts: dict

    def __str__(self) -> str:
        mib = 1 << 20
        head = (f"reshard {list(self.global_shape)} {str(self.dtype).replace('torch.', '')}: "
                f"{self.src} -> {self.dst}, strategy {self.strategy}")
        lines = [head]
        for ranks, nbytes in self.partial:
            lines.append(f"  partial sum: all-reduce {nbytes / mib:.3f} MiB over ranks {list(ranks)}")
        lines.append(f"  {'#':>3}  {'tile':<28} {'MiB':>9}  {'senders':<12} {'sender':>6}  "
                     f"{'receivers':<14} {'local':<10} {'mode':<9} link")
        for k, t in enumerate(self.tasks):
            tile = "[" + ", ".join(f"{lo}:{hi}" for lo, hi in t.box) + "]"
            link = "-" if t.sender is None else ("cross" if any(
                self.hosts.get(t.sender) != self.hosts.get(r) for r in t.receivers) else "intra")
            lines.append(f"  {k:>3}  {tile:<28} {t.nbytes / mib:>9.3f}  "
                         f"{','.join(map(str, t.senders)):<12} "
                         f"{'-' if t.sender is None else t.sender:>6}  "
                         f"{','.join(map(str, t.receivers)) or '-':<14} "
                         f"{','.join(map(str, t.local)) or '-':<10} {t.mode:<9} {link}")
        lines.append(f"  bytes: cross-host {self.bytes_by_link['cross'] / mib:.3f} MiB, "
                     f"intra-host {self.bytes_by_link['intra'] / mib:.3f} MiB; predicted "
                     f"{self.predicted_s * 1e3:.3f} ms")
        return "\n".join(lines)


# ----- pricing ------------------------------------------------------------------------------
class _Links:
    """Seconds of one message on a link class (``intra``: ranks of one host, ``cross``)."""

    def __init__(self, table, hosts: dict):
        intra = getattr(table, "shm", None) or getattr(table, "link", None) or DEFAULT_LINKS["shm"]
        cross = getattr(table, "inter", None) or DEFAULT_LINKS["net"]
        self.cls = {"intra": intra, "cross": cross}
        self.hosts = hosts

    def kind(self, a: int, b: int) -> str:
        return "intra" if self.hosts.get(a) == self.hosts.get(b) else "cross"

    def step(self, a: int, b: int, nbytes: int) -> float:
        link: LinkCost = self.cls[self.kind(a, b)]
        return link.step(nbytes) if nbytes else 0.0

    def slowest(self, ranks: Sequence[int]) -> LinkCost:
        one_host = len({self.hosts.get(r) for r in ranks}) == 1
        return self.cls["intra" if one_host else "cross"]


def chain(sender: int, receivers: Sequence[int], hosts: dict) -> tuple[int, ...]:
    """The broadcast mode's order of ``receivers``: the sender's host-mates first, then host by
    host (hosts in order of their lowest receiver), ranks ascending within a host: the chain
    enters every other host once."""
    first: dict = {}
    for r in sorted(receivers):
        first.setdefault(hosts.get(r), r)
    home = hosts.get(sender)
    return tuple(sorted(receivers, key=lambda r: (hosts.get(r) != home, first[hosts.get(r)], r)))


def _mode_seconds(mode: str, sender: int, receivers: Sequence[int], nbytes: int, itemsize: int,
                  links: _Links) -> tuple[float, float]:
    """(the sender's busy time, at least the time its cross-host bytes take on the wire; the
    receivers' stage after it: the all-gather, or the rest of the broadcast chain) of one task in
    ``mode``."""
    far = sum(links.kind(sender, r) == "cross" for r in receivers)
    wire = links.cls["cross"].step
    if mode == "sendrecv":
        return max(sum(links.step(sender, r, nbytes) for r in receivers), wire(far * nbytes)), 0.0
    if mode == "broadcast":
        # a pipelined chain (NCCL's broadcast): the sender sends the tile once, each receiver
        # forwards every chunk as it lands; the slowest hop sets the pace, every other hop adds
        # one chunk
        order = (sender, *chain(sender, receivers, links.hosts))
        hops = [links.step(a, b, nbytes) for a, b in zip(order, order[1:])]
        chunk = [links.step(a, b, min(nbytes, CHUNK)) for a, b in zip(order, order[1:])]
        slowest = max(range(len(hops)), key=hops.__getitem__)
        rest = hops[slowest] - hops[0] + sum(c for i, c in enumerate(chunk) if i != slowest)
        return hops[0], max(rest, 0.0)
    m = len(receivers)
    part = -(-nbytes // itemsize // m) * itemsize
    scatter = max(sum(links.step(sender, r, part) for r in receivers), wire(far * part))
    among = links.slowest(receivers)
    # each receiver forwards its part chunk by chunk while the scatter runs: what is left after
    # it, and the last chunk's forwarding
    behind = max((m - 1) * among.step(part) - scatter, 0.0)
    return scatter, behind + (m - 1) * among.step(min(part, CHUNK))


def _modes_allowed(strategy: str, m: int) -> tuple[str, ...]:
    if m <= 1:
        return ("sendrecv",)
    return ("sendrecv", "broadcast", "allgather") if strategy == "auto" else (strategy,)


# ----- the plan -----------------------------------------------------------------------------
def _check_shape(fn: str, global_shape) -> tuple[int, ...]:
    try:
        shape = tuple(int(n) for n in global_shape)
        bad = any(isinstance(n, bool) or int(n) != n for n in global_shape)
    except (TypeError, ValueError):
        shape, bad = (), True
    if bad or any(n < 0 for n in shape):
        raise arg_error(fn, "global_shape", global_shape,
                        "must be a sequence of non-negative ints",
                        "pass the full tensor's shape, e.g. (1024, 512)", CommTypeError)
    return shape


def check_layouts(fn: str, src, dst, strategy: str, members: Sequence[int] | None) -> None:
    """The checks that need no tensor: both are Layouts, no Partial destination, ranks inside
    the group (``members``, None: any), a known strategy."""
    for arg, lay in (("src", src), ("dst", dst)):
        if not isinstance(lay, Layout):
            raise arg_error(fn, arg, type(lay).__name__, "must be a commlib.reshard.Layout",
                            f"pass Layout(ranks, placements) for {arg}", CommTypeError)
        lay.check(fn, arg, None, source=(arg == "src"))
        if members is not None:
            outside = sorted(set(lay.ranks) - set(members))
            if outside:
                raise arg_error(fn, arg, lay, f"holds ranks {outside} that are not in the group "
                                f"(ranks {list(members)})",
                                "use ranks of the group, or pass group= the group holding both "
                                "meshes")
    if strategy not in STRATEGIES:
        raise arg_error(fn, "strategy", strategy, f"must be one of {list(STRATEGIES)}",
                        'pass strategy="auto" (the cost model chooses per task)')


def check_inputs(fn: str, global_shape, dtype, src, dst, strategy: str,
                 members: Sequence[int] | None) -> tuple[int, ...]:
    """The shared checks of :func:`plan` and ``reshard``: the shape, the dtype,
    :func:`check_layouts`, and placements that fit the tensor's dimensions."""
    shape = _check_shape(fn, global_shape)
    if not isinstance(dtype, torch.dtype):
        raise arg_error(fn, "dtype", dtype, "must be a torch.dtype",
                        "pass e.g. torch.float32", CommTypeError)
    check_layouts(fn, src, dst, strategy, members)
    src.check(fn, "src", len(shape), source=True)
    dst.check(fn, "dst", len(shape), source=False)
    return shape


def _group_facts(group):
    """World rank -> host id and the group's cost table, from an initialized commlib group."""
    res = getattr(group, "resources", None)
    hosts = {}
    if res is not None and res.layout is not None:
        for h, ranks in enumerate(res.layout.hosts):
            for r in ranks:
                hosts[group.ranks[r]] = h
    table = res.model.table if res is not None and res.model is not None else None
    return hosts, table


def plan(global_shape: Sequence[int], dtype: torch.dtype, src: Layout, dst: Layout, *,
         group=None, strategy: str = "auto", hosts: Sequence[int] | dict | None = None,
         table=None) -> ReshardPlan:
    """Plan moving a tensor of ``global_shape`` and ``dtype`` from layout ``src`` to ``dst``
    (pure: nothing is sent). ``group``: the commlib group the reshard runs on (default the world
    when commlib is initialized), whose host layout and cost model price the plan; ``hosts``
    (``hosts[world_rank]`` = a host id) and ``table`` (a ``commlib.tuning.model.Table``) override
    them, e.g. to plan for another machine. ``strategy``: ``"auto"``, or force ``"sendrecv"``,
    ``"broadcast"`` or ``"allgather"`` on every task with several receivers."""
    fn = "reshard.plan"
    members = None
    if group is not None or (hosts is None and is_initialized()):
        g = resolve_group(group, fn)  # the group's facts only; no communication
        members = g.ranks
        facts_hosts, facts_table = _group_facts(g)
        hosts = facts_hosts if hosts is None else hosts
        table = facts_table if table is None else table
    shape = check_inputs(fn, global_shape, dtype, src, dst, strategy, members)
    if hosts is None:
        hosts = {}
    elif not isinstance(hosts, dict):
        hosts = dict(enumerate(hosts))
    return _plan(shape, dtype, src, dst, strategy, hosts, table)


def _plan(shape, dtype, src: Layout, dst: Layout, strategy: str, hosts: dict, table) -> ReshardPlan:
    links = _Links(table, hosts)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sent: dict[int, int] = {}
    by_link = {"cross": 0, "intra": 0}

    def add(a: int, b: int, nbytes: int) -> None:
        sent[a] = sent.get(a, 0) + nbytes
        by_link[links.kind(a, b)] += nbytes

    # Partial sources: the replicas along the Partial mesh dimensions all-reduce first.
    partial, partial_s = [], 0.0
    holders: dict[tuple, list[int]] = {}
    for r in src.ranks:
        holders.setdefault(src.box(r, shape), []).append(r)
    if src.partial_dims:
        seen = set()
        for r in src.ranks:
            c = src.coords(r)
            ranks = tuple(x for x in src.ranks if all(
                src.coords(x)[d] == c[d] for d in range(len(c)) if d not in src.partial_dims))
            if ranks in seen or len(ranks) < 2:
                continue
            seen.add(ranks)
            nbytes = math.prod(hi - lo for lo, hi in src.box(r, shape)) * itemsize
            partial.append((ranks, nbytes))
            g = len(ranks)
            for k, a in enumerate(ranks):
                add(a, ranks[(k + 1) % g], 2 * (g - 1) * nbytes // g)
            if nbytes:
                partial_s = max(partial_s, 2 * (g - 1) * links.slowest(ranks).step(nbytes // g))

    wants: dict[tuple, list[int]] = {}
    for r in dst.ranks:
        wants.setdefault(dst.box(r, shape), []).append(r)

    # Unit tasks: every non-empty intersection of a source box and a destination box.
    raw = []
    for dbox, receivers in sorted(wants.items()):
        for sbox, senders in sorted(holders.items()):
            tile = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(sbox, dbox))
            numel = math.prod(max(hi - lo, 0) for lo, hi in tile)
            if numel == 0:
                continue
            local = tuple(r for r in receivers if r in senders)
            remote = tuple(r for r in receivers if r not in senders)
            raw.append((tile, numel * itemsize, tuple(senders), remote, local))

    # Senders: greedy on the estimated busy time, largest tasks first, then a bounded search.
    order = sorted(range(len(raw)), key=lambda k: (-raw[k][1], k))
    choice: dict[int, tuple[int, str]] = {}
    busy: dict[int, float] = {}
    stage: dict[int, float] = {}

    def best_mode(k: int, s: int) -> tuple[float, float, str]:
        _, nbytes, _, remote, _ = raw[k]
        options = []
        for mode in _modes_allowed(strategy, len(remote)):
            t, ag = _mode_seconds(mode, s, remote, nbytes, itemsize, links)
            cross = sum(links.kind(s, r) == "cross" for r in remote)
            options.append((t + ag, cross, mode, t, ag))
        total, _, mode, t, ag = min(options)
        return t, ag, mode

    for k in order:
        _, _, senders, remote, _ = raw[k]
        if not remote:
            continue
        ranked = []
        for s in senders:
            t, ag, mode = best_mode(k, s)
            cross = sum(links.kind(s, r) == "cross" for r in remote)
            ranked.append((busy.get(s, 0.0) + t, cross, s, mode, t, ag))
        finish, _, s, mode, t, ag = min(ranked)
        choice[k] = (s, mode)
        busy[s] = finish
        stage[k] = ag

    for _ in range(_SEARCH_PASSES):  # move one task at a time while the busiest sender gains
        improved = False
        for k in order:
            if k not in choice or len(raw[k][2]) < 2:
                continue
            s, mode = choice[k]
            t_now = best_mode(k, s)[0]
            worst = max(busy.values())
            for other in raw[k][2]:
                if other == s:
                    continue
                t_new, ag_new, mode_new = best_mode(k, other)
                trial = dict(busy)
                trial[s] -= t_now
                trial[other] = trial.get(other, 0.0) + t_new
                if max(trial.values()) < worst - 1e-12:
                    busy, choice[k], stage[k] = trial, (other, mode_new), ag_new
                    improved = True
                    break
        if not improved:
            break

    tasks, link_bytes = [], {}
    for k, (tile, nbytes, senders, remote, local) in enumerate(raw):
        if k not in choice:
            tasks.append(Task(tile, nbytes, senders, None, (), local, "local"))
            continue
        s, mode = choice[k]
        if mode == "broadcast":
            remote = chain(s, remote, hosts)
        task = Task(tile, nbytes, senders, s, remote, local, mode)
        tasks.append(task)
        if mode == "sendrecv":
            for r in remote:
                add(s, r, nbytes)
        elif mode == "broadcast":  # each rank of the chain sends the tile to the next
            for a, b in zip((s, *remote), remote):
                add(a, b, nbytes)
        else:
            for i, r in enumerate(remote):
                lo, hi = task.span(i)
                add(s, r, (hi - lo) * itemsize)
                for b in remote:
                    if b != r:
                        add(r, b, (hi - lo) * itemsize)
        # bytes on each host link: the broadcast chain's hops, the all-gather mode's parts once
        # each, send/recv's copies
        crossing = {}
        for i, r in enumerate(remote):
            a = remote[i - 1] if mode == "broadcast" and i else s
            if links.kind(a, r) == "cross":
                key = (hosts.get(a), hosts.get(r))
                if mode == "allgather":
                    lo, hi = task.span(i)
                    crossing[key] = crossing.get(key, 0) + (hi - lo) * itemsize
                else:
                    crossing[key] = crossing.get(key, 0) + nbytes
        for key, n in crossing.items():
            link_bytes[key] = link_bytes.get(key, 0) + n

    wire = max((links.cls["cross"].step(n) for n in link_bytes.values()), default=0.0)
    predicted = partial_s + max(max(busy.values(), default=0.0), wire) + max(stage.values(),
                                                                             default=0.0)
    return ReshardPlan(tuple(shape), dtype, src, dst, strategy, tasks, partial, sent, by_link,
                       predicted, dict(hosts))
