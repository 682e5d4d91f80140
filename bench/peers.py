"""commlib's all_reduce against its peers on one host, in one run: MPI's ``Allreduce`` (mpi4py) and
DeepSpeed's CPU shared-memory all-reduce (``deepspeed.comm.inference_all_reduce``).

    mpiexec -n 4 python bench/peers.py [-b 8 -e 64M -f 4] [--rounds 5]

float32 SUM on the same buffer size for every implementation, interleaved per size in rounds
whose order rotates (``calibrate.measure_many``: the median over rounds of the slowest rank's
mean, outside the host's slow phases), and each rank's result checked against the definition.
DeepSpeed is optional (``pip install deepspeed ninja``; it JIT-builds its shared-memory op on first
use and runs with ``DS_ACCELERATOR=cpu``); without it the column is empty and says why. The ranks
are launched as a user launches them: bind with ``-bind-to core`` only to compare.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import commlib  # before mpi4py: commlib sets UCX's TCP defaults before MPI initializes
from mpi4py import MPI

from _harness import init_gloo, parse_size
from _quiet import set_patience
from calibrate import measure_many, quiet_summary


def deepspeed_all_reduce(comm):
    """DeepSpeed's shared-memory all-reduce over the MPI ranks (one host), or why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", comm.rank), ("WORLD_SIZE", comm.size), ("LOCAL_RANK", comm.rank),
                       ("LOCAL_SIZE", comm.size)):
        os.environ[key] = str(value)
    try:
        import deepspeed
        from deepspeed import comm as dscomm
    except ImportError as exc:
        return None, f"deepspeed not installed ({exc}): pip install deepspeed ninja"
    init_gloo(comm)  # torch.distributed first: DeepSpeed takes the process group it finds
    deepspeed.init_distributed(dist_backend="gloo")
    probe = torch.ones(4)
    dscomm.inference_all_reduce(probe)
    if probe[0].item() != comm.size:
        return None, f"inference_all_reduce gave {probe[0].item()}, expected {comm.size}"
    return dscomm.inference_all_reduce, "deepspeed " + deepspeed.__version__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/peers.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    parser.add_argument("-f", "--stepfactor", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--time", type=float, default=0.05, help="seconds per timed loop")
    parser.add_argument("--patience", type=float, default=60.0, metavar="S",
                        help="wait up to S s per point for the host's slow phases (0: no check)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    commlib.init()
    comm = MPI.COMM_WORLD
    p = comm.size
    set_patience(args.patience)
    ds, ds_how = deepspeed_all_reduce(comm)
    if comm.rank == 0:
        print(f"# all_reduce float32 SUM, {p} ranks; peers: MPI {MPI.Get_library_version().splitlines()[0].strip()}"
              f", {ds_how}; model from {commlib.get_world_group().model.source}")
        print(f"# {'bytes':>10} {'commlib us':>12} {'MPI us':>10} {'DeepSpeed us':>13} "
              f"{'MPI/commlib':>12} {'DS/commlib':>11}  algorithm")
    nbytes = args.minbytes
    worst = []
    while nbytes <= args.maxbytes:
        t = torch.zeros(max(1, nbytes // 4))
        fns = {"commlib": lambda t=t: commlib.all_reduce(t),
               "mpi": lambda t=t: comm.Allreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM)}
        if ds is not None:
            fns["deepspeed"] = lambda t=t: ds(t)
        for name, fn in fns.items():  # each is an all-reduce: ones sum to p
            t.fill_(1.0)
            fn()
            if not bool((t == p).all()):
                raise SystemExit(f"bench/peers.py: {name} all-reduce of {nbytes} B is wrong on rank {comm.rank}")
        t.zero_()  # timed on zeros: sums stay finite
        times = measure_many(fns, comm, args.time, args.rounds)
        algo = commlib.tuning.select("all_reduce", t.nbytes, commlib.get_world_group(), None,
                                     "all_reduce", t.dtype).name
        if comm.rank == 0:
            c, m, d = times["commlib"], times["mpi"], times.get("deepspeed")
            worst.append(min(m, d if d is not None else m) / c)
            print(f"  {t.nbytes:10d} {c * 1e6:12.1f} {m * 1e6:10.1f} "
                  f"{'-' if d is None else f'{d * 1e6:.1f}':>13} {m / c:12.2f} "
                  f"{'-' if d is None else f'{d / c:.2f}':>11}  {algo}")
        nbytes *= args.stepfactor
    if comm.rank == 0:
        print(f"# best peer / commlib: lowest {min(worst):.2f} (above 1: commlib faster at every size)")
        print(quiet_summary(comm))
    commlib.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
