"""What waiting for an all-reduce costs the rank's cores: CPU time against wall time, commlib's
process group against gloo, with the caller's naps across hosts on and off, in the same rounds.

    vcluster mpirun -n 2 -ppn 1 -- python bench/wait_cpu.py
    mpiexec -n 2 python bench/wait_cpu.py --sizes 4

One iteration all-reduces one buffer per size of ``--sizes`` (MiB; default: the 12 buckets that
``ddp_bucket_mb`` proposed for bench/ddp.py's transformer at 2 hosts x 1 rank, uncalibrated) on
``torch.distributed``, blocking one by one (``blocking``) or all issued asynchronously then waited
for in order (``async``, as DDP's reducer does at the end of the backward). Rows: ``gloo`` (a gloo
group over the same ranks), ``commlib`` (the default group on the "commlib" backend) and
``commlib-spin``, the same with ``commlib.runtime.progress.WAIT_SPIN_S`` endless: the caller
spins and yields throughout, as before 2026-11-29's second session. Per row: the median over
rounds of the slowest rank's wall time per iteration, and of the most CPU time (all of the
process's threads: ``time.process_time``) any rank spent per iteration; the last lines compare
each commlib row's CPU with gloo's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import commlib  # before mpi4py: commlib sets UCX's TCP defaults before MPI initializes
from mpi4py import MPI

import commlib.runtime.progress as progress
import ddp

COMM = MPI.COMM_WORLD
DEFAULT_SIZES = "1.25," + ",".join(["1"] * 11)


def rows(gloo) -> dict:
    """name -> (group, asynchronous, spin)."""
    return {f"{name}-{how}": (group, how == "async", spin)
            for name, group, spin in (("gloo", gloo, False), ("commlib", None, False),
                                      ("commlib-spin", None, True))
            for how in ("blocking", "async")}


def iteration(bufs, group, asynchronous: bool) -> None:
    if asynchronous:
        for work in [dist.all_reduce(b, group=group, async_op=True) for b in bufs]:
            work.wait()
    else:
        for b in bufs:
            dist.all_reduce(b, group=group)


def measure(bufs, group, asynchronous: bool, spin: bool, iters: int) -> tuple[float, float]:
    """(slowest rank's wall s, most CPU s of any rank) per iteration."""
    saved = progress.WAIT_SPIN_S
    if spin:
        progress.WAIT_SPIN_S = float("inf")
    try:
        COMM.Barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(iters):
            iteration(bufs, group, asynchronous)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        progress.WAIT_SPIN_S = saved
    return COMM.allreduce(wall / iters, op=MPI.MAX), COMM.allreduce(cpu / iters, op=MPI.MAX)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="MiB per buffer, comma-separated")
    ap.add_argument("--iters", type=int, default=5, help="iterations per row and round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds (rows in a new order each)")
    args = ap.parse_args(argv)
    mib = [float(x) for x in args.sizes.split(",")]
    gloo = ddp.start(args)
    torch.set_num_threads(1)
    bufs = [torch.zeros(max(1, int(m * 2**20) // 4)) for m in mib]  # sums stay finite
    table = rows(gloo)
    for name, (group, asynchronous, spin) in table.items():  # warm up: connections, buffers
        measure(bufs, group, asynchronous, spin, 1)
    samples = {name: [] for name in table}
    order = list(table)
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        for name in order:
            samples[name].append(measure(bufs, *table[name], args.iters))
    hosts = len(set(COMM.allgather(MPI.Get_processor_name())))
    if COMM.rank == 0:
        med = {n: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s))
               for n, s in samples.items()}
        print(f"# bench/wait_cpu.py: {COMM.size} ranks on {hosts} host(s); per iteration "
              f"{len(mib)} all-reduces, {sum(mib):.2f} MiB; median of {args.rounds} rounds of "
              f"{args.iters} iterations; commlib engine {commlib.get_backend()}")
        print(f"# {'row':>21} | {'wall ms':>8} | {'CPU ms':>7} | CPU/wall")
        for name, (wall, cpu) in med.items():
            print(f"  {name:>21} | {1e3 * wall:8.2f} | {1e3 * cpu:7.2f} | {cpu / wall:8.2f}")
        for name, (wall, cpu) in med.items():
            if name.startswith("commlib"):
                ref = med["gloo-" + name.rsplit("-", 1)[1]]
                print(f"# {name}: CPU {cpu / ref[1]:.1f}x gloo's, wall {wall / ref[0]:.3f}x")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
