"""Sequence-parallel attention benchmark: ring (zigzag), rsa and ulysses against one process.

Run under mpirun (every rank one torch thread, as is the one-process reference)::

    mpiexec -n 2 .venv/bin/python bench/seq_attention.py -s 4096 --rounds 5
    mpiexec -n 4 .venv/bin/python bench/seq_attention.py -s 2048 4096 8192 --algorithms ring rsa ulysses

For each total sequence length and algorithm it prints, side by side in one run:

* ``t1``: one process computing forward+backward of ``scaled_dot_product_attention`` on the full
  sequence (rank 0, the other ranks sleeping), median over rounds;
* ``tN``: forward+backward per rank of the sequence-parallel call (slowest rank), median;
* ``eff = t1 / (N * tN)``: parallel efficiency (wall clock, the goal's definition); ``effcpu``:
  the same ratio of thread CPU times (waits spin, so they count), a cross-check that other jobs
  on the machine inflate less: when ``eff`` is far below ``effcpu``, cores were taken away;
* ``comm``: the same transfers run alone (no compute in between), median;
* ``exposed``: transfer time left after the compute: per batch, the wait from the moment this
  rank finished computing *and* both ring neighbours had posted the batch until it completed
  (from every rank's (posted, computed, waited) stamps, one host so one clock), summed, slowest
  rank; ``imbal``: the rest of the wait, spent because a neighbour was still computing (load
  imbalance and machine noise, not communication);
* ``hidden = 1 - exposed/comm``: the share of the communication hidden behind compute (ring and
  rsa); ulysses' all-to-alls are blocking (0 hidden by design), its column shows the all-to-all
  share of tN instead;
* ``mem1`` / ``memN``: peak resident memory added by one forward+backward (inputs, outputs,
  gradients, buffers): rank 0 alone on the full sequence vs the largest rank; and their ratio;
* ``err``: max |out - reference| / max |reference| of the gathered output (a wrong result is
  reported, not timed silently).

Rounds interleave the one-process and the parallel runs, so machine noise hits both, and each
round first waits out the host's slow phases (``--patience``, bench/_quiet.py). After the
table, the longest sequence that fits a memory budget (``--budget-mib``, default: one process's
peak at the smallest length) is searched by measurement, not fitted: lengths double until one
does not fit, then bisection, every probe one measured forward+backward, for one process and for
each algorithm on the N ranks; the ratio to one process, against N, says whether the reach grows
in proportion to the rank count.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import torch
import commlib  # before mpi4py (also _quiet's): commlib sets UCX's TCP defaults before MPI initializes
from _quiet import quiet_for, quiet_summary
from mpi4py import MPI

from commlib.nn import functional as F
from commlib.nn import _ring

torch.set_num_threads(1)

# Two allocator settings (glibc). Timing runs with freed blocks kept for reuse below 32 MiB, as
# glibc's adaptive default ends up after a few iterations of a training loop. Memory peaks need
# freed tensors back in the OS: there every tensor above 64 KiB is its own mapping (a fixed mmap
# threshold, no dynamic raise) and the heap is trimmed first; under that setting every temporary
# is a fresh mapping, which made the timed runs 10% slower (measured at 4096 tokens, 2 ranks).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: peaks are still measured, less tightly
    _libc = None


def allocator(tight: bool) -> None:
    """``tight``: every freed tensor above 64 KiB goes back to the OS (memory peaks); else freed
    blocks are kept for reuse (timing)."""
    if _libc is None:
        return
    _libc.mallopt(M_MMAP_THRESHOLD, (64 << 10) if tight else (32 << 20))
    _libc.mallopt(M_TRIM_THRESHOLD, (128 << 10) if tight else (64 << 20))
    if tight:
        _libc.malloc_trim(0)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def peak_of(fn) -> int:
    """Peak resident bytes added while ``fn`` runs (VmHWM reset through clear_refs); meaningful
    under ``allocator(True)`` only."""
    base = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return _status("VmHWM:") - base


def sleep_until(flag_from: int) -> None:
    """Non-root ranks wait for rank 0 without spinning (they share its cores)."""
    buf = torch.zeros(1)
    w = commlib.irecv(buf, flag_from, tag=77)
    while not w.is_completed():
        time.sleep(0.005)
    w.wait()


def release() -> None:
    for r in range(1, commlib.get_world_size()):
        commlib.isend(torch.ones(1), r, tag=77).wait()


def inputs(args, s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape_q = (args.batch, s, args.heads, args.head_dim)
    shape_kv = (args.batch, s, args.kv_heads, args.head_dim)
    return (torch.randn(shape_q, generator=g), torch.randn(shape_kv, generator=g),
            torch.randn(shape_kv, generator=g), torch.randn(shape_q, generator=g))


def one_process(args, full):
    q, k, v, do = (t.clone() for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=args.causal,
        enable_gqa=args.heads != args.kv_heads).transpose(1, 2)
    out.backward(do)
    return out


def layout_of(algorithm: str, args) -> str:
    return "contiguous" if algorithm == "ulysses" else args.layout


def parallel(args, algorithm: str, local):
    q, k, v, do = (t.clone() for t in local)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if algorithm == "ulysses":
        out = F.ulysses_attention(q, k, v, causal=args.causal)
    else:
        out = F.ring_attention(q, k, v, causal=args.causal, layout=args.layout,
                               algorithm=algorithm, head_chunks=args.head_chunks,
                               seq_chunks=args.seq_chunks)
    out.backward(do)
    return out


def comm_alone(args, algorithm: str, local) -> float:
    """The transfers of one forward+backward with no compute in between: the ring's K/V hops
    (twice for rsa's K then V passes) and the backward's K/V and (dK, dV) hops, pass by pass as
    the ring sends them (its head groups x key segments, each pass's K/V packed in one message)."""
    from commlib.nn._layout import LAYOUTS
    from commlib.nn._plan import plan_ring

    n = commlib.get_world_size()
    plan = plan_ring(commlib.get_rank(), n, args.causal, args.layout)
    _, k, v, _ = local
    commlib.barrier()
    t0 = time.perf_counter()
    if algorithm == "rsa":
        _ring.ring_loop(plan, None, (k,), lambda s, c, p: None)
        _ring.ring_loop(plan, None, (v,), lambda s, c, p: None)
        _ring.ring_loop(plan, None, (k, v), lambda s, c, p: None,
                        _ring._CarryKV([(t.shape, t.dtype, t.device) for t in (k, v)]))
        return time.perf_counter() - t0
    hk = k.shape[2]
    per = LAYOUTS[args.layout].chunks_per_rank
    c = k.shape[1] // per
    hc = args.head_chunks or F.default_head_chunks(hk, n)
    sc = args.seq_chunks or F.default_seq_chunks(hc, c, n)
    for _, kh, spans in _ring.ring_passes(hk, hk, c, per, hc, sc):
        pack = _ring._Pack(k, v, spans, kh, n)
        _ring.ring_loop(plan, None, pack.moving(k, v), lambda s, c, p: None)
        _ring.ring_loop(plan, None, pack.moving(k, v), lambda s, c, p: None,
                        _ring._CarryKV(pack.like(k), pack.views))
    return time.perf_counter() - t0


def a2a_alone(args, local) -> float:
    """The four all-to-alls of ulysses' forward and four of its backward, alone."""
    q, k, v, do = local
    n = commlib.get_world_size()
    commlib.barrier()
    t0 = time.perf_counter()
    for _ in range(2):
        for t in (q, k, v, do):
            F._seq_to_heads(t, n, None) if t.shape[2] % n == 0 else None
    return time.perf_counter() - t0


def wait_split() -> tuple[float, float]:
    """This call's wait after compute, split with every rank's batch stamps (one host, one
    monotonic clock) into (imbalance, transfer): the part before both ring neighbours had posted
    the batch (waiting for a slower rank, not for the network), and the transfer still running
    after that, which is the communication not hidden behind compute. Max over ranks of each."""
    trace = _ring.STATS["trace"]
    n, r = commlib.get_world_size(), commlib.get_rank()
    mine = torch.tensor(trace, dtype=torch.float64).reshape(-1, 3)
    every = torch.empty((n,) + mine.shape, dtype=torch.float64)
    commlib.all_gather_into_tensor(every, mine)
    posted, computed, waited = mine.unbind(1)
    peers = torch.maximum(every[(r - 1) % n, :, 0], every[(r + 1) % n, :, 0])
    ready = torch.maximum(computed, peers)
    transfer = (waited - ready).clamp(min=0).sum().item()
    imbalance = (waited - computed).sum().item() - transfer
    return max_over_ranks(imbalance), max_over_ranks(transfer)


def _median(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    commlib.all_reduce(t, op=commlib.ReduceOp.MAX)
    return t.item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-s", "--seq", type=int, nargs="+", default=[4096, 8192],
                   help="total sequence lengths")
    p.add_argument("--algorithms", nargs="+", default=["ring", "rsa", "ulysses"],
                   choices=["ring", "rsa", "ulysses"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--non-causal", dest="causal", action="store_false")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--head-chunks", type=int, default=None, help="ring: head groups (default: library's)")
    p.add_argument("--seq-chunks", type=int, default=None,
                   help="ring: key segments per head group (default: library's)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="memory budget of the longest-sequence search (default: mem1 at the "
                        "smallest length)")
    p.add_argument("--no-budget-search", dest="budget_search", action="store_false",
                   help="skip the measured longest-sequence search")
    p.add_argument("--search-cap", type=int, default=8,
                   help="stop the search at this multiple of the smallest length")
    p.add_argument("--no-poll", dest="poll", action="store_false",
                   help="ring/rsa: do not poll the transfers between sub-blocks (the previous "
                        "behaviour, to see what polling hides)")
    p.add_argument("--patience", type=float, default=60.0,
                   help="seconds to wait per timing round for the host's slow phases to pass "
                        "(bench/_quiet.py; 0: do not check)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads

    _ring.POLL = args.poll
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    out = print if rank == 0 else (lambda *a, **k: None)
    out(f"# seq_attention: {n} ranks, backend {commlib.get_world_group().backend.name}, "
        f"batch {args.batch}, heads {args.heads}/{args.kv_heads} (q/kv), head_dim {args.head_dim}, "
        f"causal {args.causal}, layout {args.layout} (ulysses: contiguous), float32, "
        f"{torch.get_num_threads()} thread per process, {args.rounds} rounds, medians, "
        f"{'polling' if args.poll else 'NOT polling'} between sub-blocks")
    out(f"# {'algorithm':>9} {'seq':>7} {'t1(ms)':>9} {'tN(ms)':>9} {'eff':>6} {'effcpu':>6} {'hidden':>7} "
        f"{'comm(ms)':>9} {'exposed':>8} {'imbal':>7} {'mem1(MiB)':>10} {'memN(MiB)':>10} {'memN/mem1':>9} {'err':>9}")
    eligible = [a for a in args.algorithms
                if not (a == "ulysses" and (args.heads % n or args.kv_heads % n))]
    # Pass 1, tight allocator (from the start: never after the timing setting, whose heap of
    # reusable blocks would be counted again): peaks, and the longest sequence within a budget.
    allocator(True)
    mem1, mem_n = {}, {}
    for s in args.seq:
        full = inputs(args, s)
        for algorithm in eligible:
            local = [F.shard_sequence(t, dim=1, layout=layout_of(algorithm, args)) for t in full]
            parallel(args, algorithm, local)  # warm-up: the engine's own buffers exist
            if rank == 0:  # one forward+backward each, rank 0 alone first
                if s not in mem1:
                    mem1[s] = peak_of(lambda full=full: one_process(args, full))
                release()
            else:
                sleep_until(0)
            commlib.barrier()
            mem_n[s, algorithm] = max_over_ranks(peak_of(lambda a=algorithm, x=local:
                                                         parallel(args, a, x)))
    budget_lines = []
    if args.budget_search:
        one = torch.tensor([float(mem1.get(min(args.seq), 0))])
        commlib.broadcast(one, 0)  # rank 0 measured it; the search runs on every rank
        budget_report(args, one.item() / (1 << 20), n, budget_lines.append)
    # Pass 2, the timing allocator: times, overlap and the result check.
    allocator(False)
    quiet = quiet_for(MPI.COMM_WORLD, args.patience)
    rows = []
    for s in args.seq:
        full = inputs(args, s)
        for algorithm in args.algorithms:
            if algorithm not in eligible:
                out(f"  {algorithm:>9} {s:>7}  skipped: heads not divisible by {n}")
                continue
            layout = layout_of(algorithm, args)
            local = [F.shard_sequence(t, dim=1, layout=layout) for t in full]
            # warm-up (untimed) and the result check
            got = F.unshard_sequence(parallel(args, algorithm, local).detach(), dim=1, layout=layout)
            if rank == 0:
                ref = one_process(args, full).detach()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                release()
            else:
                sleep_until(0)
                err = 0.0
            t1s, tns, exposed, alone, imbalance = [], [], [], [], []
            c1s, cns = [], []
            for _ in range(args.rounds):
                quiet.wait()  # not inside one of the host's slow phases (canaries, all ranks)
                if rank == 0:  # the one-process reference, the other ranks asleep
                    t0, c0 = time.perf_counter(), time.thread_time()
                    one_process(args, full)
                    t1s.append(time.perf_counter() - t0)
                    c1s.append(time.thread_time() - c0)
                    release()
                else:
                    sleep_until(0)
                commlib.barrier()
                _ring.reset_stats(trace=True)
                t0, c0 = time.perf_counter(), time.thread_time()
                parallel(args, algorithm, local)
                tns.append(max_over_ranks(time.perf_counter() - t0))
                cns.append(max_over_ranks(time.thread_time() - c0))
                if algorithm != "ulysses":
                    imb, xfer = wait_split()
                    imbalance.append(imb)
                    exposed.append(xfer)
                alone.append(max_over_ranks(comm_alone(args, algorithm, local) if algorithm != "ulysses"
                                            else a2a_alone(args, local)))
            t1 = statistics.median(t1s) if rank == 0 else 0.0
            tn = statistics.median(tns)
            if algorithm == "ulysses":
                hidden_text = f"a2a {statistics.median(alone) / tn:.0%}"
                hidden = 0.0
            else:
                c = statistics.median(alone)
                hidden = max(0.0, min(1.0, 1 - _median(exposed) / c)) if c > 0 else 1.0
                hidden_text = f"{hidden:.0%}" if n > 1 else "-"
            eff = t1 / (n * tn) if rank == 0 else 0.0
            eff_cpu = _median(c1s) / (n * _median(cns)) if rank == 0 else 0.0
            mib = 1 << 20
            if rank == 0:
                m1, mn = mem1[s], mem_n[s, algorithm]
                row = dict(algorithm=algorithm, seq=s, ranks=n, t1_ms=t1 * 1e3, tn_ms=tn * 1e3,
                           efficiency=eff, efficiency_cpu=eff_cpu, hidden=hidden, mem1_mib=m1 / mib,
                           memn_mib=mn / mib,
                           mem_ratio=mn / m1, err=err, comm_ms=statistics.median(alone) * 1e3,
                           exposed_ms=_median(exposed) * 1e3, imbalance_ms=_median(imbalance) * 1e3,
                           t1_rounds=t1s, tn_rounds=tns)
                rows.append(row)
                out(f"  {algorithm:>9} {s:>7} {t1 * 1e3:>9.1f} {tn * 1e3:>9.1f} {eff:>6.1%} {eff_cpu:>6.1%} "
                    f"{hidden_text:>7} {statistics.median(alone) * 1e3:>9.1f} "
                    f"{_median(exposed) * 1e3:>8.1f} {_median(imbalance) * 1e3:>7.1f} "
                    f"{m1 / mib:>10.1f} {mn / mib:>10.1f} "
                    f"{mn / m1:>9.1%} {err:>9.2e}", flush=True)
    for line in budget_lines:
        out(line)
    out(quiet_summary(MPI.COMM_WORLD))
    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": n, "args": vars(args), "rows": rows}, f, indent=1)
    commlib.barrier()
    return 0


def _fits(args, algorithm, s: int, budget: float) -> bool:
    """Run one forward+backward at total length ``s`` and compare its peak (per rank, the largest;
    ``algorithm`` None: one process on rank 0, the others asleep) with ``budget`` bytes. Every
    rank returns the same answer."""
    full = inputs(args, s, seed=1)
    if algorithm is None:
        peak = 0.0
        if commlib.get_rank() == 0:
            peak = peak_of(lambda: one_process(args, full))
            release()
        else:
            sleep_until(0)
    else:
        layout = layout_of(algorithm, args)
        local = [F.shard_sequence(t, dim=1, layout=layout) for t in full]
        del full
        commlib.barrier()
        peak = peak_of(lambda: parallel(args, algorithm, local))
    return max_over_ranks(peak) <= budget


def longest_within(args, algorithm, budget: float, s0: int, grain: int) -> int:
    """The longest total length, a multiple of ``grain``, whose measured peak fits ``budget``:
    doubling from ``s0`` until a length does not fit, then bisection (every probe measured)."""
    lo, hi = 0, s0
    while _fits(args, algorithm, hi, budget):
        lo, hi = hi, 2 * hi
        if hi > args.search_cap * s0:
            return lo  # fits beyond the cap: report the cap
    while hi - lo > grain:
        mid = (lo + hi) // 2 // grain * grain
        lo, hi = (mid, hi) if _fits(args, algorithm, mid, budget) else (lo, mid)
    return lo


def budget_report(args, mem1_mib: float, n, out):
    """Longest sequence within a memory budget, measured (not fitted) for one process and for each
    algorithm on the N ranks; the budget defaults to one process's peak at the smallest length
    (``mem1_mib``). Lines go to ``out``."""
    s0 = min(args.seq)
    budget = (args.budget_mib or mem1_mib) * (1 << 20)
    grain = max(2 * n, s0 // 16 // (2 * n) * (2 * n))
    s1 = longest_within(args, None, budget, s0, grain)
    out(f"# longest sequence within {budget / (1 << 20):.1f} MiB per process, measured (doubling "
        f"then bisection to {grain} tokens): one process {s1:,}")
    for algorithm in args.algorithms:
        if algorithm == "ulysses" and (args.heads % n or args.kv_heads % n):
            continue
        sn = longest_within(args, algorithm, budget, s0, grain)
        capped = " (search cap reached)" if sn >= args.search_cap * s0 else ""
        out(f"#   {algorithm:>9} on {n} ranks: {sn:,} tokens = {sn / s1:.2f} x one process "
            f"({sn / s1 / n:.0%} of proportional){capped}")


if __name__ == "__main__":
    sys.exit(main())
