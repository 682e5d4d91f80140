"""Sequence-parallel attention benchmark: ring (zigzag), rsa and ulysses against one process.

Run under mpirun (every rank one torch thread, as is the one-process reference)::

    mpiexec -n 2 .venv/bin/python bench/seq_attention.py -s 4096 --rounds 5
    mpiexec -n 4 .venv/bin/python bench/seq_attention.py -s 2048 4096 8192 --algorithms ring rsa ulysses

For each total sequence length and algorithm it prints, side by side in one run:

* ``t1``: one process computing forward+backward of ``scaled_dot_product_attention`` on the full
  sequence (rank 0, the other ranks sleeping), median over rounds;
* ``tN``: forward+backward per rank of the sequence-parallel call (slowest rank), median;
* ``eff = t1 / (N * tN)``: parallel efficiency;
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

Rounds interleave the one-process and the parallel runs, so machine noise hits both. After the
table, for the memory budget ``--budget-mib``, the longest sequence that fits is solved from a
linear fit of peak memory against length (memory of these methods is linear in s; RSA is
quadratic and is fitted as such), for one process and per algorithm at N ranks.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import torch

import commlib
from commlib.nn import functional as F
from commlib.nn import _ring

torch.set_num_threads(1)

# Freed tensors must go back to the OS for resident-memory peaks to mean anything: a fixed mmap
# threshold (no dynamic raise) makes every tensor above 64 KiB its own mapping.
try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
    _libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
except OSError:  # not glibc: peaks are still measured, less tightly
    pass


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def peak_of(fn) -> int:
    """Peak resident bytes added while ``fn`` runs (VmHWM reset through clear_refs)."""
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
                               algorithm=algorithm, head_chunks=args.head_chunks)
    out.backward(do)
    return out


def comm_alone(args, algorithm: str, local) -> float:
    """The transfers of one forward+backward with no compute in between: the ring's K/V hops
    (twice for rsa's K then V passes) and the backward's K/V and (dK, dV) hops."""
    from commlib.nn._plan import plan_ring

    plan = plan_ring(commlib.get_rank(), commlib.get_world_size(), args.causal, args.layout)
    _, k, v, _ = local
    commlib.barrier()
    t0 = time.perf_counter()
    if algorithm == "rsa":
        _ring.ring_loop(plan, None, (k,), lambda s, c, p: None)
        _ring.ring_loop(plan, None, (v,), lambda s, c, p: None)
    else:
        _ring.ring_loop(plan, None, (k, v), lambda s, c, p: None)
    _ring.ring_loop(plan, None, (k, v), lambda s, c, p: [],
                    lambda parts, inc: inc if inc is not None else (k.clone(), v.clone()))
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
    p.add_argument("-s", "--seq", type=int, nargs="+", default=[4096], help="total sequence lengths")
    p.add_argument("--algorithms", nargs="+", default=["ring", "rsa", "ulysses"],
                   choices=["ring", "rsa", "ulysses"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--non-causal", dest="causal", action="store_false")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--head-chunks", type=int, default=None, help="ring: head groups (default: library's)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="memory budget for the longest-sequence estimate (default: mem1 at the "
                        "smallest length)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads

    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    out = print if rank == 0 else (lambda *a, **k: None)
    out(f"# seq_attention: {n} ranks, backend {commlib.get_world_group().backend.name}, "
        f"batch {args.batch}, heads {args.heads}/{args.kv_heads} (q/kv), head_dim {args.head_dim}, "
        f"causal {args.causal}, layout {args.layout} (ulysses: contiguous), float32, "
        f"{torch.get_num_threads()} thread per process, {args.rounds} rounds, medians")
    out(f"# {'algorithm':>9} {'seq':>7} {'t1(ms)':>9} {'tN(ms)':>9} {'eff':>6} {'hidden':>7} "
        f"{'comm(ms)':>9} {'exposed':>8} {'imbal':>7} {'mem1(MiB)':>10} {'memN(MiB)':>10} {'memN/mem1':>9} {'err':>9}")
    rows = []
    for s in args.seq:
        full = inputs(args, s)
        mem1 = None
        for algorithm in args.algorithms:
            if algorithm == "ulysses" and (args.heads % n or args.kv_heads % n):
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
            for _ in range(args.rounds):
                if rank == 0:  # the one-process reference, the other ranks asleep
                    t0 = time.perf_counter()
                    one_process(args, full)
                    t1s.append(time.perf_counter() - t0)
                    release()
                else:
                    sleep_until(0)
                commlib.barrier()
                _ring.reset_stats(trace=True)
                t0 = time.perf_counter()
                parallel(args, algorithm, local)
                tns.append(max_over_ranks(time.perf_counter() - t0))
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
            # memory: one forward+backward each, rank 0 alone first
            if rank == 0:
                if mem1 is None:
                    mem1 = peak_of(lambda full=full: one_process(args, full))
                release()
            else:
                sleep_until(0)
            commlib.barrier()
            mem_n = max_over_ranks(peak_of(lambda a=algorithm, x=local: parallel(args, a, x)))
            eff = t1 / (n * tn) if rank == 0 else 0.0
            mib = 1 << 20
            if rank == 0:
                row = dict(algorithm=algorithm, seq=s, ranks=n, t1_ms=t1 * 1e3, tn_ms=tn * 1e3,
                           efficiency=eff, hidden=hidden, mem1_mib=mem1 / mib, memn_mib=mem_n / mib,
                           mem_ratio=mem_n / mem1, err=err, comm_ms=statistics.median(alone) * 1e3,
                           exposed_ms=_median(exposed) * 1e3, imbalance_ms=_median(imbalance) * 1e3,
                           t1_rounds=t1s, tn_rounds=tns)
                rows.append(row)
                out(f"  {algorithm:>9} {s:>7} {t1 * 1e3:>9.1f} {tn * 1e3:>9.1f} {eff:>6.1%} "
                    f"{hidden_text:>7} {statistics.median(alone) * 1e3:>9.1f} "
                    f"{_median(exposed) * 1e3:>8.1f} {_median(imbalance) * 1e3:>7.1f} {mem1 / mib:>10.1f} {mem_n / mib:>10.1f} "
                    f"{mem_n / mem1:>9.1%} {err:>9.2e}", flush=True)
    if rank == 0:
        budget_report(args, rows, n, out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": n, "args": vars(args), "rows": rows}, f, indent=1)
    commlib.barrier()
    return 0


def _fit(points, degree):
    """Least squares mem = a + b s (+ c s^2): coefficients."""
    import numpy as np

    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    if len(xs) <= degree:
        return None
    return np.polyfit(xs, ys, degree)[::-1]


def _solve(coef, budget):
    import numpy as np

    poly = np.array(coef, dtype=float)
    poly[0] -= budget
    roots = np.roots(poly[::-1])
    real = [r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0]
    return max(real) if real else None


def budget_report(args, rows, n, out):
    if len(args.seq) < 2:
        out("# longest sequence in a memory budget: needs at least two lengths (-s a b ...)")
        return
    one = sorted({(r["seq"], r["mem1_mib"]) for r in rows})
    budget = args.budget_mib or one[0][1]
    s1 = _solve(_fit(one, 1), budget)
    out(f"# longest sequence within {budget:.1f} MiB per process (linear fit of peak memory vs "
        f"length; rsa quadratic): one process {s1:,.0f}")
    for algorithm in args.algorithms:
        pts = [(r["seq"], r["memn_mib"]) for r in rows if r["algorithm"] == algorithm]
        coef = _fit(pts, 2 if algorithm == "rsa" else 1)
        sn = _solve(coef, budget) if coef is not None else None
        if sn is None or s1 is None:
            out(f"#   {algorithm:>9}: not enough points")
            continue
        out(f"#   {algorithm:>9} on {n} ranks: {sn:,.0f} tokens = {sn / s1:.2f} x one process "
            f"({sn / s1 / n:.0%} of proportional)")


if __name__ == "__main__":
    sys.exit(main())
