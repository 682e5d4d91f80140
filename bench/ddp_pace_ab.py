"""One of the progress loop's pacing rules across hosts, on and off in one run of bench/ddp.py.

    vcluster mpirun -n 2 -ppn 1 -- python bench/ddp_pace_ab.py --models transformer \\
        --rounds 15 --bucket-view --rows commlib,commlib-tuned-avg [--off idle|nap]

bench/ddp.py with one more row per commlib row asked for: the same DDP configuration whose steps
run with one rule off (``--off``, docs/overlap.md):

* ``idle`` (the default; twins ``<row>-noidle``): the remote progress thread's idle-caller signal
  (``commlib.runtime.progress.IDLE_SHARE`` -1: the fast pace only in the 10 ms after an operation
  is issued or advances, as before 2026-11-29);
* ``nap`` (twins ``<row>-spin``): a waiting caller's naps across hosts (``WAIT_SPIN_S`` endless:
  it spins and yields throughout, as before 2026-11-29's second session).

Both run in the same rounds, so the host's phases fall on both alike; the last lines give, per
pair, the median over rounds of each round's ``off / on`` step time and the rounds the rule won.
Every other option is bench/ddp.py's.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import commlib.runtime.progress as progress
import ddp

# --off: (the twins' suffix, the progress module's constant, its value with the rule off)
SWITCHES = {"idle": ("-noidle", "IDLE_SHARE", -1.0), "nap": ("-spin", "WAIT_SPIN_S", float("inf"))}


def install(off: str) -> None:
    """Add the twins of rule ``off`` to bench/ddp.py's rows, configurations and goal lines."""
    suffix, constant, value = SWITCHES[off]
    on_name, off_name = off, suffix[1:]

    class Off(ddp.Config):
        """A configuration whose steps run with the rule off."""

        def step(self) -> None:
            saved = getattr(progress, constant)
            setattr(progress, constant, value)
            try:
                super().step()
            finally:
                setattr(progress, constant, saved)

    def configs_for(model, gloo, bucket_view=False, rows=ddp.DDP_ROWS):
        cfgs, note = _configs_for(model, gloo, bucket_view, rows)
        twins = [Off(c.name + suffix, model, bucket_cap_mb=c.bucket_cap_mb,
                     bucket_view=c.bucket_view, hook=c.hook)
                 for c in cfgs if c.name.startswith("commlib")]
        return cfgs + twins, note

    def paired(results: list[dict]) -> list[str]:
        lines = []
        for r in results:
            rows = {x["config"]: x["rounds_s"] for x in r["rows"]}
            for name, off_s in rows.items():
                on_s = rows.get(name.removesuffix(suffix)) if name.endswith(suffix) else None
                if on_s:
                    ratios = [b / a for a, b in zip(on_s, off_s)]
                    lines.append(f"# {r['model']} {name.removesuffix(suffix)}: "
                                 f"{off_name}/{on_name} median {statistics.median(ratios):.3f}, "
                                 f"{on_name} faster in {sum(x > 1 for x in ratios)} of "
                                 f"{len(ratios)} rounds")
        return lines

    _configs_for, _goals = ddp.configs_for, ddp.goals
    ddp.configs_for = configs_for
    ddp.goals = lambda results, hosts: _goals(results, hosts) + paired(results)
    ddp.DDP_ROWS += tuple(r + suffix for r in ddp.DDP_ROWS if r.startswith("commlib"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--off", choices=sorted(SWITCHES), default="idle")
    known, rest = ap.parse_known_args()
    install(known.off)
    sys.exit(ddp.main(rest))
