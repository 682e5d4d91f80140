"""How well the cost model predicts, and how well selection picks, on this machine.

    python bench/model_accuracy.py [--ranks 2,3,4] [--quick]      # spawns mpiexec per size
    python bench/model_accuracy.py --fresh --unbound --collectives all_reduce   # a new user's day
    python bench/model_accuracy.py --fresh --unbound --crowded-probe ...        # ... slowed probe
    mpirun -n N python bench/model_accuracy.py --worker --json F   # one size (what it spawns)

For all_reduce, all_gather, reduce_scatter and broadcast from 8 B to 64 MiB (x4 steps), at each
world size, it times every algorithm the collective has (median over rounds of the slowest rank's
mean, interleaved and outside the host's slow phases, as bench/calibrate.py does) and compares:

* **prediction**: the model's time for each (collective, size, algorithm) it can price, against
  the measured median; a point is *within* when |predicted / measured - 1| <= 25 %. Where the
  tuning file has an algorithm's curve this repeats a measurement, so the formulas alone are
  scored too (the same model keeping only the engine's measured curves);
* **selection**: the algorithm ``commlib`` picks automatically for (collective, size), against the
  fastest measured one; a point is *good* when the pick is within 10 % of the fastest;
* **the automatic call** (``algorithm=None``, timed itself) against the best of every algorithm
  and, for all_reduce, raw mpi4py ``Allreduce`` and torch gloo's ``all_reduce`` on the same
  buffer. For all_reduce the best is then timed again head to head with the automatic call
  (2 x rounds + 1 rounds, the two loops back to back in each round, in alternating order), and
  the median over rounds of the per-round ratio is the score (column ``auto/all``; the first
  sweep's ratio of medians is column ``sweep``). Why: the minimum over many noisy medians is
  biased low (the winner of a field of equal algorithms is the one whose noise fell lowest), so
  the sweep alone scores the automatic call against a time no algorithm runs at; choosing the
  best on one sample and comparing on another removes that bias. And the host's slow phases
  make a loop's time bimodal over rounds (measured at 2 ranks, 8 KiB: the medians of 21 rounds
  of the same algorithm, forced and automatic, 1.76 and 2.92 µs), while two loops of one round
  see the same phase (the median per-round ratio of that run: 1.009).

**Regret** (``--fresh``): the same on a tuning cache of its own that holds only what ``make bench``
puts there (``bench/calibrate.py --if-missing`` at 2 ranks), so each world size's job starts as
a new user's does: with the in-job probe of ``COMMLIB_AUTOTUNE`` where nothing is calibrated.
With ``--unbound`` the ranks are launched as ``make bench`` launches them (no ``-bind-to``;
commlib binds them itself, ``COMMLIB_AFFINITY``). For all_reduce it then prints, per world size,
the goals the automatic call is held to: within 1.25x of the best forced algorithm at every
size and within 1.10x at 90% of them (head-to-head ratios). ``--crowded-probe`` makes the probe
run slowed, as in one of the host's slow phases: rank 0 starts busy processes (two per core)
before ``commlib.init`` and stops them after it, so the sweep scores what the job's checks of its
probe (``COMMLIB_AUTOTUNE_RECHECK``) make of a bad one.

It prints one table per world size and the shares over all points. The model is the group's own
(``group.model``: from the tuning file, ``COMMLIB_TUNING_FILE`` or the per-host cache written by
bench/calibrate.py; without one, the defaults and the built-in probe), and the table says which.
Only algorithms eligible on the group are timed.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile

SIZES = [8 << (2 * i) for i in range(12)] + [64 << 20]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
PREDICT_TOL, SELECT_TOL = 0.25, 0.10
REGRET_MAX, REGRET_SHARE = 1.25, 0.90  # issue 23: the automatic all_reduce on a fresh cache
ORDER_GAP = 1.25  # algorithms this far apart in measured time must be in that order in the model


def worker(args) -> int:
    import torch
    from mpi4py import MPI

    import commlib
    from _harness import init_gloo
    from _quiet import set_patience
    from calibrate import measure_many, quiet_summary, run
    from commlib.algorithms import Call
    from commlib.tuning import select
    from commlib.tuning.selector import GroupModel, eligible, predictions

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    hogs = crowd() if args.crowded_probe and comm.Get_rank() == 0 else []
    try:
        commlib.init()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    group = commlib.get_world_group()
    dist = init_gloo(comm)
    p = group.size
    target, rounds = (0.02, 3) if args.quick else (0.05, 5)
    set_patience(0.0 if args.quick else 60.0)  # the slow-phase gate (--quick: none)
    model = group.model
    # The same model with measured curves for the engine's collectives only: how well the step
    # formulas alone predict commlib's own algorithms.
    formula_table = copy.copy(model.table)
    formula_table.curves = {c: {a: cv for a, cv in algos.items() if a == "native"}
                            for c, algos in model.table.curves.items()}
    formula_model = GroupModel(formula_table, model.source, model.gpu)
    rows = []
    for coll in args.collectives.split(","):
        names = eligible(group.resources, Call(coll, 0))
        for nbytes in SIZES:
            count = max(p, nbytes // 4 // p * p)
            full, part = torch.ones(count), torch.ones(count // p)
            size = count * 4
            # every algorithm, the automatic call and (all_reduce) raw mpi4py, interleaved
            fns = {a: functools.partial(run, coll, full, part, a) for a in names}
            fns["(auto)"] = functools.partial(run, coll, full, part, None)
            if coll == "all_reduce":
                fns["(mpi4py)"] = functools.partial(comm.Allreduce, MPI.IN_PLACE, full.numpy(), MPI.SUM)
                fns["(gloo)"] = functools.partial(dist.all_reduce, full)
            # short loops (latency-bound sizes) get more rounds: their medians spread more
            # (10-15% between two timings of the same algorithm at 4 oversubscribed ranks)
            times = measure_many(fns, comm, target,
                                 rounds if args.quick or nbytes > 65536 else 2 * rounds + 1)
            measured = {a: times[a] for a in names}
            others = {k: v for k, v in times.items() if k.startswith("(")}
            confirm = None
            if coll == "all_reduce":  # the sweep's best, again, head to head (see the docstring)
                rivals = {k: v for k, v in times.items() if k != "(auto)"}
                best = min(rivals, key=rivals.get)  # the same on every rank: times are agreed
                again = measure_many({"(auto)": fns["(auto)"], best: fns[best]}, comm, target,
                                     2 * rounds + 1, raw=True)
                confirm = {"best": best, "auto": statistics.median(again["(auto)"]),
                           "best_time": statistics.median(again[best]),
                           "ratio": statistics.median(a / b for a, b in zip(again["(auto)"], again[best]))}
            call = Call(coll, size)
            # the model in use now (the job's checks of its probe may have replaced the first)
            predicted = {x.algorithm: x.seconds
                         for x in predictions(call, p, group.resources, group.model)}
            formula = {x.algorithm: x.seconds for x in predictions(call, p, group.resources, formula_model)}
            picked = select(coll, size, group, None, coll).name
            rows.append({"p": p, "collective": coll, "size": size, "measured": measured,
                         "others": others, "predicted": predicted, "formula": formula,
                         "picked": picked, "confirm": confirm})
    if group.rank == 0:
        with open(args.json, "w") as f:
            json.dump({"p": p, "model": model.source, "rows": rows, "quiet": quiet_summary(comm),
                       "model_end": group.model.source, "crowded": len(hogs)}, f)
    commlib.finalize()
    return 0


def crowd() -> list:
    """Busy processes, two per core, each ending by itself within a minute: a crowded host."""
    spin = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2 * (os.cpu_count() or 1))]


def ordered_pairs(rows: list[dict]) -> tuple[int, int]:
    """Pairs of algorithms (same collective and size) whose measured times differ by more than
    ORDER_GAP, and how many of them the model's predictions put in the measured order: how well
    the model ranks the algorithms (closer pairs are within the noise of one sweep)."""
    pairs = same = 0
    for r in rows:
        measured, predicted = r["measured"], r["predicted"]
        names = sorted(a for a in measured if a in predicted)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                fast, slow = (a, b) if measured[a] < measured[b] else (b, a)
                if measured[slow] > ORDER_GAP * measured[fast]:
                    pairs += 1
                    same += predicted[fast] < predicted[slow]
    return pairs, same


def report(docs: list[dict]) -> dict[str, float]:
    within = total_pred = good = total_sel = auto_ok = total_auto = f_within = f_total = 0
    for doc in docs:
        print(f"\n# {doc['p']} ranks; model from {doc['model']}")
        if doc.get("crowded"):
            print(f"# the probe ran on a crowded host ({doc['crowded']} busy processes during init)")
        if doc.get("model_end", doc["model"]) != doc["model"]:
            print(f"# model at the end of the job: {doc['model_end']}")
        if doc.get("quiet"):
            print(doc["quiet"])
        print(f"# {'collective':14} {'size':>10}  {'picked':18} {'best':18} {'pick/best':>9} "
              f"{'sweep':>6} {'auto/all':>8}  prediction error per algorithm (predicted/measured - 1)")
        for r in doc["rows"]:
            measured, predicted, others = r["measured"], r["predicted"], r["others"]
            best = min(measured, key=measured.get)
            ratio = measured[r["picked"]] / measured[best]
            total_sel += 1
            good += ratio <= 1 + SELECT_TOL
            # the automatic call against the best of every algorithm and the raw engine calls:
            # in the sweep, and (all_reduce) head to head with the sweep's best
            sweep = others["(auto)"] / min([*measured.values()] + [v for k, v in others.items() if k != "(auto)"])
            confirm = r.get("confirm")
            auto = confirm["ratio"] if confirm else sweep
            if r["collective"] == "all_reduce":
                total_auto += 1
                auto_ok += auto <= 1 + SELECT_TOL
            for a, t in measured.items():
                if a in r.get("formula", {}) and a != "native":
                    f_total += 1
                    f_within += abs(r["formula"][a] / t - 1) <= PREDICT_TOL
            errs = []
            for a, t in sorted(measured.items()):
                if a in predicted:
                    e = predicted[a] / t - 1
                    total_pred += 1
                    within += abs(e) <= PREDICT_TOL
                    errs.append(f"{a}:{e:+.0%}")
                else:
                    errs.append(f"{a}:n/a")
            print(f"  {r['collective']:14} {r['size']:>10}  {r['picked']:18} {best:18} "
                  f"{ratio:9.2f} {sweep:6.2f} {f'{auto:.2f}' if confirm else '-':>8}  {' '.join(errs)}")
    for doc in docs:
        pairs, same = ordered_pairs(doc["rows"])
        if pairs:
            print(f"# {doc['p']} ranks: the model orders {same}/{pairs} = {same / pairs:.0%} of the "
                  f"pairs of algorithms whose measured times differ by more than "
                  f"{ORDER_GAP:.2f}x as measured (every collective and size)")
        ratios = [r["confirm"]["ratio"] for r in doc["rows"] if r.get("confirm")]
        if ratios:
            worst = max(ratios)
            near = sum(x <= 1 + SELECT_TOL for x in ratios)
            print(f"# {doc['p']} ranks: automatic all_reduce / best forced, head to head: worst "
                  f"{worst:.2f}x (goal <= {REGRET_MAX:.2f}x at every size: "
                  f"{'met' if worst <= REGRET_MAX else 'MISSED'}); within {1 + SELECT_TOL:.2f}x at "
                  f"{near}/{len(ratios)} = {near / len(ratios):.0%} of sizes (goal >= "
                  f"{REGRET_SHARE:.0%}: {'met' if near >= REGRET_SHARE * len(ratios) else 'MISSED'}); "
                  f"median {statistics.median(ratios):.2f}x")
    shares = {"prediction": within / total_pred if total_pred else 0.0,
              "selection": good / total_sel if total_sel else 0.0,
              "all_reduce_auto": auto_ok / total_auto if total_auto else 0.0,
              "formulas": f_within / f_total if f_total else 0.0}
    print(f"\n# prediction within ±{PREDICT_TOL:.0%}: {within}/{total_pred} points = "
          f"{shares['prediction']:.1%} (goal >= 80%)")
    print(f"#   (the step formulas alone, for commlib's own algorithms: {f_within}/{f_total} = "
          f"{shares['formulas']:.1%} within ±{PREDICT_TOL:.0%})")
    print(f"# selection within {SELECT_TOL:.0%} of the fastest algorithm: {good}/{total_sel} points = "
          f"{shares['selection']:.1%} (goal >= 90%)")
    print(f"# commlib.all_reduce within {SELECT_TOL:.0%} of the best of its algorithms, MPI's "
          f"Allreduce and gloo (head to head): {auto_ok}/{total_auto} points = "
          f"{shares['all_reduce_auto']:.1%} (goal 100%)")
    return shares


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/model_accuracy.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,3,4", help="world sizes to run (default 2,3,4)")
    parser.add_argument("--quick", action="store_true", help="shorter loops, fewer rounds")
    parser.add_argument("--max-bytes", type=int, default=None, help="sizes up to this only")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES),
                        help=f"comma-separated (default {','.join(COLLECTIVES)})")
    parser.add_argument("--fresh", action="store_true",
                        help="a tuning cache of its own with only make bench's calibration (2 "
                             "ranks): the other sizes probe in the job")
    parser.add_argument("--unbound", action="store_true",
                        help="launch without -bind-to core, as make bench does")
    parser.add_argument("--crowded-probe", action="store_true",
                        help="busy processes on the cores during commlib.init: a slowed probe")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="worker: where to write its rows; "
                        "spawner: also write every row here")
    args = parser.parse_args(argv)
    if args.max_bytes is not None:
        SIZES[:] = [n for n in SIZES if n <= args.max_bytes] or SIZES[:1]
    if args.worker:
        return worker(args)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    docs = []
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if args.fresh:  # only what `make bench` calibrates, in a cache of this run's own
            env["XDG_CACHE_HOME"] = os.path.join(tmp, "cache")
            env.pop("COMMLIB_TUNING_FILE", None)
            subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.join(here, "calibrate.py"),
                            "--if-missing"], check=True, timeout=1800, env=env)
        # -bind-to core, unless --unbound: what commlib's own binding (COMMLIB_AFFINITY) is
        # measured against (docs/shm.md, "Binding")
        bind = [] if args.unbound else ["-bind-to", "core"]
        for n in [int(x) for x in args.ranks.split(",")]:
            out = os.path.join(tmp, f"np{n}.json")
            cmd = [mpiexec, *bind, "-n", str(n), sys.executable,
                   os.path.abspath(__file__), "--worker", "--collectives", args.collectives,
                   "--json", out] + (["--quick"] if args.quick else []) + \
                (["--crowded-probe"] if args.crowded_probe else []) + \
                (["--max-bytes", str(args.max_bytes)] if args.max_bytes is not None else [])
            subprocess.run(cmd, check=True, timeout=1800, env=env)
            with open(out) as f:
                docs.append(json.load(f))
    report(docs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(docs, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
