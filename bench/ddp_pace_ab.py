"""The remote progress thread's idle-caller pace, on and off in one run of bench/ddp.py.

    vcluster mpirun -n 2 -ppn 1 -- python bench/ddp_pace_ab.py --models transformer \\
        --rounds 15 --bucket-view --rows commlib,commlib-tuned-avg

bench/ddp.py with one more row per commlib row asked for: ``<row>-noidle``, the same DDP
configuration whose steps run with the idle signal off (``commlib.runtime.progress.IDLE_SHARE``
-1: the fast pace only in the 10 ms after an operation is issued or advances, as before
2026-11-29). Both run in the same rounds, so the host's phases fall on both alike; the last lines
give, per pair, the median over rounds of each round's ``noidle / idle`` step time and the rounds
the idle signal won. Every option is bench/ddp.py's.
"""

from __future__ import annotations

import statistics
import sys

import commlib.runtime.progress as progress
import ddp

SUFFIX = "-noidle"


class NoIdle(ddp.Config):
    """A configuration whose steps run with the idle-caller signal off."""

    def step(self) -> None:
        on, progress.IDLE_SHARE = progress.IDLE_SHARE, -1.0
        try:
            super().step()
        finally:
            progress.IDLE_SHARE = on


def configs_for(model, gloo, bucket_view=False, rows=ddp.DDP_ROWS):
    cfgs, note = _configs_for(model, gloo, bucket_view, rows)
    twins = [NoIdle(c.name + SUFFIX, model, bucket_cap_mb=c.bucket_cap_mb,
                    bucket_view=c.bucket_view, hook=c.hook)
             for c in cfgs if c.name.startswith("commlib")]
    return cfgs + twins, note


def paired(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        rows = {x["config"]: x["rounds_s"] for x in r["rows"]}
        for name, off in rows.items():
            on = rows.get(name.removesuffix(SUFFIX)) if name.endswith(SUFFIX) else None
            if on:
                ratios = [b / a for a, b in zip(on, off)]
                lines.append(f"# {r['model']} {name.removesuffix(SUFFIX)}: noidle/idle median "
                             f"{statistics.median(ratios):.3f}, idle faster in "
                             f"{sum(x > 1 for x in ratios)} of {len(ratios)} rounds")
    return lines


_configs_for, _goals = ddp.configs_for, ddp.goals
ddp.configs_for = configs_for
ddp.goals = lambda results, hosts: _goals(results, hosts) + paired(results)
ddp.DDP_ROWS += tuple(r + SUFFIX for r in ddp.DDP_ROWS if r.startswith("commlib"))

if __name__ == "__main__":
    sys.exit(ddp.main())
