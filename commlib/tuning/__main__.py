"""``python -m commlib.tuning``: predicted time and busbw per algorithm for a described machine.

    python -m commlib.tuning --topology hgx-h100-8 --nodes 16 --op all_reduce
    python -m commlib.tuning --topology dgx-a100 --op all_gather -b 1K -e 1G -f 8
    python -m commlib.tuning --topology my-host.xml --nodes 4 --nics-per-host 4 --nic-gbps 200

``--topology`` is a catalog system (``python -m commlib.topology --list`` names them) or a
topology file; ``--nodes`` composes that many hosts with a rail-optimized network
(``--nics-per-host``/``--nic-gbps`` replace each host's NICs, as ``commlib.topology.cluster``
does). busbw uses nccl-tests' factors, so the figures compare with published nccl-tests runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..config import parse_bytes
from ..errors import CommError
from ..topology import load
from .machine import plan_machine
from .model import predict

_BUSBW = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fmt_size(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def busbw(collective: str, nbytes: int, p: int, seconds: float) -> float:
    """GB/s on nccl-tests' bus-bandwidth scale."""
    return nbytes / seconds / 1e9 * _BUSBW[collective](p) if seconds > 0 else float("inf")


def table(plan, collective: str, sizes: list[int]) -> list[str]:
    p = plan.ranks
    names = [x.algorithm for x in predict(collective, sizes[-1], p, plan.table)]
    names = sorted(n for n in names if n != "native")
    head = f"# {'size':>8} " + " ".join(f"{n + ' us':>20} {'busbw':>7}" for n in names) + "   best"
    lines = [head]
    for n in sizes:
        preds = {x.algorithm: x.seconds for x in predict(collective, n, p, plan.table)}
        best = min(names, key=lambda a: (preds[a], a))
        cells = " ".join(f"{preds[a] * 1e6:20.1f} {busbw(collective, n, p, preds[a]):7.1f}" for a in names)
        lines.append(f"  {_fmt_size(n):>8} {cells}   {best}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.tuning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", required=True, help="catalog system name or topology file")
    parser.add_argument("--nodes", type=int, default=1, help="hosts of that system (default 1)")
    parser.add_argument("--op", default="all_reduce", choices=sorted(_BUSBW), help="collective")
    parser.add_argument("--nics-per-host", type=int, default=None)
    parser.add_argument("--nic-gbps", type=float, default=None, help="NIC rate in Gb/s")
    parser.add_argument("-b", "--minbytes", type=_size, default=8)
    parser.add_argument("-e", "--maxbytes", type=_size, default=8 << 30)
    parser.add_argument("-f", "--stepfactor", type=int, default=8)
    args = parser.parse_args(argv)
    if args.stepfactor < 2 or args.minbytes < 1 or args.maxbytes < args.minbytes:
        parser.error("need -f >= 2 and 1 <= -b <= -e")
    system = args.topology
    try:
        if os.path.exists(system):
            system = load(system)
        plan = plan_machine(system, args.nodes, args.nics_per_host, args.nic_gbps)
    except CommError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes, n = [], args.minbytes
    while n <= args.maxbytes:
        sizes.append(n)
        n *= args.stepfactor
    print(f"# commlib cost model: {args.op} on {plan.describe()}")
    print("# predicted time (us) and busbw (GB/s, nccl-tests factors) per algorithm")
    print("\n".join(table(plan, args.op, sizes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
