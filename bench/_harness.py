"""The shared harness behind every ``bench/<collective>.py`` (nccl-tests style).

A collective file only describes its collective (a :class:`Collective` subclass: buffers, how to run
it with commlib, raw mpi4py and torch.distributed gloo, the expected result and the busbw factor)
and calls :func:`main`. Everything else lives here: options, the size sweep, warm-up, adaptive
iteration counts, timing, the result check, the tables, JSON and the plot.

Measurement rules (nccl-tests'):

* warm-up and the result check are outside the timed region; every timed loop starts after a
  barrier;
* time = per-rank mean over the iterations of one loop, then combined over ranks with ``-a``
  (default 1: the average, as nccl-tests does by default; 0 rank 0, 2 min, 3 max);
* algbw = size / time, busbw = algbw x the collective's factor;
* the check re-initialises the buffers with known values, runs the operation once more and counts
  the elements that differ from the expected value (exact for integers, a few ulps for floats),
  summed over ranks: ``#wrong``.

``--compare`` times commlib, raw mpi4py and gloo on the same buffers, interleaved per size and
repeated in rounds, and reports the median of the rounds for each.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Callable, NamedTuple

import numpy as np
import torch
import commlib  # before mpi4py: commlib sets UCX's TCP defaults before MPI initializes
from mpi4py import MPI

from _quiet import quiet_for, quiet_summary
from commlib.algorithms import algorithm_names
from commlib.ops import ReduceOp, resolve_op

torch.set_num_threads(1)

IMPLS = ("commlib", "mpi4py", "gloo")
# --compare also times these, side by side: commlib forced onto the engine's own collective
# (algorithm "native": the reference where MPI cannot reduce the dtype, e.g. bfloat16), and a
# plain copy of the same number of bytes on every rank at once (the memory-bandwidth bound).
EXTRA = ("engine", "memcpy")

# What --compare aims at (the intra-node issue's goals), printed as PASS/MISS after the table.
# The reference is mpi4py, or commlib's engine path where mpi4py cannot run the dtype.
GOAL_LATENCY_RANGE, GOAL_LATENCY_RATIO = (8, 64 << 10), 0.7   # commlib / MPI time
GOAL_BW_RANGE, GOAL_BW_RATIO = (1 << 20, 256 << 20), 1.5      # commlib / MPI algbw
GOAL_BOUND_FROM, GOAL_BOUND_SHARE = 16 << 20, 0.5             # commlib algbw / memcpy bound
GOAL_GLOO_UPTO, GOAL_GLOO_RATIO = 1 << 20, 20.0               # gloo / commlib time


# ----- dtypes ------------------------------------------------------------------------------
class DType(NamedTuple):
    """``period``: data values 1..period are integers this dtype holds exactly (data movement
    tests use them; reductions use 1..8 so that sums and products stay exact too).
    ``mpi``: MPI can reduce it through mpi4py (NumPy has no bfloat16, so MPI never sees one;
    moving bfloat16 as raw bytes works)."""

    torch: torch.dtype
    period: int
    mpi: bool


DTYPES: dict[str, DType] = {
    "float32": DType(torch.float32, 1 << 20, True),
    "float64": DType(torch.float64, 1 << 20, True),
    "float16": DType(torch.float16, 2000, True),  # MPICH reduces it (MPIX_C_FLOAT16)
    "bfloat16": DType(torch.bfloat16, 200, False),
    "int8": DType(torch.int8, 100, True),
    "uint8": DType(torch.uint8, 200, True),
    "int32": DType(torch.int32, 1 << 20, True),
    "int64": DType(torch.int64, 1 << 20, True),
}
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "double": "float64", "half": "float16",
                 "fp16": "float16", "bf16": "bfloat16", "int": "int32", "long": "int64"}

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX, ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR,
            ReduceOp.BXOR: MPI.BXOR}  # no AVG in MPI: mpi4py shows n/a
_OP_ALIASES = {"prod": "product"}


# ----- what a collective file fills in -----------------------------------------------------
class Collective:
    """One collective. Subclasses set the attributes and implement the methods marked below.

    Buffers are a dict of torch tensors allocated once per (size, placement); the ``mpi4py`` and
    ``gloo`` methods run on those same tensors (mpi4py through NumPy views, :meth:`Bench.np`).
    Each ``commlib``/``mpi4py``/``gloo`` method returns a zero-argument callable that runs the
    operation once (everything pre-bound, so the timed loop measures the call, not the setup),
    or None when that implementation cannot do it (printed as n/a).
    """

    name = "?"            # printed in the header
    algo_name: str | None = None  # commlib's algorithm-registry collective, for --algorithm
    reduces = False       # takes -o/--op
    has_root = False      # takes -r/--root
    per_rank = False      # sizes are totals over ranks; count column is per rank (AG, RS, A2A)
    in_place = True       # has an in-place variant
    compare_in_place = True  # the variant --compare times (the collective's natural form)

    def factor(self, n: int) -> float:  # busbw = algbw * factor
        raise NotImplementedError

    def alloc(self, b: "Bench", count: int, in_place: bool) -> dict:
        raise NotImplementedError

    def init(self, b: "Bench", bufs: dict, in_place: bool) -> None:
        """Fill the inputs with this rank's known data and poison the outputs."""
        raise NotImplementedError

    def expected(self, b: "Bench", count: int) -> torch.Tensor | None:
        """The result this rank must hold (float64 or int64), or None if it has none."""
        raise NotImplementedError

    def result(self, b: "Bench", bufs: dict, in_place: bool, impl: str) -> torch.Tensor:
        """Where the result lands (default: ``bufs['out']``)."""
        return bufs["out"]

    def commlib(self, b: "Bench", bufs: dict, in_place: bool) -> Callable | None:
        raise NotImplementedError

    def mpi4py(self, b: "Bench", bufs: dict, in_place: bool) -> Callable | None:
        raise NotImplementedError

    def gloo(self, b: "Bench", bufs: dict, in_place: bool) -> Callable | None:
        raise NotImplementedError

    # sizes
    def counts(self, nbytes: int, item: int, n: int) -> tuple[int, int]:
        """(bytes, count column) for a requested size: per-rank collectives split the size
        over ranks (at least one element each), like nccl-tests."""
        if self.per_rank:
            per = max(1, nbytes // (item * n))
            return per * n * item, per
        count = max(1, nbytes // item)
        return count * item, count


# ----- the run state a collective sees -----------------------------------------------------
class Bench:
    """Rank, communicators, dtype, op, root, and helpers for data and checks."""

    def __init__(self, coll: Collective, args, dt: DType, op: ReduceOp | None):
        self.coll = coll
        self.args = args
        self.comm = MPI.COMM_WORLD.Dup()  # raw mpi4py's communicator (commlib has its own)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.dt = dt
        self.dtype = dt.torch
        self.op = op
        self.root = args.root if coll.has_root else -1
        self.period = 8 if coll.reduces else dt.period
        self.ckw = {"algorithm": args.algorithm} if args.algorithm else {}
        self.dist = None  # torch.distributed once gloo is up
        self.mpi_op = _MPI_OPS.get(op) if op is not None else None
        self.dist_op = None

    # buffers and data
    def empty(self, count: int) -> torch.Tensor:
        if self.args.shared:  # collective: every rank allocates the same buffers in order
            return commlib.shared_empty(count, dtype=self.dtype)
        return torch.empty(count, dtype=self.dtype)

    def pattern(self, rank: int, count: int, start: int = 0) -> torch.Tensor:
        """Rank ``rank``'s input elements ``start..start+count`` (float64 or int64): small
        integers that every dtype holds exactly and that differ between ranks and positions."""
        # float64 holds these integers exactly: floating dtypes skip the int64 temporaries
        # (256 MiB bfloat16 at 4 ranks ran out of memory with them)
        kind = torch.float64 if self.dtype.is_floating_point else torch.int64
        vals = torch.arange(start + rank * 131, start + rank * 131 + count, dtype=kind)
        return vals.remainder_(self.period).add_(1)

    def fill(self, t: torch.Tensor, rank: int, start: int = 0) -> None:
        t.copy_(self.pattern(rank, t.numel(), start))

    @staticmethod
    def poison(t: torch.Tensor) -> None:
        t.fill_(0)  # data values are >= 1

    def reduced(self, count: int, start: int = 0) -> torch.Tensor:
        """The reduction over all ranks of their ``pattern`` (what all_reduce yields)."""
        op = self.op
        acc = self.pattern(0, count, start)
        for r in range(1, self.size):
            x = self.pattern(r, count, start)
            if op in (ReduceOp.SUM, ReduceOp.AVG):
                acc += x
            elif op is ReduceOp.PRODUCT:
                acc *= x
            elif op is ReduceOp.MIN:
                acc = torch.minimum(acc, x)
            elif op is ReduceOp.MAX:
                acc = torch.maximum(acc, x)
            elif op is ReduceOp.BAND:
                acc = acc & x
            elif op is ReduceOp.BOR:
                acc = acc | x
            elif op is ReduceOp.BXOR:
                acc = acc ^ x
        if op is ReduceOp.AVG:
            acc = acc / self.size
        return acc

    def np(self, t: torch.Tensor) -> np.ndarray:
        """A NumPy view of ``t`` for mpi4py (bfloat16 as raw bytes: data movement only)."""
        if self.dtype is torch.bfloat16:
            return t.view(torch.uint8).numpy()
        return t.numpy()

    def mpi_ok(self) -> bool:
        """mpi4py can run this collective's reduction on this dtype and op."""
        return not self.coll.reduces or (self.dt.mpi and self.mpi_op is not None)

    # checking
    def count_wrong(self, got: torch.Tensor, want: torch.Tensor | None) -> int:
        if want is None:
            return 0
        got = got.reshape(-1)
        if not self.dtype.is_floating_point:
            return int((got != want.to(self.dtype)).sum())
        # Compare with the expectation rounded to the dtype; allow a few ulps per rank, since
        # engines that reduce in the dtype itself (MPI on float16) round at every step.
        eps = torch.finfo(self.dtype).eps * max(4, 2 * self.size)
        wrong, block = 0, 1 << 22  # in blocks: float64 copies of 256 MiB results do not fit
        for lo in range(0, got.numel(), block):
            ref = want[lo:lo + block].to(self.dtype).to(torch.float64)
            diff = (got[lo:lo + block].to(torch.float64) - ref).abs()
            wrong += int((~(diff <= eps * ref.abs())).sum())  # NaN counts as wrong
        return wrong


# ----- options -----------------------------------------------------------------------------
def timed_slowest(fn, comm=MPI.COMM_WORLD) -> float:
    """Seconds ``fn()`` took on the slowest rank of ``comm``, all starting after a barrier (one
    timed step of the model-level benchmarks: overlap.py, tensor_parallel_2d.py)."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def rank0_out(rank: int) -> Callable[[str], None]:
    """The benches' ``out(line)``: print (flushed) on rank 0 only."""
    def out(line: str) -> None:
        if rank == 0:
            print(line, flush=True)
    return out


def write_json(path: str, doc: dict, args, out, skip=("json",)) -> None:
    """Write a bench's result ``doc`` to ``path`` with what every bench records beside it: its
    options (``args`` but ``skip``), the tuning file, and the commlib and torch versions."""
    doc = {**doc, "options": {k: v for k, v in vars(args).items() if k not in skip},
           "tuning_file": os.environ.get("COMMLIB_TUNING_FILE"),
           "commlib": commlib.__version__, "torch": torch.__version__}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    out(f"# json written to {path}")


def parse_size(text: str) -> int:
    from commlib.config import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError("sizes must be >= 1 byte")
    return value


def fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


class _Parser(argparse.ArgumentParser):
    """Usage errors are printed by rank 0 only (every rank exits with status 2)."""

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def build_parser(coll: Collective) -> argparse.ArgumentParser:
    p = _Parser(
        prog=f"bench/{coll.name}.py",
        description=f"nccl-tests-style benchmark of commlib's {coll.name} "
                    f"(run under mpirun/mpiexec). See bench/README.md.")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"),
                   help="smallest size in bytes (K/M/G suffixes; default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                   help="largest size (default 64M)")
    step = p.add_mutually_exclusive_group()
    step.add_argument("-f", "--stepfactor", type=float, default=None,
                      help="multiply the size by this each step (default 2)")
    step.add_argument("-i", "--stepbytes", type=parse_size, default=None,
                      help="add this many bytes each step instead")
    p.add_argument("-d", "--dtype", "--datatype", default="float32",
                   help=f"one of {', '.join(DTYPES)} (aliases: {', '.join(DTYPE_ALIASES)})")
    # -o and -r are accepted by every collective, as in nccl-tests; those without a reduction
    # or a root ignore them (the table shows redop "none" and root -1).
    p.add_argument("-o", "--op", default="sum",
                   help="sum, prod, min, max, avg, band, bor, bxor (default sum)"
                        + ("" if coll.reduces else "; ignored: this collective does not reduce"))
    p.add_argument("-r", "--root", type=int, default=0,
                   help="root rank (default 0)" + ("" if coll.has_root else
                                                   "; ignored: this collective has no root"))
    p.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help="warm-up iterations per size and variant, untimed (default 5)")
    p.add_argument("-n", "--iters", type=int, default=None,
                   help="timed iterations; default: adapt to the size (see --time)")
    p.add_argument("--time", type=float, default=0.2, dest="target_time",
                   help="adaptive iterations: seconds each timed loop should take (default "
                        "0.2; with --compare, per round, for the slowest implementation)")
    p.add_argument("--min-iters", type=int, default=3, help="adaptive minimum (default 3)")
    p.add_argument("--max-iters", type=int, default=100000, help="adaptive maximum")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1),
                   help="check results every size (default 1)")
    p.add_argument("-a", "--average", type=int, default=1, choices=(0, 1, 2, 3),
                   help="combine per-rank times: 0 rank 0, 1 average (default), 2 min, 3 max")
    p.add_argument("--algorithm", default=None,
                   help="force a commlib algorithm (default: commlib's choice)")
    p.add_argument("--impl", default="commlib", choices=IMPLS,
                   help="implementation the nccl-tests table times (default commlib)")
    p.add_argument("--compare", action="store_true",
                   help="time commlib, mpi4py and gloo interleaved; print medians and ratios")
    p.add_argument("--rounds", type=int, default=5,
                   help="--compare: rounds per size; the median is reported (default 5)")
    p.add_argument("--patience", type=float, default=60.0, metavar="S",
                   help="--compare: before each round, wait up to S seconds for the host's slow "
                        "phases to pass (bench/_quiet.py; 0: do not check; default 60)")
    p.add_argument("--shared", action="store_true",
                   help="allocate every buffer with commlib.shared_empty (memory all ranks map, "
                        "read in place by commlib's shared-memory collectives; the same buffers "
                        "for every implementation)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every row to FILE")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="write a busbw-vs-size PNG (needs matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    # For the checker's own test (tests/test_bench.py): rank 0 corrupts one element of every
    # result before it is checked, so #wrong must come out > 0.
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)
    return p


def sweep(args) -> list[int]:
    sizes, s = [], args.minbytes
    while s <= args.maxbytes:
        sizes.append(s)
        if args.stepbytes:
            s += args.stepbytes
        else:
            nxt = int(s * (args.stepfactor or 2))
            s = nxt if nxt > s else s + 1
    return sizes


def _usage_error(rank: int, message: str) -> None:
    if rank == 0:
        sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


# ----- gloo --------------------------------------------------------------------------------
def init_gloo(comm):
    """torch.distributed with a gloo process group over the ranks of the MPI communicator
    ``comm``; returns ``torch.distributed``. Rank 0 (on ``MASTER_ADDR``, or a vcluster job's
    ``VCLUSTER_HEAD``, else 127.0.0.1) opens the rendezvous store on a port the
    kernel picks and broadcasts it (a port found free and then opened by the store can be taken
    in between: seen once in CI as EADDRINUSE). commlib.init() runs first, so commlib stays on
    MPI."""
    from datetime import timedelta

    import torch.distributed as dist

    # the rendezvous host: MASTER_ADDR, or the head of a vcluster job, or this machine
    host = os.environ.get("MASTER_ADDR") or os.environ.get("VCLUSTER_HEAD") or "127.0.0.1"
    wait = timedelta(seconds=120)
    store = port = None
    if comm.rank == 0:
        store = dist.TCPStore(host, 0, comm.size, is_master=True, timeout=wait,
                              wait_for_workers=False)
        port = store.port
    port = comm.bcast(port, root=0)
    if comm.rank != 0:
        store = dist.TCPStore(host, port, comm.size, is_master=False, timeout=wait)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
    dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)
    return dist


def start_gloo(b: Bench) -> None:
    """:func:`init_gloo` for the bench, with its reduction op in gloo's terms."""
    b.dist = init_gloo(b.comm)
    if b.op is not None:
        b.dist_op = getattr(b.dist.ReduceOp, b.op.name, None)


# ----- timing ------------------------------------------------------------------------------
def _loop(fn: Callable, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return time.perf_counter() - t0


def _combine(b: Bench, value: float) -> float:
    how = b.args.average
    if how == 0:
        return b.comm.bcast(value, root=0)
    if how == 1:
        return b.comm.allreduce(value, op=MPI.SUM) / b.size
    return b.comm.allreduce(value, op=MPI.MIN if how == 2 else MPI.MAX)


def warm_up(b: Bench, fn: Callable) -> float:
    """Run the warm-up iterations; return the slowest rank's seconds per call (at least one call
    is made, to estimate the iteration count)."""
    w = max(1, b.args.warmup_iters) if b.args.iters is None else b.args.warmup_iters
    b.comm.Barrier()
    per = _loop(fn, w) / w if w else 0.0
    return b.comm.allreduce(per, op=MPI.MAX)


def iterations(b: Bench, per_call: float) -> int:
    a = b.args
    if a.iters is not None:
        return a.iters
    want = math.ceil(a.target_time / per_call) if per_call > 0 else a.max_iters
    return max(a.min_iters, min(a.max_iters, want))


def timed(b: Bench, fn: Callable, iters: int) -> tuple[float, float]:
    """(combined per-call seconds per -a, slowest rank's) for one loop after a barrier."""
    b.comm.Barrier()
    mine = _loop(fn, iters) / iters
    return _combine(b, mine), b.comm.allreduce(mine, op=MPI.MAX)


def check(b: Bench, bufs: dict, in_place: bool, impl: str, fn: Callable, count: int) -> int:
    """Re-initialise, run once, compare with the expected values; #wrong summed over ranks."""
    coll = b.coll
    coll.init(b, bufs, in_place)
    b.comm.Barrier()
    fn()
    got = coll.result(b, bufs, in_place, impl)
    want = coll.expected(b, count)
    if b.args.inject_error and b.rank == 0 and want is not None:
        flat = got.view(-1)
        flat[0] = flat[0] + 1
    return b.comm.allreduce(b.count_wrong(got, want), op=MPI.SUM)


def _memcpy(b: Bench, nbytes: int) -> Callable:
    """Every rank copies ``nbytes`` between two private buffers (torch, one thread): the
    bandwidth of memory when all ranks move data at once. An all-reduce must read every input
    and write every output at least once (an all-gather too), which is what this copy does, so
    ``nbytes / time`` bounds their algbw."""
    src = torch.ones(max(1, nbytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    call = functools.partial(dst.copy_, src)
    call.check = lambda: int((dst != src).sum())
    return call


def bind(b: Bench, impl: str, bufs: dict, in_place: bool) -> Callable | None:
    if impl == "engine":  # commlib on the engine's own collective (the pre-shm path)
        if b.coll.algo_name is None:
            return None
        saved, b.ckw = b.ckw, {"algorithm": "native"}
        try:
            return b.coll.commlib(b, bufs, in_place)
        finally:
            b.ckw = saved
    if impl == "mpi4py" and not b.mpi_ok():
        return None
    if impl == "gloo" and (b.dist is None or (b.coll.reduces and b.dist_op is None)):
        return None
    return getattr(b.coll, impl)(b, bufs, in_place)


# ----- printing ----------------------------------------------------------------------------
def _t(us: float | None) -> str:
    if us is None:
        return "n/a"
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def _bw(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


class Progress:
    """One line on stderr per finished size, once the sweep has run for a second."""

    def __init__(self, b: Bench, total: int):
        self.on = b.rank == 0 and not b.args.quiet
        self.total, self.t0 = total, time.perf_counter()
        self.tty = self.on and sys.stderr.isatty()
        self.shown = False

    def step(self, i: int, nbytes: int) -> None:
        elapsed = time.perf_counter() - self.t0
        if not self.on or (elapsed < 1.0 and not self.shown):
            return
        self.shown = True
        line = f"# progress: {i}/{self.total} sizes, {fmt_bytes(nbytes)} done, {elapsed:.1f} s"
        end = "" if self.tty and i < self.total else "\n"
        sys.stderr.write(("\r" if self.tty else "") + line + end)
        sys.stderr.flush()


def header(b: Bench, sizes: list[int]) -> list[str]:
    a = b.args
    step = (f"+{fmt_bytes(a.stepbytes)}" if a.stepbytes else f"x{a.stepfactor or 2:g}")
    iters = (f"{a.iters}" if a.iters is not None else
             f"adaptive (~{a.target_time:g} s per loop, {a.min_iters}..{a.max_iters})")
    avg = {0: "rank 0", 1: "average", 2: "min", 3: "max"}[a.average]
    lines = [
        f"# commlib {commlib.__version__} benchmark: {b.coll.name}"
        + (" --compare (commlib vs mpi4py vs gloo)" if a.compare else f" ({a.impl})"),
        f"#  nranks {b.size}  type {a.dtype_name}  redop {a.op_name}  root {b.root}  "
        f"sizes {fmt_bytes(sizes[0])} .. {fmt_bytes(sizes[-1])} {step}",
        f"#  warmup {a.warmup_iters}  iters {iters}  check {a.check}  "
        f"time: per-rank mean over iters, {avg} over ranks (-a {a.average})"
        + (f"  rounds {a.rounds} (median)" if a.compare else ""),
        f"#  commlib backend {commlib.get_world_group().backend.name}, algorithm "
        f"{a.algorithm or 'auto'}{', buffers commlib.shared_empty' if a.shared else ''};  "
        f"{MPI.Get_library_version().splitlines()[0].strip()};  "
        f"mpi4py {__import__('mpi4py').__version__};  torch {torch.__version__}",
    ]
    hosts = b.comm.gather((os.getpid(), platform.node()), root=0)
    if b.rank == 0:
        lines += [f"#  Rank {r:2d} Pid {pid:7d} on {host}" for r, (pid, host) in enumerate(hosts)]
    return lines + ["#"]


TABLE_HEAD = [
    "#                                                  out-of-place"
    "                          in-place",
    f"# {'size':>10} {'count':>12} {'type':>9} {'redop':>6} {'root':>5}"
    + f" {'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>7}" * 2,
    f"# {'(B)':>10} {'(elements)':>12} {'':>9} {'':>6} {'':>5}"
    + f" {'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}" * 2,
]

COMPARE_HEAD = [
    f"# {'size':>10} {'count':>12} | {'commlib µs':>11} | {'mpi4py µs':>11} | {'gloo µs':>11} | "
    f"{'commlib-mpi4py (µs)':>19} | {'commlib/mpi4py':>14} | {'gloo/commlib':>12} | "
    f"{'#wrong c/m/g':>12} | {'engine µs':>10} | {'commlib/engine':>14} | {'memcpy GB/s':>11} | "
    f"{'% of bound':>10}",
]


def _half(r: dict | None) -> str:
    if r is None:
        return f" {'n/a':>8} {'n/a':>7} {'n/a':>7} {'n/a':>7}"
    wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
    return f" {_t(r['time_us']):>8} {_bw(r['algbw']):>7} {_bw(r['busbw']):>7} {wrong:>7}"


# ----- the two modes -----------------------------------------------------------------------
def _bw_pair(b: Bench, nbytes: int, seconds: float) -> tuple[float, float]:
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * b.coll.factor(b.size)


def run_table(b: Bench, sizes: list[int], out: Callable) -> dict:
    """nccl-tests' table for one implementation (``--impl``)."""
    coll, a = b.coll, b.args
    for line in TABLE_HEAD:
        out(line)
    rows, wrong_total, bws = [], 0, []
    progress = Progress(b, len(sizes))
    item = torch.empty((), dtype=b.dtype).element_size()
    for i, req in enumerate(sizes, 1):
        nbytes, count = coll.counts(req, item, b.size)
        row = {"size": nbytes, "count": count, "type": a.dtype_name, "redop": a.op_name,
               "root": b.root}
        for in_place, key in ((False, "out_of_place"), (True, "in_place")):
            row[key] = None
            if in_place and not coll.in_place:
                continue
            bufs = coll.alloc(b, count, in_place)
            coll.init(b, bufs, in_place)
            fn = bind(b, a.impl, bufs, in_place)
            if fn is None:
                continue
            iters = iterations(b, warm_up(b, fn))
            sec, sec_max = timed(b, fn, iters)
            wrong = check(b, bufs, in_place, a.impl, fn, count) if a.check else None
            algbw, busbw = _bw_pair(b, nbytes, sec)
            row[key] = {"time_us": sec * 1e6, "time_us_max": sec_max * 1e6, "algbw": algbw,
                        "busbw": busbw, "wrong": wrong, "iters": iters}
            wrong_total += wrong or 0
            bws.append(busbw)
            del bufs
        rows.append(row)
        out(f"  {nbytes:>10} {count:>12} {a.dtype_name:>9} {a.op_name:>6} {b.root:>5}"
            + _half(row["out_of_place"]) + _half(row["in_place"]))
        progress.step(i, nbytes)
    avg = sum(bws) / len(bws) if bws else 0.0
    out(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
    out(f"# Avg bus bandwidth    : {avg:.4g}")
    out("#")
    return {"rows": rows, "wrong_total": wrong_total, "avg_busbw": avg}


def run_compare(b: Bench, sizes: list[int], out: Callable) -> dict:
    """commlib, mpi4py and gloo on the same buffers, interleaved per size, medians of rounds."""
    coll, a = b.coll, b.args
    in_place = coll.compare_in_place
    out(f"# --compare: {'in-place' if in_place else 'out-of-place'} variant; same buffers, "
        f"warm-up and iteration count for every implementation, each loop preceded by untimed "
        f"calls of its own; order rotates (and reverses) each round; "
        f"median of {a.rounds} rounds")
    for line in COMPARE_HEAD:
        out(line)
    rows, wrong_total = [], 0
    progress = Progress(b, len(sizes))
    item = torch.empty((), dtype=b.dtype).element_size()
    quiet = quiet_for(b.comm, a.patience)
    for i, req in enumerate(sizes, 1):
        nbytes, count = coll.counts(req, item, b.size)
        bufs = coll.alloc(b, count, in_place)
        coll.init(b, bufs, in_place)
        fns = {impl: bind(b, impl, bufs, in_place) for impl in IMPLS + EXTRA[:1]}
        fns["memcpy"] = _memcpy(b, nbytes)
        live = [impl for impl in IMPLS + EXTRA if fns[impl] is not None]
        per_call = max(warm_up(b, fns[impl]) for impl in live)
        iters = iterations(b, per_call)
        samples: dict[str, list[float]] = {impl: [] for impl in live}
        # Each timed loop is preceded by a few untimed calls of the same implementation: the one
        # before it leaves caches and engine threads in its own state (measured: 16 MiB
        # all-reduces right after gloo's ran 25% slower for 14 iterations). Rounds rotate the
        # order and every other cycle reverses it, so each implementation follows each other.
        settle = max(2, min(iters // 4, 50))
        for k in range(a.rounds):
            quiet.wait()
            order = live[k % len(live):] + live[:k % len(live)]
            if (k // len(live)) % 2:
                order.reverse()
            for impl in order:
                _loop(fns[impl], settle)
                samples[impl].append(timed(b, fns[impl], iters)[0] * 1e6)
        res = {}
        for impl in IMPLS + EXTRA:
            if impl not in samples:
                if impl in IMPLS:
                    res[impl] = None
                continue
            med = statistics.median(samples[impl])
            algbw, busbw = _bw_pair(b, nbytes, med / 1e6)
            if impl == "memcpy":
                wrong = b.comm.allreduce(fns[impl].check(), op=MPI.SUM) if a.check else None
            else:
                wrong = check(b, bufs, in_place, impl, fns[impl], count) if a.check else None
            wrong_total += wrong or 0
            res[impl] = {"median_us": med, "rounds_us": samples[impl], "algbw": algbw,
                         "busbw": busbw, "wrong": wrong}
        del bufs
        c, m, g, e, mc = (res[x]["median_us"] if res.get(x) else None for x in IMPLS + EXTRA)
        row = {"size": nbytes, "count": count, "type": a.dtype_name, "redop": a.op_name,
               "root": b.root, "placement": "in_place" if in_place else "out_of_place",
               "iters": iters, "impls": res,
               "commlib_minus_mpi4py_us": c - m if c is not None and m is not None else None,
               "commlib_over_mpi4py": c / m if c is not None and m is not None else None,
               "gloo_over_commlib": g / c if c is not None and g is not None else None,
               "commlib_over_engine": c / e if c is not None and e is not None else None,
               "memcpy_GBps": res["memcpy"]["algbw"] if res.get("memcpy") else None,
               "share_of_bound": mc / c if c is not None and mc is not None else None}
        rows.append(row)
        wrongs = "/".join("-" if res[x] is None or res[x]["wrong"] is None else str(res[x]["wrong"])
                          for x in IMPLS)
        diff = row["commlib_minus_mpi4py_us"]
        ratio = row["commlib_over_mpi4py"]
        gloo = row["gloo_over_commlib"]
        out(f"  {nbytes:>10} {count:>12} | {_t(c):>11} | {_t(m):>11} | {_t(g):>11} | "
            f"{'n/a' if diff is None else f'{diff:+.2f}':>19} | "
            f"{'n/a' if ratio is None else f'{ratio:.3f}':>14} | "
            f"{'n/a' if gloo is None else f'{gloo:.1f}':>12} | {wrongs:>12} | {_t(e):>10} | "
            f"{'n/a' if e is None else f'{c / e:.3f}':>14} | {_bw(row['memcpy_GBps']):>11} | "
            f"{'n/a' if mc is None else f'{100 * mc / c:.0f}%':>10}")
        progress.step(i, nbytes)
    out(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
    out(quiet_summary(b.comm))
    goals = compare_goals(rows)
    for line in goals:
        out(line)
    out("#")
    return {"rows": rows, "wrong_total": wrong_total, "goals": goals}


def compare_goals(rows: list[dict]) -> list[str]:
    """PASS/MISS lines for the intra-node goals over the sizes measured. The reference is
    mpi4py, or commlib's engine path where mpi4py cannot run (bfloat16)."""
    def ref(r):
        m = r["impls"].get("mpi4py")
        return ("mpi4py", m) if m else ("engine", r["impls"].get("engine"))

    def ratio(r):  # commlib time / reference time
        name, x = ref(r)
        c = r["impls"].get("commlib")
        return (c["median_us"] / x["median_us"], name) if c and x else (None, name)

    lines = []

    def verdict(what, items, key, ok, fmt):
        items = [i for i in items if key(i) is not None]
        if not items:
            return
        worst = max(items, key=lambda i: key(i)) if fmt[1] == "max" else min(items, key=key)
        w = key(worst)
        lines.append(f"# goal: {what}: worst {fmt[0].format(w)} at {fmt_bytes(worst['size'])} "
                     f"{'PASS' if ok(w) else 'MISS'}")

    lo, hi = GOAL_LATENCY_RANGE
    small = [r for r in rows if lo <= r["size"] <= hi]
    name = ref(rows[0])[0] if rows else "mpi4py"
    verdict(f"commlib/{name} time <= {GOAL_LATENCY_RATIO} from {fmt_bytes(lo)} to {fmt_bytes(hi)}",
            small, lambda r: ratio(r)[0], lambda w: w <= GOAL_LATENCY_RATIO, ("{:.3f}", "max"))
    lo, hi = GOAL_BW_RANGE
    big = [r for r in rows if lo <= r["size"] <= hi]
    verdict(f"commlib/{name} algbw >= {GOAL_BW_RATIO} from {fmt_bytes(lo)} to {fmt_bytes(hi)}",
            big, lambda r: None if ratio(r)[0] is None else 1 / ratio(r)[0],
            lambda w: w >= GOAL_BW_RATIO, ("{:.2f}", "min"))
    bound = [r for r in rows if r["size"] >= GOAL_BOUND_FROM]
    verdict(f"commlib algbw >= {GOAL_BOUND_SHARE:.0%} of the memcpy bound from "
            f"{fmt_bytes(GOAL_BOUND_FROM)}", bound, lambda r: r.get("share_of_bound"),
            lambda w: w >= GOAL_BOUND_SHARE, ("{:.0%}", "min"))
    upto = [r for r in rows if r["size"] <= GOAL_GLOO_UPTO]
    verdict(f"gloo/commlib time >= {GOAL_GLOO_RATIO:g} up to {fmt_bytes(GOAL_GLOO_UPTO)}", upto,
            lambda r: r["gloo_over_commlib"], lambda w: w >= GOAL_GLOO_RATIO, ("{:.1f}", "min"))
    return lines


# ----- outputs -----------------------------------------------------------------------------
def write_plot(path: str, b: Bench, result: dict, out: Callable) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out(f"# --plot: matplotlib is not installed, no plot written to {path} "
            f"(pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = result["rows"]
    if b.args.compare:
        for impl in IMPLS:
            pts = [(r["size"], r["impls"][impl]["busbw"]) for r in rows if r["impls"][impl]]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{impl} (median)")
    else:
        for key, label in (("out_of_place", "out-of-place"), ("in_place", "in-place")):
            pts = [(r["size"], r[key]["busbw"]) for r in rows if r[key]]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{b.args.impl} {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{b.coll.name}, {b.size} ranks, {b.args.dtype_name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out(f"# plot written to {path}")


def main(coll: Collective, argv: list[str] | None = None) -> int:
    """Parse options, run the sweep, print, and write JSON/plot. Returns 0, or 1 if any result
    was wrong (so scripts and CI notice)."""
    commlib.init()  # before any torch.distributed group, so commlib runs on MPI
    rank = MPI.COMM_WORLD.Get_rank()
    size = MPI.COMM_WORLD.Get_size()
    args = build_parser(coll).parse_args(argv)

    name = DTYPE_ALIASES.get(args.dtype.lower(), args.dtype.lower())
    if name not in DTYPES:
        _usage_error(rank, f"--dtype {args.dtype!r}: use one of {', '.join(DTYPES)}")
    args.dtype_name, dt = name, DTYPES[name]
    op = None
    args.op_name = "none"
    if coll.reduces:
        opname = _OP_ALIASES.get(args.op.lower(), args.op.lower())
        op = ReduceOp.__members__.get(opname.upper())
        if op is None or resolve_op(op, dt.torch) is not op:
            _usage_error(rank, f"--op {args.op!r} with --dtype {name}: use sum, prod, min, max, "
                               f"avg (floating dtypes) or band/bor/bxor (integer dtypes)")
        args.op_name = op.value[:4] if op is not ReduceOp.PRODUCT else "prod"
    if coll.has_root and not 0 <= args.root < size:
        _usage_error(rank, f"--root {args.root}: must be a rank, 0..{size - 1}")
    if args.algorithm:
        names = algorithm_names(coll.algo_name) if coll.algo_name else []
        if args.algorithm not in names:
            _usage_error(rank, f"--algorithm {args.algorithm!r}: {coll.name} has algorithms: "
                               f"{', '.join(names) or 'no algorithms to choose from'}")
    if args.iters is not None and args.iters < 1 or args.rounds < 1 or args.min_iters < 1:
        _usage_error(rank, "-n, --rounds and --min-iters must be >= 1")
    if args.minbytes > args.maxbytes:
        _usage_error(rank, f"-b {args.minbytes} is larger than -e {args.maxbytes}")
    if args.stepfactor is not None and args.stepfactor <= 1:
        _usage_error(rank, "-f must be > 1")

    b = Bench(coll, args, dt, op)
    if args.compare or args.impl == "gloo":
        start_gloo(b)
    sizes = sweep(args)

    out = rank0_out(rank)

    for line in header(b, sizes):
        out(line)
    result = run_compare(b, sizes, out) if args.compare else run_table(b, sizes, out)

    if rank == 0 and args.json:
        doc = {"collective": coll.name, "nranks": size, "mode": "compare" if args.compare
               else args.impl, "dtype": args.dtype_name, "redop": args.op_name, "root": b.root,
               "busbw_factor": coll.factor(size),
               "time": {0: "rank0", 1: "avg", 2: "min", 3: "max"}[args.average] + " over ranks",
               **result}
        write_json(args.json, doc, args, out, skip=("json", "plot"))
    if rank == 0 and args.plot:
        write_plot(args.plot, b, result, out)
    if b.dist is not None:
        b.comm.Barrier()
        b.dist.destroy_process_group()
    b.comm.Barrier()
    return 1 if result["wrong_total"] else 0


def run(coll: Collective) -> None:
    """Entry point of a collective file: ``if __name__ == "__main__": run(MyCollective())``."""
    sys.exit(main(coll))


# Small helpers collective files share --------------------------------------------------------
def block(t: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """Block ``i`` of ``t`` split into ``n`` equal blocks."""
    c = t.numel() // n
    return t[i * c:(i + 1) * c]


partial = functools.partial
