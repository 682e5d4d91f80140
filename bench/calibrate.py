"""Measure the cost model's parameters on this host and write the tuning file.

    mpirun -n N python bench/calibrate.py [--out FILE] [--quick]

For the group of all N ranks it measures, with every rank busy at once (so oversubscribed cores
count):

* α and β of the link between ranks (``shm`` on one host): a ring shift through commlib's own
  point-to-point step path (the backend's isend/irecv driven by the progress loop, exactly as an
  algorithm's step runs), timed per step from 8 B to 16 MiB and fitted to ``t = α + n·β``; the
  measured step times are kept too, and the model prices steps from them;
* γ, the local reduction cost: commlib's reduce kernel (float32 SUM) per byte, 1 to 16 MiB;
* the engine's own collectives (``algorithm="native"``): all_reduce, all_gather, reduce_scatter
  and broadcast from 8 B to 64 MiB, the curves the model prices ``native`` from.

Every value is the median over rounds of the slowest rank's mean. The result is merged into the
tuning file (``COMMLIB_TUNING_FILE``, else the per-host cache; see commlib/tuning/calibration.py)
under ``<backend>/<N>``: run it once per group size you use (e.g. N = 2, 3, 4).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from mpi4py import MPI

import commlib
from commlib._progress import start
from commlib.collectives import _ctx
from commlib.kernels import reduce_
from commlib.ops import ReduceOp
from commlib.tuning.calibration import fit_alpha_beta, save_entry, tuning_path
from commlib.tuning.model import Curve, LinkCost

torch.set_num_threads(1)

P2P_SIZES = [8 << (3 * i) for i in range(8)]          # 8 B .. 16 MiB
NATIVE_SIZES = [8 << (2 * i) for i in range(12)] + [64 << 20]  # 8 B .. 32 MiB, and 64 MiB
GAMMA_SIZES = [1 << 20, 4 << 20, 16 << 20]


def _time_loop(fn, iters: int, comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    mine = (time.perf_counter() - t0) / iters
    return comm.allreduce(mine, op=MPI.MAX)  # the slowest rank: a collective ends with it


def measure(fn, comm, target: float, rounds: int) -> float:
    """Median over ``rounds`` of the slowest rank's mean time of ``fn``, after warm-up, with an
    iteration count that makes each loop last about ``target`` seconds (agreed by all ranks)."""
    fn()
    probe = _time_loop(fn, 2, comm)
    iters = int(min(max(target / max(probe, 1e-7), 3), 20000))
    return statistics.median(_time_loop(fn, iters, comm) for _ in range(rounds))


def _shift_steps(ctx, send, recv, steps):
    nxt, prv = (ctx.rank + 1) % ctx.size, (ctx.rank - 1) % ctx.size
    for _ in range(steps):
        yield [ctx.isend(send, nxt), ctx.irecv(recv, prv)]


def p2p_points(group, comm, target, rounds, steps=4) -> dict[int, float]:
    """Seconds per ring-shift step at each size."""
    points = {}
    for nbytes in P2P_SIZES:
        send = torch.zeros(nbytes, dtype=torch.uint8)
        recv = torch.empty_like(send)

        def step(send=send, recv=recv):
            group.seq += 1
            start(_shift_steps(_ctx(group, None), send, recv, steps), None, (send, recv), group,
                  "calibrate", group.seq, False)

        points[nbytes] = measure(step, comm, target, rounds) / steps
    return points


def gamma(comm, target, rounds) -> float:
    per_byte = []
    for nbytes in GAMMA_SIZES:
        a = torch.ones(nbytes // 4)
        b = torch.ones(nbytes // 4)
        per_byte.append(measure(lambda a=a, b=b: reduce_(a, b, ReduceOp.SUM), comm, target, rounds)
                        / nbytes)
    return statistics.median(per_byte)


def native_curves(comm, p, target, rounds) -> dict[str, dict[int, float]]:
    curves: dict[str, dict[int, float]] = {c: {} for c in
                                           ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}
    for nbytes in NATIVE_SIZES:
        count = max(p, nbytes // 4 // p * p)  # float32 elements, divisible by the group size
        full = torch.ones(count)
        part = torch.ones(count // p)
        size = count * 4
        calls = {
            "all_reduce": lambda f=full: commlib.all_reduce(f, algorithm="native"),
            "all_gather": lambda f=full, q=part: commlib.all_gather_into_tensor(f, q, algorithm="native"),
            "reduce_scatter": lambda f=full, q=part: commlib.reduce_scatter_tensor(q, f, algorithm="native"),
            "broadcast": lambda f=full: commlib.broadcast(f, 0, algorithm="native"),
        }
        for name, call in calls.items():
            curves[name][size] = measure(call, comm, target, rounds)
    return curves


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/calibrate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="tuning file (default: COMMLIB_TUNING_FILE, "
                        "else the per-host cache)")
    parser.add_argument("--quick", action="store_true", help="shorter loops, fewer rounds")
    args = parser.parse_args(argv)
    commlib.init()
    group = commlib.get_world_group()
    comm = MPI.COMM_WORLD
    p, rank = group.size, group.rank
    target, rounds = (0.02, 3) if args.quick else (0.1, 5)
    out = args.out or str(tuning_path())

    points = p2p_points(group, comm, target, rounds) if p > 1 else {8: 0.0, 16: 0.0}
    alpha, beta = fit_alpha_beta(points) if p > 1 else (0.0, 0.0)
    g = gamma(comm, target, rounds)
    native = native_curves(comm, p, target, rounds) if p > 1 else {}
    if rank == 0:
        link = LinkCost(alpha, beta, g, Curve(points) if p > 1 else None)
        save_entry(out, group.backend.name, p, {"shm": link}, native)
        print(f"# commlib calibration: backend {group.backend.name}, {p} ranks -> {out}")
        print(f"# link shm: alpha {alpha * 1e6:.2f} us, beta {1 / beta / 1e9 if beta else float('inf'):.2f} GB/s, "
              f"gamma (reduce) {1 / g / 1e9:.2f} GB/s")
        print("#      bytes   step us   fit us")
        for n, t in points.items():
            print(f"{n:12d} {t * 1e6:9.2f} {(alpha + n * beta) * 1e6:8.2f}")
        if native:
            names = list(native)
            print("#      bytes " + " ".join(f"{c:>15}" for c in names) + "   (native, us)")
            for n in next(iter(native.values())):
                print(f"{n:12d} " + " ".join(f"{native[c][n] * 1e6:15.2f}" for c in names))
    commlib.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
