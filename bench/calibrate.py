"""Measure the cost model's parameters on this host and write the tuning file.

    mpirun -n N python bench/calibrate.py [--out FILE] [--quick]

For the group of all N ranks it measures, with every rank busy at once (so oversubscribed cores
count; ranks on several hosts measure each link class: ``shm`` inside every host at once, ``net``
between hosts with one pair crossing, ``net_rails`` with every local rank's pair crossing at once):

* α and β of the link between ranks (``shm`` on one host): a ring shift through commlib's own
  point-to-point step path (the backend's isend/irecv driven by the progress loop, exactly as an
  algorithm's step runs), timed per step from 8 B to 16 MiB and fitted to ``t = α + n·β``; the
  measured step times are kept too, and the model prices steps from them;
* across hosts, ``busy``: the share of a transfer's time that a matmul running beside it loses
  (the cores the network's work takes; 0 where a NIC does it all), :func:`busy_share`;
* γ, the local reduction cost: commlib's reduce kernel (float32 SUM) per byte, 1 to 16 MiB;
* the curve of every algorithm eligible on the group (the engine's own collectives, the
  shared-memory ones where the group has a segment, commlib's point-to-point ones) for
  all_reduce, all_gather, reduce_scatter and broadcast from 8 B to 64 MiB; across hosts each
  call from 64 KiB on follows a call of a quarter its size, as in training (:func:`curves`).

Every value is the median over rounds of the slowest rank's mean, taken outside the host's slow
phases (see :class:`Quiet`). The result is merged into the
tuning file (``COMMLIB_TUNING_FILE``, else the per-host cache; see commlib/tuning/calibration.py)
under ``<backend>/<N>``: run it once per group size you use (e.g. N = 2, 3, 4).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch
import commlib  # before mpi4py: commlib sets UCX's TCP defaults before MPI initializes
from mpi4py import MPI

from _quiet import quiet_for, quiet_summary, set_patience, time_loop as _time_loop
from commlib.algorithms import Call
from commlib.api.collectives import _ctx
from commlib.kernels import reduce_
from commlib.ops import ReduceOp
from commlib.runtime.progress import start
from commlib.tuning.calibration import entry_key, fit_alpha_beta, load, save_entry, tuning_path
from commlib.tuning.model import Curve, LinkCost
from commlib.tuning.selector import eligible

torch.set_num_threads(1)

P2P_SIZES = [8 << (3 * i) for i in range(8)]          # 8 B .. 16 MiB
NATIVE_SIZES = [8 << (2 * i) for i in range(12)] + [64 << 20]  # 8 B .. 32 MiB, and 64 MiB
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
GAMMA_SIZES = [1 << 20, 4 << 20, 16 << 20]


def measure_many(fns: dict, comm, target: float, rounds: int, raw: bool = False) -> dict:
    """Median over ``rounds`` of the slowest rank's mean time of each of ``fns`` (name ->
    callable; with ``raw``, every round's time, in round order), after warm-up, each with an
    iteration count that makes its loop last about ``target`` seconds (agreed by all ranks). The
    rounds interleave the callables, in an order that rotates every round, each loop after one
    untimed call of its own (the loop before it leaves caches in its state), and each round
    waits out the host's slow phases first (bench/_quiet.py): drifts of the machine fall on all
    of them alike, so their ratios hold."""
    quiet = quiet_for(comm)  # every communicator measured: main() sets the patience
    quiet.wait()
    iters = {}
    for name, fn in fns.items():
        fn()
        probe = _time_loop(fn, 2, comm)
        iters[name] = int(min(max(target / max(probe, 1e-7), 3), 20000))
    names = list(fns)
    samples: dict = {name: [] for name in names}
    for k in range(rounds):
        if k:
            quiet.wait()
        for name in names[k % len(names):] + names[:k % len(names)]:
            fns[name]()
            samples[name].append(_time_loop(fns[name], iters[name], comm))
    return samples if raw else {name: statistics.median(v) for name, v in samples.items()}


def measure(fn, comm, target: float, rounds: int) -> float:
    """:func:`measure_many` of one callable."""
    return measure_many({0: fn}, comm, target, rounds)[0]


def _shift_steps(ctx, send, recv, steps):
    nxt, prv = (ctx.rank + 1) % ctx.size, (ctx.rank - 1) % ctx.size
    for _ in range(steps):
        yield [ctx.isend(send, nxt), ctx.irecv(recv, prv)]


def p2p_points(group, comm, target, rounds, steps=4) -> dict[int, float]:
    """Seconds per ring-shift step at each size, on ``group`` (``comm``: its MPI communicator,
    for the timing barriers)."""
    points = {}
    for nbytes in P2P_SIZES:
        send = torch.zeros(nbytes, dtype=torch.uint8)
        recv = torch.empty_like(send)

        def step(send=send, recv=recv):
            group.seq += 1
            start(_shift_steps(_ctx(group, "calibrate", None), send, recv, steps), None, (send, recv), group,
                  "calibrate", group.seq, False)

        points[nbytes] = measure(step, comm, target, rounds) / steps
    return points


BUSY_BYTES, BUSY_STEPS, BUSY_DIM = 1 << 20, 8, 256  # a SUMMA panel's order of size; the matmul


def _one_way_steps(ctx, send, recv, steps):
    """Even ranks send to the next, odd ranks receive from the previous: one direction at a time,
    as a broadcast's or a reduce's transfer (a ring shift moves both ways at once, twice the
    network's work per second)."""
    if ctx.rank % 2 == 0 and ctx.rank + 1 < ctx.size:
        for _ in range(steps):
            yield [ctx.isend(send, ctx.rank + 1)]
    elif ctx.rank % 2 == 1:
        for _ in range(steps):
            yield [ctx.irecv(recv, ctx.rank - 1)]


def busy_share(group, comm, target, rounds) -> tuple[float, dict]:
    """The share of a transfer's time on ``group``'s link during which it keeps the cores busy:
    one-way steps of :data:`BUSY_BYTES` posted asynchronously (commlib's progress drives them, as
    an overlapped layer's broadcasts), then a matmul loop 1.5x their length, then the wait. With ``x``
    the transfer alone, ``m`` the loop alone and ``b`` both, the loop lost ``b - m`` to the
    transfer: ``(b - m) / x``, clamped to [0, 1]. Every rank runs it at once, so the cores are
    shared as in the job. Also returns the three times (seconds)."""
    send = torch.zeros(BUSY_BYTES, dtype=torch.uint8)
    recv = torch.empty_like(send)
    a, b = torch.randn(BUSY_DIM, BUSY_DIM), torch.randn(BUSY_DIM, BUSY_DIM)
    out = torch.empty_like(a)

    def post():
        group.seq += 1
        return start(_one_way_steps(_ctx(group, "calibrate", None), send, recv, BUSY_STEPS), None,
                     (send, recv), group, "calibrate", group.seq, True)

    def transfer():
        post().wait()

    transfer()
    alone = _time_loop(transfer, 3, comm)
    one = _time_loop(lambda: torch.mm(a, b, out=out), 20, comm)
    reps = comm.bcast(max(1, round(1.5 * alone / one)), root=0)  # the same loop on every rank

    def matmuls():
        for _ in range(reps):
            torch.mm(a, b, out=out)

    def both():
        work = post()
        matmuls()
        work.wait()

    t = measure_many({"transfer": transfer, "matmul": matmuls, "both": both}, comm, target, rounds)
    return min(1.0, max(0.0, (t["both"] - t["matmul"]) / t["transfer"])), t


def gamma(comm, target, rounds) -> float:
    per_byte = []
    for nbytes in GAMMA_SIZES:
        a = torch.ones(nbytes // 4)
        b = torch.ones(nbytes // 4)
        per_byte.append(measure(lambda a=a, b=b: reduce_(a, b, ReduceOp.SUM), comm, target, rounds)
                        / nbytes)
    return statistics.median(per_byte)


def run(coll: str, full, part, algorithm: str) -> None:
    """One call of ``coll`` on the calibration buffers (``full`` is the n-byte buffer)."""
    if coll == "all_reduce":
        commlib.all_reduce(full, algorithm=algorithm)
    elif coll == "all_gather":
        commlib.all_gather_into_tensor(full, part, algorithm=algorithm)
    elif coll == "reduce_scatter":
        commlib.reduce_scatter_tensor(part, full, algorithm=algorithm)
    else:
        commlib.broadcast(full, 0, algorithm=algorithm)


def measured_algorithms(group, coll: str) -> list[str]:
    """The algorithms calibration measures curves of: every algorithm eligible on the group.
    The engine's own and the shared-memory ones have no step formula that describes them well;
    commlib's point-to-point algorithms have formulas, but on CPU ranks they also pay what no
    step formula sees (a fresh temporary per call: page faults above the allocator's cache, the
    local reduction's cache misses), so a measured curve prices them better where one exists.
    The formulas price everything else: other group sizes, other machines, planning."""
    return eligible(group.resources, Call(coll, 0)) if group.model is not None else ["native"]


def curves(group, comm, p, target, rounds, after_smaller: bool = False
           ) -> dict[str, dict[str, dict[int, float]]]:
    """Every measured algorithm's time per call at each of NATIVE_SIZES.

    ``after_smaller`` (a group across hosts): from CONTEXT_FROM bytes on, a call is timed right
    after a call of the same algorithm at the size before it in the table (a quarter of it), and
    that call's time alone (repeated, in the same rounds) is subtracted. Training issues
    collectives of different sizes back to back (DDP's buckets, a layer's operations); the same
    call repeated is the best case of a network protocol's state. Measured on the vcluster (2
    hosts, 1 Gb/s, MPICH): MPI's own all-reduce of 8 MiB took 70 ms repeated and 103 ms after a
    1 MiB one, of 10-24 MiB 40-100 ms more, while commlib's point-to-point algorithms paid only
    the smaller call's time; repeated calls priced them alike and the model chose MPI's."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for coll in COLLECTIVES:
        out[coll] = {a: {} for a in measured_algorithms(group, coll)}
    prev = None  # (bytes, full, part) of the size before
    for nbytes in NATIVE_SIZES:
        count = max(p, nbytes // 4 // p * p)  # float32 elements, divisible by the group size
        full, part = torch.ones(count), torch.ones(count // p)
        in_context = after_smaller and prev is not None and nbytes >= CONTEXT_FROM
        for coll, algos in out.items():
            fns = {a: functools.partial(run, coll, full, part, a) for a in algos}
            if in_context:  # each pair, and the smaller call alone, in the same rounds
                small = {a: functools.partial(run, coll, *prev[1:], a) for a in algos}
                fns = {**{a: functools.partial(_after, small[a], fn) for a, fn in fns.items()},
                       **{(a, "alone"): fn for a, fn in small.items()}}
            times = measure_many(fns, comm, target, rounds)
            for a in algos:
                t = times[a]
                if in_context:  # less the smaller call's own time; a call costs at least that
                    t = max(t - times[a, "alone"], times[a, "alone"])
                algos[a][count * 4] = t
        prev = (count * 4, full, part)
    return out


CONTEXT_FROM = 64 << 10  # bytes: below, a call's time is its latency, whatever came before


def _after(first, then) -> None:
    first()
    then()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/calibrate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="tuning file (default: COMMLIB_TUNING_FILE, "
                        "else the per-host cache)")
    parser.add_argument("--quick", action="store_true", help="shorter loops, fewer rounds")
    parser.add_argument("--patience", type=float, default=None, metavar="S",
                        help="wait up to S seconds per point for the host's slow phases to pass "
                             "(bench/_quiet.py; 0: do not check; default 60, --quick 0: a check, not a measurement)")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="measure sizes up to this many bytes only (a quick check)")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing when the tuning file already has this group size "
                             "(calibrated here: an entry a job probed for itself is measured again)")
    args = parser.parse_args(argv)
    # This is the full calibration: a job's own short probe (COMMLIB_AUTOTUNE) would only precede it.
    os.environ["COMMLIB_AUTOTUNE"] = "0"
    commlib.init()
    group = commlib.get_world_group()
    comm = MPI.COMM_WORLD
    p, rank = group.size, group.rank
    # the loop length and rounds of bench/model_accuracy.py, which checks these numbers
    target, rounds = (0.02, 3) if args.quick else (0.05, 5)
    set_patience(args.patience if args.patience is not None else 0.0 if args.quick else 60.0)
    if args.max_bytes is not None:
        global P2P_SIZES, NATIVE_SIZES, GAMMA_SIZES
        P2P_SIZES = [n for n in P2P_SIZES if n <= args.max_bytes] or P2P_SIZES[:2]
        NATIVE_SIZES = [n for n in NATIVE_SIZES if n <= args.max_bytes] or NATIVE_SIZES[:2]
        GAMMA_SIZES = GAMMA_SIZES[:1]
    out = args.out or str(tuning_path())
    layout = group.resources.layout
    hosts = layout.host_count  # one rank on each of 2 hosts is mpi/2@2, not the one-host mpi/2
    key = entry_key(group.backend.name, p, hosts)
    known = load(out)["groups"].get(key) if args.if_missing and os.path.exists(out) else None
    if known is not None and "probe" not in known:  # an entry only a job's probe wrote: measure
        if rank == 0:
            print(f"# commlib calibration: {out} already has {key}; nothing to do")
        commlib.finalize()
        return 0

    links: dict[str, dict[int, float]] = {}
    busy = None
    if p > 1 and hosts == 1:
        links["shm"] = p2p_points(group, comm, target, rounds)
    elif p > 1:
        if not layout.uniform:
            raise SystemExit(f"bench/calibrate.py: hosts have different rank counts {layout.hosts}; "
                             "calibrate with the same number of ranks on every host")
        per_host = layout.ranks_per_host
        mesh = commlib.Mesh.from_topology((hosts, per_host), ("rail", "local"))
        rail = mesh.group("rail")
        if per_host > 1:  # every host at once, as in a hierarchical algorithm's intra stage
            intra = mesh.group("local")
            links["shm"] = p2p_points(intra, intra.backend.comm, target, rounds)
        links["net_rails"] = p2p_points(rail, rail.backend.comm, target, rounds)  # all rails at once
        if per_host == 1:  # one rank per host: the one rail is all of them
            links["net"] = links["net_rails"]
        elif mesh.coordinate("local") == 0:  # one rail alone: a flat algorithm's host crossing
            links["net"] = p2p_points(rail, rail.backend.comm, target, rounds)
        comm.Barrier()
        busy, busy_times = busy_share(rail, rail.backend.comm, target, rounds)  # all rails at once
        busy = comm.bcast(busy, root=0)
    g = gamma(comm, target, rounds)
    measured = (curves(group, comm, p, target, rounds, after_smaller=hosts > 1) if p > 1
                else {})
    if rank == 0:  # rank 0 is in every measured group (position 0 of the mesh)
        costs = {}
        print(f"# commlib calibration: backend {group.backend.name}, {p} ranks on {hosts} host(s) "
              f"-> {out} [{key}]")
        for name, points in links.items():
            alpha, beta = fit_alpha_beta(points)
            costs[name] = LinkCost(alpha, beta, g, Curve(points), busy if name != "shm" else 0.0)
            print(f"# link {name}: alpha {alpha * 1e6:.2f} us, beta "
                  f"{1 / beta / 1e9 if beta else float('inf'):.2f} GB/s, gamma (reduce) {1 / g / 1e9:.2f} GB/s")
            print("#      bytes   step us   fit us")
            for n, t in points.items():
                print(f"{n:12d} {t * 1e6:9.2f} {(alpha + n * beta) * 1e6:8.2f}")
        if busy is not None:
            x, m, b = (busy_times[k] * 1e3 for k in ("transfer", "matmul", "both"))
            print(f"# links between hosts: busy {busy:.2f} of a transfer's time (matmul loop "
                  f"{m:.1f} ms alone, {b:.1f} ms beside {BUSY_STEPS} one-way steps of "
                  f"{BUSY_BYTES} B taking {x:.1f} ms alone)")
        if not costs:
            costs["shm"] = LinkCost(0.0, 0.0, g)
        save_entry(out, key, costs, measured)
        if measured:
            cols = [(c, a) for c, algos in measured.items() for a in algos]
            print("#      bytes " + " ".join(f"{c + ':' + a:>26}" for c, a in cols) + "   (us)")
            for n in measured["all_reduce"]["native"]:
                print(f"{n:12d} " + " ".join(f"{measured[c][a][n] * 1e6:26.2f}" for c, a in cols))
        print(quiet_summary(comm))
    commlib.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
