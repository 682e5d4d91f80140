"""Cross-mesh resharding (``commlib.reshard``) on the cross-mesh resharding paper's
microbenchmark shapes: time and bytes across hosts of every strategy against a naive send/recv
baseline and against the host link's bound.

Run under ``mpiexec`` on one host, or across hosts (the multi-host cluster of docs/overlap.md)::

    mpiexec -n 4 .venv/bin/python bench/reshard.py                       # 1, 16, 64 MiB
    mpiexec -n 4 .venv/bin/python bench/reshard.py --sizes 4M --cases 1-to-m --rounds 9
    vcluster mpirun -n 4 -ppn 2 -- env COMMLIB_TUNING_FILE=$T .venv/bin/python \\
        bench/reshard.py --json reshard.json

**Meshes.** Chosen from commlib's host layout of the world group (``resources.layout.hosts``,
the hosts in order of their lowest rank), not from rank numbers: the source side ``A`` is the
first host's ranks and the destination side ``B`` the second host's. On one host the world is
split in two halves instead (``A`` the first ceil(p/2) ranks, ``B`` the rest). ``B`` never
holds source data, so every byte a destination rank receives comes from ``A``. The cases (the
paper's ``1-to-m`` and ``n-to-m`` suites, one tensor dim split ``Shard``-wise):

* ``1-to-m``: one source rank (``A[0]``), the whole tensor, to ``B`` (m ranks) under
  ``Replicate()``: a pure multicast.
* ``n-to-m-shard``: ``Shard(0)`` on ``A`` (n ranks) to ``Shard(1)`` on ``B``: every destination
  tile is a piece of every source tile.
* ``n-to-m-replicate``: ``Shard(0)`` on ``A`` to ``Replicate()`` on ``B``.

The tensor is float32 (``--dtype``), 2-D, ``--sizes`` bytes in all (default 1, 16 and 64 MiB),
as square as a power-of-two row count allows (64 MiB: 4096 x 4096).

**Implementations.** ``auto``, ``broadcast``, ``allgather`` and ``sendrecv``:
``commlib.reshard.reshard(local, src, dst, strategy=...)``, blocking, the global shape and dtype
given (no metadata exchange). ``naive``: written here, Alpa's default (``resharding_mode=
"send_recv"``) without its load balancing: every destination rank pulls each of its pieces (the
intersection of its tile with a source tile) from one source rank, the first that holds it, with
``commlib.isend`` / ``commlib.irecv``, all posted at once, then waited.

**Timing.** Per case and size, every implementation is warmed up (its plan made and its
communicators created) and checked, then timed in ``--rounds`` rounds (default 5); each round
waits out the host's slow phases first (the quiet gate of ``bench/_quiet.py``) and then times
every implementation back to back, in an order that rotates every round. One measurement is a
loop of back-to-back calls (as many as fill ``--time`` seconds for the slowest implementation,
the same count for all, at least one) after a barrier: the slowest rank's mean per call. The
median over the rounds is reported.

**Columns** (one row per implementation):

* ``ms``: the median time per reshard.
* ``pred ms``, ``meas/pred``: the planner's predicted time (``plan(...).predicted_s``, priced by
  the world group's cost model: the tuning file of the job, ``COMMLIB_TUNING_FILE``) and the
  measured over the predicted; the goal is within 25% (0.75-1.25). ``-`` for naive (no plan).
* ``cross MiB``, ``intra MiB``: bytes sent between ranks on different hosts and on the same
  host in one reshard, summed over ranks, counted: ``commlib.nn.functional.traffic()``'s
  ``reshard.cross`` / ``reshard.intra`` (the logical convention of docs/reshard.md: a broadcast
  over g ranks costs its root (g-1) n). Naive: the bytes of its point-to-point messages, by the
  host layout. ``plan``: ``ok`` when the counted bytes equal the plan's ``bytes_by_link`` and
  every rank's count equals ``plan.sent[rank]``, else ``DIFF``.
* ``/bound``: time over the link bound. The bound is the bytes that must cross into a host
  (for each destination host: the elements its ranks need that no source rank on it holds),
  the largest over hosts, divided by the link rate ``--link-gbit`` (default 1.0 Gb/s, the
  vcluster's ``tc`` rate; 1 Gb/s = 125e6 B/s). ``-`` on one host (nothing must cross).
* ``naive/x``: the naive baseline's time over this row's: the speed-up over send/recv.
* ``#wrong``: destination elements that differ from the full tensor sliced by the destination
  layout (``dst.shard(full, rank)``), summed over ranks, after one untimed run. Data is only
  moved, so the comparison is exact. Non-zero anywhere, or a ``DIFF`` in ``plan``: exit
  status 1.

**Checks** (issue 19), printed as PASS/MISS after each case and size where they apply: across
hosts, for a tensor replicated on a destination mesh of 2 ranks on another host than every
source rank (``1-to-m`` and ``n-to-m-replicate`` with 2 ranks per host): ``auto``'s counted
cross-host bytes equal the tensor's bytes (each byte crosses once), ``auto`` runs within 1.25x of
the link bound, and at least 1.8x faster than ``naive``; and over the whole run, the share of the
planner's predictions within 25% of the measured times.

``--print-plan`` prints ``str(plan)`` of ``auto`` after each case and size (the tables of
docs/reshard.md). ``--json PATH`` writes every row (with the rounds' times and per-rank counts),
the options, the host layout, the meshes and auto's plan of every point.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import commlib  # before mpi4py: commlib sets UCX's TCP defaults before MPI initializes
from mpi4py import MPI

from _harness import fmt_bytes, parse_size, rank0_out, timed_slowest, write_json
from _quiet import quiet_for, quiet_summary, time_loop
from commlib.nn.functional import traffic
from commlib.reshard import Layout, Replicate, Shard, plan, reshard

torch.set_num_threads(1)
COMM = MPI.COMM_WORLD
MIB = float(1 << 20)
STRATEGIES = ("auto", "broadcast", "allgather", "sendrecv")
IMPLS = STRATEGIES + ("naive",)
CASES = ("1-to-m", "n-to-m-shard", "n-to-m-replicate")
GOAL_BOUND = 1.25     # auto within 1.25x of the link bound
GOAL_NAIVE = 1.8      # auto at least 1.8x faster than the naive send/recv baseline
GOAL_PLANNER = 0.25   # predicted within 25% of measured
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "int64": torch.int64}


# ----- geometry -----------------------------------------------------------------------------
def host_layout() -> list[list[int]]:
    """World ranks per host, hosts in order of their lowest rank (commlib's own layout, what the
    planner prices by)."""
    return [list(h) for h in commlib.get_world_group().resources.layout.hosts]


def sides(hosts: list[list[int]]) -> tuple[list[int], list[int]]:
    """(A, B): the source side and the destination side (see the module docstring)."""
    if len(hosts) > 1:
        return hosts[0], hosts[1]
    ranks = hosts[0]
    half = (len(ranks) + 1) // 2
    return ranks[:half], ranks[half:]


def make_case(name: str, a: list[int], b: list[int]) -> tuple[Layout, Layout, str]:
    if name == "1-to-m":
        return (Layout([a[0]], [Replicate()]), Layout(b, [Replicate()]),
                f"1 -> {len(b)}, R -> R")
    if name == "n-to-m-shard":
        return (Layout(a, [Shard(0)]), Layout(b, [Shard(1)]),
                f"{len(a)} -> {len(b)}, S(0) -> S(1)")
    return (Layout(a, [Shard(0)]), Layout(b, [Replicate()]), f"{len(a)} -> {len(b)}, S(0) -> R")


def tensor_shape(nbytes: int, item: int) -> tuple[int, int]:
    """2-D, as square as a power-of-two row count dividing the elements allows."""
    n = max(1, nbytes // item)
    rows = 1 << (math.isqrt(n).bit_length() - 1) if n > 1 else 1
    while n % rows:
        rows //= 2
    return rows, n // rows


def slices(box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def intersect(a, b):
    box = tuple((max(lo1, lo2), min(hi1, hi2)) for (lo1, hi1), (lo2, hi2) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def relative(box, origin) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def must_cross(shape, dtype, src: Layout, dst: Layout, hosts: list[list[int]]) -> int:
    """The most bytes that must enter any one host: per destination host, the elements its
    destination ranks need that no source rank on that host holds."""
    item = torch.empty((), dtype=dtype).element_size()
    worst = 0
    for ranks in hosts:
        need = torch.zeros(shape, dtype=torch.bool)
        for r in ranks:
            box = dst.box(r, shape)
            if box is not None:
                need[slices(box)] = True
        for r in ranks:
            box = src.box(r, shape)
            if box is not None:
                need[slices(box)] = False
        worst = max(worst, int(need.sum()) * item)
    return worst


# ----- the naive baseline -------------------------------------------------------------------
class Naive:
    """Every destination rank pulls each of its pieces from one source rank (the first holding
    that source tile) with point-to-point messages, all posted at once; no load balancing, no
    broadcast. ``cross``/``intra``: the bytes this rank sends, by link class."""

    def __init__(self, shape, dtype, src: Layout, dst: Layout, rank: int, host_of: dict):
        self.shape, self.dtype, self.rank = shape, dtype, rank
        self.my_src, self.my_dst = src.box(rank, shape), dst.box(rank, shape)
        tiles: dict = {}  # distinct source tiles -> the first source rank holding one
        for r in src.ranks:
            tiles.setdefault(src.box(r, shape), r)
        self.sends, self.recvs, self.copies = [], [], []
        self.cross = self.intra = 0
        item = torch.empty((), dtype=dtype).element_size()
        for receiver in dst.ranks:  # one global order: every pair posts its messages alike
            want = dst.box(receiver, shape)
            for tile, sender in tiles.items():
                piece = intersect(want, tile)
                if piece is None:
                    continue
                if sender == receiver == rank:
                    self.copies.append((relative(piece, tile), relative(piece, want)))
                elif sender == rank:
                    self.sends.append((receiver, relative(piece, tile)))
                    nbytes = math.prod(hi - lo for lo, hi in piece) * item
                    if host_of[sender] == host_of[receiver]:
                        self.intra += nbytes
                    else:
                        self.cross += nbytes
                elif receiver == rank:
                    self.recvs.append((sender, relative(piece, want)))

    def __call__(self, local):
        out = None
        if self.my_dst is not None:
            out = torch.empty(tuple(hi - lo for lo, hi in self.my_dst), dtype=self.dtype)
        works, bufs = [], []
        for peer, sl in self.recvs:
            buf = torch.empty(out[sl].shape, dtype=self.dtype)
            bufs.append((buf, sl))
            works.append(commlib.irecv(buf, src=peer))
        for peer, sl in self.sends:
            works.append(commlib.isend(local[sl].contiguous(), dst=peer))
        for a, b in self.copies:
            out[b] = local[a]
        for w in works:
            w.wait()
        for buf, sl in bufs:
            out[sl] = buf
        return out


# ----- one case at one size -----------------------------------------------------------------
def data(shape, dtype) -> torch.Tensor:
    """The full tensor, the same on every rank: small integers every dtype holds exactly, all
    different within any 2^16 consecutive elements."""
    n = math.prod(shape)
    return torch.arange(n, dtype=torch.int64).remainder_(1 << 16).reshape(shape).to(dtype)


def measure_point(case: str, nbytes: int, args, dtype, a, b, hosts, quiet, out) -> dict:
    rank = COMM.rank
    host_of = {r: h for h, ranks in enumerate(hosts) for r in ranks}
    src, dst, label = make_case(case, a, b)
    item = torch.empty((), dtype=dtype).element_size()
    shape = tensor_shape(nbytes, item)
    total = math.prod(shape) * item
    full = data(shape, dtype)
    local = src.shard(full, rank) if rank in src.ranks else None
    want = dst.shard(full, rank) if rank in dst.ranks else None
    del full
    plans = {s: plan(shape, dtype, src, dst, strategy=s) for s in STRATEGIES}
    naive = Naive(shape, dtype, src, dst, rank, host_of)

    fns = {s: (lambda s=s: reshard(local, src, dst, global_shape=shape, dtype=dtype, strategy=s))
           for s in STRATEGIES}
    fns["naive"] = lambda: naive(local)

    # warm-up (plans made, groups created), the check and the count, outside the timed region
    facts, slowest = {}, 0.0
    for name, fn in fns.items():
        fn()
        slowest = max(slowest, timed_slowest(fn, COMM))
        with traffic() as t:
            got = fn()
        wrong = 0
        if want is not None:
            wrong = int((got != want).sum()) if got is not None and got.shape == want.shape \
                else want.numel()
        if name == "naive":
            cross, intra = naive.cross, naive.intra
        else:
            cross, intra = t.by_kind.get("reshard.cross", 0), t.by_kind.get("reshard.intra", 0)
        per_rank = COMM.allgather((cross, intra, t.sent, wrong))
        fact = {"cross": sum(c for c, _, _, _ in per_rank),
                "intra": sum(i for _, i, _, _ in per_rank),
                "wrong": sum(w for *_, w in per_rank),
                "sent_by_rank": [s for _, _, s, _ in per_rank] if name != "naive"
                else [c + i for c, i, _, _ in per_rank]}
        if name != "naive":
            p = plans[name]
            fact["plan_ok"] = (fact["cross"] == p.bytes_by_link.get("cross", 0)
                               and fact["intra"] == p.bytes_by_link.get("intra", 0)
                               and all(fact["sent_by_rank"][r] == p.sent.get(r, 0)
                                       for r in range(COMM.size)))
        facts[name] = fact
    iters = max(1, min(args.max_iters, round(args.time / max(slowest, 1e-9))))

    times = {name: [] for name in fns}
    names = list(fns)
    for k in range(args.rounds):
        quiet.wait()  # not in one of the host's slow phases (bench/_quiet.py)
        for name in names[k % len(names):] + names[:k % len(names)]:
            times[name].append(time_loop(fns[name], iters, COMM))

    bound_bytes = must_cross(shape, dtype, src, dst, hosts) if len(hosts) > 1 else 0
    bound = bound_bytes / (args.link_gbit * 1e9 / 8) if bound_bytes else None
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = []
    for name in names:
        f = facts[name]
        pred = plans[name].predicted_s if name in plans else None
        row = {"case": case, "layouts": label, "size": total, "shape": list(shape),
               "impl": name, "seconds": med[name], "seconds_rounds": times[name],
               "iters": iters, "predicted_seconds": pred,
               "measured_over_predicted": med[name] / pred if pred else None,
               "cross_bytes": f["cross"], "intra_bytes": f["intra"],
               "sent_by_rank": f["sent_by_rank"], "plan_bytes_ok": f.get("plan_ok"),
               "planned_bytes_by_link": dict(plans[name].bytes_by_link) if name in plans
               else None, "bound_bytes": bound_bytes, "bound_seconds": bound,
               "over_bound": med[name] / bound if bound else None,
               "naive_over": med["naive"] / med[name], "wrong": f["wrong"]}
        rows.append(row)
        ratio = row["measured_over_predicted"]
        out(f"  {case:<16} {fmt_bytes(total):>7} {name:>9} | {med[name] * 1e3:9.2f} | "
            f"{'-' if pred is None else f'{pred * 1e3:.2f}':>9} | "
            f"{'-' if ratio is None else f'x{ratio:.2f}':>9} | {f['cross'] / MIB:9.2f} | "
            f"{f['intra'] / MIB:9.2f} | "
            f"{'-' if 'plan_ok' not in f else ('ok' if f['plan_ok'] else 'DIFF'):>4} | "
            f"{'-' if bound is None else f'{med[name] / bound:.2f}':>6} | "
            f"{med['naive'] / med[name]:7.2f} | {f['wrong']}")
    checks = issue_checks(case, rows, src, dst, hosts, total, bound)
    for line in checks["lines"]:
        out(line)
    return {"case": case, "layouts": label, "size": total, "shape": list(shape),
            "src": {"ranks": list(src.ranks), "placements": [repr(p) for p in src.placements]},
            "dst": {"ranks": list(dst.ranks), "placements": [repr(p) for p in dst.placements]},
            "plan": str(plans["auto"]), "rows": rows, "checks": checks["results"]}


def issue_checks(case: str, rows: list[dict], src: Layout, dst: Layout, hosts, total: int,
                 bound: float | None) -> dict:
    """Issue 19's checks where they apply: a replicated destination of 2 ranks on a host that
    holds no source rank, across hosts."""
    host_of = {r: h for h, ranks in enumerate(hosts) for r in ranks}
    dst_hosts = {host_of[r] for r in dst.ranks}
    src_hosts = {host_of[r] for r in src.ranks}
    replicated = all(isinstance(p, Replicate) for p in dst.placements)
    applies = (len(hosts) > 1 and replicated and len(dst.ranks) == 2 and len(dst_hosts) == 1
               and not dst_hosts & src_hosts and bound is not None)
    if not applies:
        return {"lines": [], "results": None}
    by = {r["impl"]: r for r in rows}
    auto, naive = by["auto"], by["naive"]
    once = auto["cross_bytes"] == total
    within = auto["seconds"] <= GOAL_BOUND * bound
    faster = naive["seconds"] / auto["seconds"] >= GOAL_NAIVE
    ratio = auto["measured_over_predicted"]
    predicted = ratio is not None and abs(ratio - 1) <= GOAL_PLANNER
    size = fmt_bytes(total)
    lines = [
        f"# check {case} {size}: auto sends each byte across once: counted cross "
        f"{auto['cross_bytes']} B, tensor {total} B: {'PASS' if once else 'MISS'}",
        f"# check {case} {size}: auto {auto['seconds'] * 1e3:.1f} ms within {GOAL_BOUND}x of the "
        f"link bound {bound * 1e3:.1f} ms (x{auto['seconds'] / bound:.2f}): "
        f"{'PASS' if within else 'MISS'}",
        f"# check {case} {size}: naive / auto {naive['seconds'] / auto['seconds']:.2f}x >= "
        f"{GOAL_NAIVE}: {'PASS' if faster else 'MISS'}",
        f"# check {case} {size}: auto predicted {auto['predicted_seconds'] * 1e3:.1f} ms, "
        f"measured x{ratio:.2f}, within {GOAL_PLANNER:.0%}: {'PASS' if predicted else 'MISS'}"]
    return {"lines": lines, "results": {"cross_once": once, "within_bound": within,
                                        "naive_speedup": faster, "predicted": predicted}}


# ----- main ---------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description="commlib.reshard on the paper's 1-to-m and n-to-m "
                                 "shapes against naive send/recv and the link bound (see the "
                                 "module docstring)")
    ap.add_argument("--sizes", default="1M,16M,64M",
                    help="tensor sizes in bytes, a comma list with K/M/G suffixes "
                         "(default 1M,16M,64M)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"a comma list of {', '.join(CASES)} (default all)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, the median is reported")
    ap.add_argument("--time", type=float, default=0.2,
                    help="seconds one timed loop takes for the slowest implementation "
                         "(at least one call; default 0.2)")
    ap.add_argument("--max-iters", type=int, default=100)
    ap.add_argument("--link-gbit", type=float, default=1.0,
                    help="host link rate in Gb/s for the bound (default 1.0, the vcluster's)")
    ap.add_argument("--patience", type=float, default=60.0,
                    help="seconds to wait out a slow phase of the host before a round (0: none)")
    ap.add_argument("--print-plan", action="store_true",
                    help="print auto's plan (str(plan)) of every case at every size")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    commlib.init()
    rank = commlib.get_rank()

    out = rank0_out(rank)

    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s]
        cases = [c for c in args.cases.split(",") if c]
        bad = [c for c in cases if c not in CASES]
        if bad or not cases or not sizes:
            raise argparse.ArgumentTypeError(f"--cases {args.cases!r}: choose from "
                                             f"{', '.join(CASES)}")
        if COMM.size < 2:
            raise argparse.ArgumentTypeError("run on at least 2 ranks (a source and a "
                                             "destination side)")
    except argparse.ArgumentTypeError as e:
        if rank == 0:
            ap.error(str(e))  # exit status 2, as the other benchmarks' usage errors
        sys.exit(2)
    dtype = DTYPES[args.dtype]
    hosts = host_layout()
    a, b = sides(hosts)
    multi = len(hosts) > 1
    out(f"# bench/reshard.py: {COMM.size} ranks on {len(hosts)} host(s) "
        f"({', '.join(f'host {h}: ranks {r}' for h, r in enumerate(hosts))}), commlib backend "
        f"{commlib.get_world_group().backend.name}, torch {torch.__version__}, "
        f"{os.cpu_count()} cores, tuning file {os.environ.get('COMMLIB_TUNING_FILE', '(default)')}")
    out(f"# source side A = ranks {a}, destination side B = ranks {b} "
        f"({'one host each' if multi else 'one host: the world split in halves'}); "
        f"{args.dtype}; link bound at {args.link_gbit:g} Gb/s"
        f"{'' if multi else ' (n/a: one host)'}; slowest rank, median of {args.rounds} rounds")
    out(f"# {'case':<16} {'size':>7} {'impl':>9} | {'ms':>9} | {'pred ms':>9} | "
        f"{'meas/pred':>9} | {'cross MiB':>9} | {'intra MiB':>9} | plan | {'/bound':>6} | "
        f"naive/x | #wrong")
    quiet = quiet_for(COMM, args.patience)
    points = []
    for case in cases:
        for nbytes in sizes:
            point = measure_point(case, nbytes, args, dtype, a, b, hosts, quiet, out)
            if args.print_plan:
                for line in point["plan"].splitlines():
                    out(f"#   {line}")
            points.append(point)
    rows = [r for p in points for r in p["rows"]]
    wrong = sum(r["wrong"] for r in rows)
    diff = sum(1 for r in rows if r["plan_bytes_ok"] is False)
    pred = [r for r in rows if r["measured_over_predicted"] is not None]
    ok = [r for r in pred if abs(r["measured_over_predicted"] - 1) <= GOAL_PLANNER]
    ok_auto = [r for r in ok if r["impl"] == "auto"]
    n_auto = sum(1 for r in pred if r["impl"] == "auto")
    out(f"# planner: {len(ok)} of {len(pred)} predictions within {GOAL_PLANNER:.0%} of the "
        f"measured time (auto: {len(ok_auto)} of {n_auto}): "
        f"{'PASS' if len(ok) == len(pred) else 'MISS'}")
    checked = [p["checks"] for p in points if p["checks"]]
    if checked:
        for key, what in (("cross_once", "auto sends each byte across the link once"),
                          ("within_bound", f"auto within {GOAL_BOUND}x of the link bound"),
                          ("naive_speedup", f"auto >= {GOAL_NAIVE}x faster than naive"),
                          ("predicted", f"auto's prediction within {GOAL_PLANNER:.0%}")):
            n = sum(1 for c in checked if c[key])
            out(f"# issue 19, replicated on a 2-rank mesh on another host: {what}: {n} of "
                f"{len(checked)} points: {'PASS' if n == len(checked) else 'MISS'}")
    else:
        out("# issue 19's checks: not applicable (they need a 2-rank destination host apart "
            "from the source host: vcluster mpirun -n 4 -ppn 2)")
    out(f"# counted bytes against the plans: {'ok' if diff == 0 else f'{diff} row(s) DIFF'}")
    out(quiet_summary(COMM))
    out(f"# wrong results: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if rank == 0 and args.json:
        write_json(args.json, {"bench": "reshard", "ranks": COMM.size, "hosts": hosts,
                               "source_side": a, "destination_side": b, "dtype": args.dtype,
                               "link_gbit": args.link_gbit, "points": points}, args, out)
    commlib.finalize()
    return 1 if wrong or diff else 0


if __name__ == "__main__":
    sys.exit(main())
