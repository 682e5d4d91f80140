"""Where a DDP step's communication goes: per bucket, when DDP issued its all-reduce and when it
completed, against the backward pass, on the "commlib" backend and on gloo with the same buckets.

    vcluster mpirun -n 2 -ppn 1 -- python bench/ddp_trace.py --models transformer
    mpiexec -n 2 .venv/bin/python bench/ddp_trace.py --models mlp --mlp-batch 1

bench/ddp.py gives the share of the communication a step did not pay for (``hidden``); this says
why the rest was paid. Each configuration trains its own copy of the model (bench/ddp.py's models
and data) under DDP with ``bucket_cap_mb`` from ``commlib.torch_backend.ddp_bucket_mb`` (or
``--bucket-cap-mb``: a size, or ``ddp`` for DDP's default buckets) and a communication hook that
is torch's default all-reduce (``default_hooks.allreduce_hook``: divide, all-reduce SUM) with a
clock around it; ``compute`` is the same model without DDP; ``--int8`` adds ``int8``, commlib's
compressed hook (``commlib.compress.ddp_hook("int8", algorithm="compressed")``, on its own thread
where the group allows: across hosts) and ``int8-call``, the same run in the hook
(``overlap=False``). Per step (the slowest rank's, the median of ``--steps``):

* ``backward``: from the backward's start to its last bucket's issue (DDP) or to its end (compute):
  the backward's own work; DDP's minus compute's is what the communication took from it (the
  cores the network's or the copies' work took, DDP's own copies);
* ``tail``: from the last bucket's issue to the end of the backward (DDP waits for every bucket):
  the communication left when the gradients were all ready;
* ``overlapped``: the share of the buckets' all-reduce time (issue to done, summed) that fell
  before the last bucket's issue, while the backward was still computing (for a hook that
  completes in the call, ``int8-call`` and every row on one host with no core free, the backward
  waited meanwhile: there it is not time hidden);
* ``last``: the last bucket's all-reduce, issue to done, on the rank that issued it last (the
  least over ranks: the others had posted theirs, so this is the transfer, not the ranks' skew);
  the median over steps;
* ``step``: the whole step, ``zero_grad`` to the optimizer's update;
* ``cpu``: the CPU time the process used during the step, every thread (the caller's, commlib's
  progress thread, gloo's) and the kernel's work on its behalf: on hosts whose cores all compute,
  what the communication costs the compute.

``--threads`` adds, per row, the CPU time of each of the process's threads during the step (Linux:
``/proc/self/task/*/schedstat``), by thread: ``main`` (the caller: forward, backward, DDP's
reducer), Python's threads by name (``commlib-progress-remote``, ``commlib-callbacks``) and the
others by their kernel name (gloo's, UCX's, torch's): where the communication's CPU goes; and how
many times a step the kernel preempted the main thread for another task (:func:`preempted`): what
the communication's threads' wake-ups cost the compute beyond their CPU.

The configurations take turns step by step (the order rotating, bench/ddp.py's
:func:`~ddp.order_of`), so the host's slow phases fall on all alike, and the last lines give, per
DDP row, the median over steps of gloo's step time over the row's and the steps it was faster in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import commlib  # before mpi4py: commlib sets UCX's TCP defaults before MPI initializes
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import commlib.compress
import commlib.torch_backend
from _harness import rank0_out
from ddp import MODELS, Config, add_model_args, order_of, start

COMM = MPI.COMM_WORLD


class Traced(Config):
    """bench/ddp.py's row (a copy of the model under DDP on ``group``, or alone where ``cap`` is
    None) whose hook (``inner``, a ``(state, hook)`` pair; default torch's all-reduce hook)
    records (bytes, issued, done)."""

    def __init__(self, name: str, model, group, cap: float | None, inner=None, ddp=True):
        self.inner = inner or (group if group is not None else dist.group.WORLD,
                               default_hooks.allreduce_hook)
        self.events: list[tuple[int, float, float]] = []
        self.threads = False  # record thread_cpu() per step (--threads)
        super().__init__(name, model, group, bucket_cap_mb=cap, ddp=ddp,
                         hook=self._hook if ddp else None)

    def _hook(self, state, bucket):
        issued = time.perf_counter()
        nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
        fut = self.inner[1](self.inner[0], bucket)

        def done(f):
            self.events.append((nbytes, issued, time.perf_counter()))
            return f.value()
        return fut.then(done)

    def step(self) -> dict:
        self.events.clear()
        th0 = thread_cpu() if self.threads else None
        pre0 = preempted() if self.threads else None
        c0 = time.process_time()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(self.net(self.model.x), self.model.y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        row = {"step": t3 - t0, "cpu": time.process_time() - c0, "backward": t2 - t1,
               "tail": 0.0, "last": None, "overlapped": None, "buckets": len(self.events)}
        if th0 is not None:
            row["threads"] = {k: v - th0.get(k, 0.0) for k, v in thread_cpu().items()}
            row["preempted"] = preempted() - pre0
        if self.events:
            _, last, done = max(self.events, key=lambda e: e[1])
            comm = sum(d - i for _, i, d in self.events)
            before = sum(max(0.0, min(d, last) - i) for _, i, d in self.events)
            row.update(backward=last - t1, tail=t2 - last, last=done - last,
                       overlapped=before / comm)
        return row


def thread_cpu() -> dict[str, float]:
    """CPU seconds each live thread of this process has used, by name (see ``--threads``); {}
    where ``/proc/self/task`` is missing."""
    named = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    named[os.getpid()] = "main"
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            name = named.get(int(tid))
            if name is None:  # not a Python thread: its kernel name
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0.0) + ns * 1e-9
    return out


def preempted() -> int:
    """How many times the kernel has preempted this process's main thread (the caller: forward,
    backward) to run another task: ``nonvoluntary_ctxt_switches`` (Linux); 0 elsewhere."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cap(text: str | None):
    """``--bucket-cap-mb`` parsed once, as ``(value, ok)``: None (commlib's proposal), ``"ddp"``
    (DDP's default buckets) or MiB; ``ok`` False for text that is not a number above 0."""
    if text in (None, "ddp"):
        return text, True
    try:
        mb = float(text)
    except ValueError:
        return None, False
    return mb, mb > 0


def _threads_line(per_rank: list[list[dict[str, float]]]) -> str:
    """'name a/b ms' per thread name, the medians over steps of each rank, the busiest first."""
    names = sorted({k for steps in per_rank for r in steps for k in r},
                   key=lambda k: -sum(r.get(k, 0.0) for steps in per_rank for r in steps))
    return "; ".join(
        f"{k} " + "/".join(f"{1e3 * statistics.median(r.get(k, 0.0) for r in steps):.1f}"
                           for steps in per_rank)
        for k in names if any(r.get(k, 0.0) > 5e-5 for steps in per_rank for r in steps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="transformer", help="comma-separated: mlp, transformer")
    add_model_args(ap)
    ap.add_argument("--bucket-cap-mb", default=None,
                    help="DDP's bucket_cap_mb, or 'ddp' for DDP's default buckets (25 MiB, the "
                         "first 1 MiB; default: commlib.torch_backend.ddp_bucket_mb)")
    ap.add_argument("--steps", type=int, default=9, help="traced steps per configuration")
    ap.add_argument("--int8", action="store_true",
                    help="also rows 'int8' (commlib.compress.ddp_hook('int8', "
                         "algorithm='compressed'), overlapped where the group allows) and "
                         "'int8-call' (the same with overlap=False)")
    ap.add_argument("--threads", action="store_true",
                    help="also the CPU time of each thread during the step (Linux)")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    asked, cap_ok = _cap(args.bucket_cap_mb)
    if not names or any(m not in MODELS for m in names) or args.steps < 1 or not cap_ok:
        if COMM.rank == 0:
            print(f"bench/ddp_trace.py: --models takes {', '.join(MODELS)} (got "
                  f"{args.models!r}); --steps must be >= 1; --bucket-cap-mb a number of MiB "
                  f"above 0 or 'ddp' (got {args.bucket_cap_mb!r})", file=sys.stderr)
        return 2
    gloo = start(args)
    out = rank0_out(dist.get_rank())
    hosts = len(set(COMM.allgather(MPI.Get_processor_name())))
    out(f"# bench/ddp_trace.py: {COMM.size} ranks on {hosts} host(s); slowest rank, median of "
        f"{args.steps} steps; ms")
    for m in names:
        model = MODELS[m](args, dist.get_rank())
        cap = (commlib.torch_backend.ddp_bucket_mb(model.module) if asked is None
               else None if asked == "ddp" else asked)
        cfgs = [Traced("commlib", model, None, cap), Traced("gloo", model, gloo, cap),
                Traced("compute", model, None, None, ddp=False)]
        if args.int8:  # on the hook's thread where the group allows, and in the call
            cfgs[1:1] = [Traced(name, model, None, cap,
                                commlib.compress.ddp_hook("int8", algorithm="compressed",
                                                          overlap=overlap))
                         for name, overlap in (("int8", "auto"), ("int8-call", False))]
        out(f"# {m}: {model.what}; {model.grad_bytes / 2**20:.1f} MiB of gradients; "
            f"bucket_cap_mb {'DDP default' if cap is None else f'{cap:.3g}'}")
        out(f"# {'config':>9} | {'step':>7} | {'cpu':>6} | {'backward':>8} | {'tail':>6} | "
            f"{'last':>6} | {'overlapped':>10} | buckets")
        for c in cfgs:
            c.threads = args.threads
            for _ in range(4):  # warm-up: DDP rebuilds its buckets at its third step
                c.step()
        by = {c.name: c for c in cfgs}
        names = list(by)
        rows: dict[str, list[dict]] = {name: [] for name in names}
        for k in range(args.steps):  # the configurations take turns, step by step
            for name in order_of(k, names):
                COMM.Barrier()
                rows[name].append(by[name].step())
        slowest = {name: [COMM.allreduce(r["step"], op=MPI.MAX) for r in rows[name]]
                   for name in names}
        for c in cfgs:
            mine = rows[c.name]
            # the slowest rank's value of each step (the last bucket: the least), the median
            med = {k: statistics.median(COMM.allreduce(r[k], op=MPI.MAX) for r in mine)
                   for k in ("cpu", "backward", "tail")}
            med["step"] = statistics.median(slowest[c.name])
            last = (statistics.median(COMM.allreduce(r["last"], op=MPI.MIN) for r in mine)
                    if mine[0]["last"] is not None else None)
            over = [r["overlapped"] for r in mine if r["overlapped"] is not None]
            share = statistics.median(COMM.allgather(statistics.median(over))) if over else None
            out(f"  {c.name:>9} | {med['step'] * 1e3:7.1f} | {med['cpu'] * 1e3:6.1f} | "
                f"{med['backward'] * 1e3:8.1f} | "
                f"{med['tail'] * 1e3:6.1f} | {'-' if last is None else f'{last * 1e3:.1f}':>6} | "
                f"{'-' if share is None else f'{100 * share:.0f}%':>10} | {mine[-1]['buckets']}")
        if args.threads:
            for c in cfgs:
                out(f"# {c.name} threads, ms per step (median of steps, rank by rank): "
                    + _threads_line(COMM.allgather([r["threads"] for r in rows[c.name]])))
                times = COMM.allgather(statistics.median(r["preempted"] for r in rows[c.name]))
                out(f"# {c.name} main thread preempted, times per step (median of steps, rank by "
                    f"rank): " + "/".join(f"{n:g}" for n in times))
        for name in names:
            if name not in ("gloo", "compute"):
                ratios = [g / s for g, s in zip(slowest["gloo"], slowest[name])]
                out(f"# {m} {name}: gloo/{name} step median {statistics.median(ratios):.3f}, "
                    f"{name} faster in {sum(r > 1 for r in ratios)} of {len(ratios)} steps")
    COMM.Barrier()
    dist.destroy_process_group()
    commlib.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
