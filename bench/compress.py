"""Compressed communication (``commlib.compress``): how fast the codecs run, and what compression
buys the collectives, beside the uncompressed ones and the link bound.

Run under ``mpiexec`` on one host, or across hosts (the multi-host cluster of docs/overlap.md)::

    mpiexec -n 2 .venv/bin/python bench/compress.py --part codecs
    mpiexec -n 4 .venv/bin/python bench/compress.py --part collectives --sizes 16M,64M
    vcluster mpirun -n 4 -ppn 2 -- env COMMLIB_TUNING_FILE=$T .venv/bin/python bench/compress.py

**codecs** (rank 0 only, the others idle): encode and decode (-and-accumulate into float32) GB/s
of each codec on float32 inputs, counted on the float32 side (4 bytes per element), against a
``torch.Tensor.copy_`` (memcpy) of the same bytes measured in the same run; ``C`` is the
extension's path, ``torch`` the definition. Median of ``--rounds`` best-of-3 timings. The check:
the C encode and decode each at >= 30% of memcpy. Then **error against bits** (rank 0): for each
codec setting, the bits sent per element (``8 nbytes(n) / n``), the relative RMS and max error of
one round trip on 1 Mi standard-normal float32 values, and the largest error over the documented
``bound``; the check: that ratio <= 1 everywhere.

**collectives**: for each float32 size and codec, the slowest rank's mean time per call (a loop
after a barrier, median of ``--rounds`` rounds, each after the quiet gate of bench/_quiet.py) of

* ``mpi``: mpi4py's ``Allreduce`` (uncompressed, the reference), ``commlib``: commlib's
  all-reduce (uncompressed);
* ``auto``, ``compressed``, ``hierarchical`` (where the group spans hosts with several ranks on
  each): ``commlib.compress.all_reduce(..., algorithm=...)``;
* the compressed ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` beside commlib's
  uncompressed ones.

Columns: ``ms``; ``x mpi``: MPI's time over this row's (the speed-up; for the reduce-scatter and
all-gather rows, commlib's uncompressed one's time over this row's); ``wire MiB``: bytes this
rank sent, counted (``traffic()``'s ``compress.wire``), and ``formula`` whether it equals
``2 (p-1) nbytes(ceil(n/p))`` (flat; hierarchical: the same across hosts on the shard; the
reduce-scatter and the all-gather each send half of it, ``(p-1) nbytes(n/p)``);
``/bound``: time over the uncompressed all-reduce's link bound (each host must send
``2 (h-1)/h`` of the buffer across its link: ``--link-gbit``, default 1 Gb/s; ``-`` on one host);
``max rel err``: the largest |result - exact| / max|exact| against a float64 all-reduce.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from functools import partial

import torch
from _harness import fmt_bytes, parse_size, rank0_out
from _quiet import quiet_for, quiet_summary, set_patience, time_loop
import commlib  # before mpi4py: commlib sets UCX's TCP defaults before MPI initializes
from mpi4py import MPI

import commlib.compress as cc
from commlib.compress import _fast
from commlib.nn.functional import traffic

CODECS = {"int8": {}, "int4": {}, "fp8": {}, "fp8-e5m2": {"format": "e5m2"}}
# error against bits: (codec, options), cheapest last within each family
SETTINGS = [("int8", {"block": 32}), ("int8", {"block": 256}), ("int8", {"block": 4096}),
            ("int8", {"block": None}), ("fp8", {"block": 256}),
            ("fp8", {"block": 256, "format": "e5m2"}), ("fp8", {"block": None}),
            ("int4", {"block": 32}), ("int4", {"block": 64}), ("int4", {"block": 256}),
            ("int4", {"block": 64, "scale_dtype": torch.float16}), ("topk", {"ratio": 0.25}),
            ("topk", {"ratio": 0.1}), ("topk", {"ratio": 0.01})]


def make(name: str):
    return cc.codec(name.split("-")[0], **CODECS[name])


def best(fn, repeat: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def codec_rates(c, x: torch.Tensor, rounds: int) -> tuple[float, float, float]:
    """Median seconds of (memcpy, encode, decode-and-accumulate) of ``x`` with ``c``."""
    dst, acc = torch.empty_like(x), torch.zeros_like(x)
    wire = torch.empty(c.nbytes(x.numel()), dtype=torch.uint8)
    packed = c.encode(x, out=wire)
    mem, enc, dec = [], [], []
    for _ in range(rounds):
        mem.append(best(lambda: dst.copy_(x)))
        enc.append(best(lambda: c.encode(x, out=wire)))
        dec.append(best(lambda: c.decode(packed, out=acc, accumulate=True)))
    return tuple(statistics.median(v) for v in (mem, enc, dec))


def codec_table(args, out) -> list[str]:
    failures = []
    impls = ["c", "torch"] if _fast.available() else ["torch"]
    out("# codecs: encode / decode GB/s on float32 (4 B per element), memcpy in the same run")
    out(f"# {'codec':10} {'size':>8} {'impl':>5} | {'memcpy':>7} | {'encode':>7} {'%mem':>5} | "
        f"{'decode':>7} {'%mem':>5}")
    for size in args.sizes:
        n = size // 4
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        for name in args.codecs:
            for impl in impls:
                os.environ["COMMLIB_COMPRESS_IMPL"] = impl
                m, e, d = codec_rates(make(name), x, args.rounds)
                out(f"  {name:10} {fmt_bytes(size):>8} {impl:>5} | {size / m / 1e9:7.2f} | "
                    f"{size / e / 1e9:7.2f} {100 * m / e:4.0f}% | {size / d / 1e9:7.2f} "
                    f"{100 * m / d:4.0f}%")
                if impl == "c" and (m / e < 0.3 or m / d < 0.3):
                    failures.append(f"{name} {fmt_bytes(size)}: C encode {100 * m / e:.0f}%, "
                                    f"decode {100 * m / d:.0f}% of memcpy")
        os.environ.pop("COMMLIB_COMPRESS_IMPL", None)
    return failures


def error_table(out, n: int = 1 << 20) -> list[str]:
    """One round trip of ``n`` standard-normal float32 values per codec setting."""
    failures = []
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    out(f"# error against bits: one round trip of {n} standard-normal float32 values")
    out(f"# {'codec':34} | {'bits/elem':>9} | {'rms rel err':>11} | {'max rel err':>11} | "
        f"{'max err/bound':>13}")
    for name, options in SETTINGS:
        c = cc.codec(name, **options)
        label = " ".join([name] + [f"{k}={str(v).replace('torch.', '')}" for k, v in options.items()])
        err = (c.decode(c.encode(x)).double() - x.double()).abs()
        ratio = float((err / c.bound(x).double().clamp_min(1e-300)).max())
        out(f"  {label:34} | {8 * c.nbytes(n) / n:9.3f} | "
            f"{float(err.norm() / x.double().norm()):11.2e} | "
            f"{float(err.max() / x.abs().max()):11.2e} | {ratio:13.3f}")
        if ratio > 1:
            failures.append(f"{c!r}: round-trip error {ratio:.3f}x its bound")
    return failures


def implementations(x, t, b, codecs, two_level: bool, comm) -> dict:
    """Every timed call by row name; the all-reduces first copy ``x`` into their buffer."""
    a = x.numpy()
    p = comm.Get_size()
    rows = {"mpi": lambda: comm.Allreduce(a, b),
            "commlib": lambda: (t.copy_(x), commlib.all_reduce(t))}
    for name in codecs:
        c = make(name)
        for algo in ["auto", "compressed"] + (["hierarchical"] if two_level else []):
            rows[f"{name} {algo}"] = partial(_compressed, x, t, c, algo)
    # the pieces: reduce-scatter and all-gather, compressed (the first codec) and not
    m = x.numel() // p
    rs_out, ag_out, piece, c0 = torch.empty(m), torch.empty(m * p), x[:m].clone(), make(codecs[0])
    rows["commlib reduce_scatter"] = partial(commlib.reduce_scatter_tensor, rs_out, x)
    rows[f"{codecs[0]} reduce_scatter"] = partial(cc.reduce_scatter_tensor, rs_out, x, codec=c0)
    rows["commlib all_gather"] = partial(commlib.all_gather_into_tensor, ag_out, piece)
    rows[f"{codecs[0]} all_gather"] = partial(cc.all_gather_into_tensor, ag_out, piece, codec=c0)
    return rows


def _compressed(x, t, c, algo):
    t.copy_(x)
    cc.all_reduce(t, codec=c, algorithm=algo)


def collective_table(args, out, comm) -> list[str]:
    rank, p = comm.Get_rank(), comm.Get_size()
    g = commlib.get_world_group()
    hosts = g.resources.layout.hosts if g.resources is not None else [list(range(p))]
    h = len(hosts)
    two_level = h > 1 and len(hosts[0]) > 1 and all(len(x) == len(hosts[0]) for x in hosts)
    link = args.link_gbit * 1e9 / 8
    notes = []
    out(f"# collectives: {p} ranks on {h} host(s) {hosts}; float32; slowest rank, median of "
        f"{args.rounds} rounds; link bound at {args.link_gbit:g} Gb/s")
    out(f"# {'size':>7} {'codec':9} {'impl':>22} | {'ms':>9} | {'x mpi':>6} | {'wire MiB':>9} "
        f"{'formula':>7} | {'/bound':>6} | {'max rel err':>11}")
    for size in args.sizes:
        n = size // 4
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        exact = x.double()
        commlib.all_reduce(exact)
        bound_s = 2 * (h - 1) / h * size / link if h > 1 else None
        t = torch.empty_like(x)
        b = x.numpy().copy()
        rows = implementations(x, t, b, args.codecs, two_level, comm)
        # warm-up, wire bytes and error (each all-reduce starts from x)
        wire, err = {}, {}
        for key, fn in rows.items():
            with traffic() as tr:
                fn()
            wire[key] = tr.by_kind.get("compress.wire", 0)
            if "reduce_scatter" not in key and "all_gather" not in key:
                got = torch.from_numpy(b).double() if key == "mpi" else t.double()
                err[key] = comm.allreduce(float((got - exact).abs().max() / exact.abs().max()),
                                          op=MPI.MAX)
        times = {k: [] for k in rows}
        for r in range(args.rounds):
            for key in list(rows)[r % len(rows):] + list(rows)[:r % len(rows)]:
                quiet_for(comm).wait()
                times[key].append(time_loop(rows[key], args.iters, comm))
        med = {k: statistics.median(v) for k, v in times.items()}
        for key in rows:
            name, _, algo = key.partition(" ")
            formula = "-"
            if name in CODECS and algo == "compressed":
                formula = "ok" if wire[key] == cc.wire_bytes(n, p, make(name)) else "DIFF"
            elif name in CODECS and algo in ("reduce_scatter", "all_gather"):
                formula = "ok" if 2 * wire[key] == cc.wire_bytes(n, p, make(name)) else "DIFF"
            elif name in CODECS and algo == "hierarchical":
                local = len(hosts[0])
                want = cc.wire_bytes(math.ceil(n / local), h, make(name))
                formula = "ok" if wire[key] == want else "DIFF"
            full = "reduce_scatter" not in key and "all_gather" not in key
            ref = med["mpi"] if full else med[f"commlib {algo}"]
            out(f"  {fmt_bytes(size):>7} {name:9} {algo or 'uncompressed':>22} | "
                f"{med[key] * 1e3:9.2f} | {ref / med[key]:6.2f} | "
                f"{wire[key] / 2**20:9.3f} {formula:>7} | "
                f"{med[key] / bound_s if (bound_s and full) else float('nan'):6.2f} | "
                f"{err[key] if key in err else float('nan'):11.2e}")
            if formula == "DIFF":
                notes.append(f"{key} {fmt_bytes(size)}: wire bytes {wire[key]} != formula")
        for name, goal in (("int8", 2.5), ("int4", 4.0)):
            if name in args.codecs and h > 1:
                k = f"{name} auto"
                verdict = "PASS" if med["mpi"] / med[k] >= goal else "MISS"
                out(f"# check {fmt_bytes(size)}: {name} auto {med['mpi'] / med[k]:.2f}x faster "
                    f"than MPI Allreduce (goal >= {goal}): {verdict}")
                if verdict == "MISS":
                    notes.append(f"{k} {fmt_bytes(size)}: {med['mpi'] / med[k]:.2f}x < {goal}")
        if h == 1:
            slower = [k for k in rows if k.endswith(" auto") and med[k] > 1.05 * med["commlib"]
                      and cc.explain(n, make(k.split()[0])).chosen != "uncompressed"]
            out(f"# check {fmt_bytes(size)}: on one host auto never picks a slower compression: "
                f"{'PASS' if not slower else 'MISS ' + ', '.join(slower)}")
            notes += [f"{k} {fmt_bytes(size)}: auto compressed and slower" for k in slower]
    out(quiet_summary(comm))
    return notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("codecs", "collectives", "both"), default="both")
    ap.add_argument("--sizes", default=None, type=lambda s: [parse_size(x) for x in s.split(",")],
                    help="bytes of float32 (codecs default 1M,4M,16M,64M; collectives 16M,64M)")
    ap.add_argument("--codecs", default="int8,int4,fp8", type=lambda s: s.split(","))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3, help="calls per timed loop")
    ap.add_argument("--link-gbit", type=float, default=1.0)
    ap.add_argument("--patience", type=float, default=60.0,
                    help="seconds to wait out a slow phase per point (0: no quiet gate)")
    args = ap.parse_args()
    commlib.init()
    set_patience(args.patience)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    out = rank0_out(rank)
    for name in args.codecs:
        if name not in CODECS:
            out(f"unknown codec {name!r}: choose from {sorted(CODECS)}")
            return 2
    torch.set_num_threads(1)
    out(f"# bench/compress.py: {comm.Get_size()} ranks, torch {torch.__version__}, C path "
        f"{'built' if _fast.available() else 'absent'}")
    failures = []
    if args.part in ("codecs", "both"):
        sizes, args.sizes = args.sizes, args.sizes or [1 << 20, 4 << 20, 16 << 20, 64 << 20]
        if rank == 0:
            failures += codec_table(args, out)
            failures += error_table(out)
        args.sizes = sizes
        comm.Barrier()
    if args.part in ("collectives", "both"):
        args.sizes = args.sizes or [16 << 20, 64 << 20]
        failures += collective_table(args, out, comm)
    for f in failures:
        out(f"# MISS {f}")
    out(f"# checks: {'all PASS' if not failures else f'{len(failures)} MISS'}")
    commlib.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
