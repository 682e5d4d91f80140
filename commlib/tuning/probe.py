"""In-job calibration: what a group measures about itself when the tuning file has no entry for
its shape, and how the measurements become its model. Pure: no communication, no clock (the
driver that times the calls is :mod:`commlib.api.autotune`).

A group of ``p`` ranks on ``hosts`` hosts whose engine has no entry ``<engine>/<p>[@hosts]`` in the
tuning file would otherwise be priced from the nearest measured size's link costs: a model that
knows neither this group's algorithms' curves nor that its ranks share cores (4 ranks on 2
cores wait for a descheduled peer at every synchronisation step; the nearest entry, 2 ranks,
never did). So at group creation the group times its all-reduce algorithms itself, every
eligible one at :data:`SIZES`, interleaved in :data:`ROUNDS` rounds, each loop about
:data:`LOOP_SECONDS` (at least one call, after an untimed one), every time the slowest rank's.
From the measurements, an entry of the tuning file like ``bench/calibrate.py``'s (saved, so the
next job of this shape starts from it):

* ``curves["all_reduce"]``: one measured curve per algorithm (the model prices all-reduce from
  them as it prices calibrated ones);
* the step link ``link``: α and β of one point-to-point step as this group's ranks see it busy
  and sharing cores, from the ring's curve (its formula is exact: ``2(p-1)`` steps;
  :func:`ring_link`), so the formulas of the other collectives pay the oversubscribed step;
* ``probe``: how it was measured (sizes, seconds, ranks per core), which ``explain`` prints.

One probe can fall in one of the host's slow phases (on the shared virtual machines here, minutes
in which traffic between cores runs 3-4x slower, the shared-memory algorithms' more than the
engine's: a 16 MiB all-reduce on 4 ranks measured 13.5 ms for the two-shot and 11 ms for MPI's in
one, 4.4 and 12.7 ms outside it). So an entry is probed again by the next jobs of its shape until
:data:`RUNS` probes are merged, each point the minimum over them (:func:`merge`): noise on a
shared host only ever adds time.

An algorithm already more than :data:`DROP_FACTOR` times slower than the best at a size in the
bandwidth regime (from :data:`DROP_FROM` bytes) is not timed at larger sizes (its curve is then
extrapolated along its last two points), and once the probe has spent its budget
(``COMMLIB_AUTOTUNE`` seconds, 1 by default) the larger sizes are left to extrapolation.
"""

from __future__ import annotations

from .model import LinkCost

__all__ = ["SIZES", "ROUNDS", "LOOP_SECONDS", "DROP_FACTOR", "DROP_FROM", "RUNS", "repetitions",
           "still_racing", "merge", "ring_link", "describe"]

#: All-reduce sizes timed (bytes of float32): the latency regime, the crossovers, the bandwidth
#: regime. Curves interpolate between them in log-log space and extrapolate past 16 MiB.
SIZES = (8, 1 << 10, 1 << 15, 1 << 18, 1 << 21, 1 << 24)
ROUNDS = 3
LOOP_SECONDS = 8e-3
DROP_FACTOR = 3.0
DROP_FROM = 1 << 18
RUNS = 3


def repetitions(first: float, loop: float = LOOP_SECONDS, cap: int = 64) -> int:
    """Calls per timed loop for a call that took ``first`` seconds (the slowest rank's, so every
    rank agrees): about ``loop`` seconds, at least one call, at most ``cap``."""
    if first <= 0:
        return cap
    return max(1, min(cap, int(loop / first)))


def still_racing(times: dict[str, float], nbytes: int) -> list[str]:
    """The algorithms worth timing at larger sizes after ``times`` (name -> seconds) at
    ``nbytes``: all of them below :data:`DROP_FROM`, else those within :data:`DROP_FACTOR` of
    the fastest (in the bandwidth regime the ratios between algorithms only grow with size)."""
    if nbytes < DROP_FROM or not times:
        return sorted(times)
    best = min(times.values())
    return sorted(a for a, t in times.items() if t <= DROP_FACTOR * best)


def merge(previous: dict[str, dict[int, float]], new: dict[str, dict[int, float]]
          ) -> dict[str, dict[int, float]]:
    """Two probes' points ({algorithm: {nbytes: seconds}}) as one: at every (algorithm, size)
    either timed, the lower time."""
    out = {a: dict(pts) for a, pts in previous.items()}
    for a, pts in new.items():
        mine = out.setdefault(a, {})
        for n, t in pts.items():
            mine[n] = min(t, mine.get(n, t))
    return out


def ring_link(ring: dict[int, float], p: int, base: LinkCost) -> LinkCost | None:
    """The step link as the ring measured it: ``t(n) = 2(p-1)·α + 2(p-1)/p·n·β + (p-1)/p·n·γ``
    (``ring``: its times by size), α from the smallest size and β from the largest, γ from
    ``base`` (the reduce kernel's rate, not a link's; ``base`` is the group's agreed model, so
    every rank computes the same link). None without two sizes. Where the largest size leaves
    nothing per byte (all latency), β is ``base``'s."""
    if len(ring) < 2 or p < 2:
        return None
    small, large = min(ring), max(ring)
    steps = 2 * (p - 1)
    alpha = ring[small] / steps
    per_byte = ring[large] - steps * alpha - (p - 1) / p * large * base.gamma
    beta = per_byte / (steps / p * large) if per_byte > 0 else base.beta
    return LinkCost(alpha, beta, base.gamma, None, base.busy)


def describe(ranks_here: int, cores: int, points: dict[str, dict[int, float]],
             seconds: float, link: LinkCost | None, runs: int = 1) -> str:
    """The model source's words for a probed entry (``explain`` prints them)."""
    sizes = sorted({n for pts in points.values() for n in pts})
    share = ranks_here / cores if cores else float("nan")
    jobs = "the job" if runs == 1 else f"{runs} jobs (the minimum of their probes)"
    text = (f"probed in {jobs}: all_reduce of {len(points)} algorithms at {len(sizes)} sizes "
            f"({sizes[0] if sizes else 0} B to {(sizes[-1] if sizes else 0) >> 10} KiB) in "
            f"{seconds:.2f} s; {ranks_here} ranks on {cores} cores of this host "
            f"({share:.1f} per core)")
    if link is not None:
        text += f"; one step as measured by the ring: α {link.alpha * 1e6:.1f} us"
    return text
