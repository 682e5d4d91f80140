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
shared host only ever adds time. And the job that probed does not keep a slow-phase probe for its
whole length: at the times of ``COMMLIB_AUTOTUNE_RECHECK`` (5, 60 and 240 s after the probe by
default) it times again, size by size, the algorithms the choice is between (:func:`check_plan`;
the latency-bound sizes in rounds, as the probe, the others in one short loop), and where one of
them now runs :data:`STALE_FACTOR` times faster than the probes measured (:func:`stale`: a probe
fell in a slow phase, the check did not; where the probes never reached the largest size,
:func:`cut_short`, every algorithm they timed is re-timed) it probes again and merges. A check
that falls in a slow phase itself only finds everything slower, and leaves the model as it is.
The checks ride on the group's all-reduce calls, one agreement of the clock every
:data:`CHECK_UNITS` units (:func:`units`: a call, plus one per 64 KiB), so they cost the job at
most a few tenths of a percent and every rank runs them at the same call.

An algorithm already more than :data:`DROP_FACTOR` times slower than the best at a size in the
bandwidth regime (from :data:`DROP_FROM` bytes) is not timed at larger sizes (its curve is then
extrapolated along its last two points), and once the probe has spent its budget
(``COMMLIB_AUTOTUNE`` seconds, 1 by default) the larger sizes are left to extrapolation.
"""

from __future__ import annotations

from .model import LinkCost

__all__ = ["SIZES", "ROUNDS", "LOOP_SECONDS", "DROP_FACTOR", "DROP_FROM", "RUNS", "STALE_FACTOR",
           "CHECK_UNITS", "NET_SIZES", "NET_REPS", "repetitions", "still_racing", "merge",
           "ring_link", "net_link", "describe", "describe_net", "sizes_of", "check_plan",
           "cut_short", "stale", "units"]

#: All-reduce sizes timed (bytes of float32): the latency regime, the crossovers, the bandwidth
#: regime. Curves interpolate between them in log-log space and extrapolate past 16 MiB.
SIZES = (8, 1 << 10, 1 << 15, 1 << 18, 1 << 21, 1 << 24)
ROUNDS = 3
LOOP_SECONDS = 8e-3
DROP_FACTOR = 3.0
DROP_FROM = 1 << 18
RUNS = 3
#: A re-timed algorithm this many times faster than the model's curve: the probe was slowed.
#: Two timings of one algorithm in a quiet phase differ by 10-15 % here; slow phases, 3-8x.
STALE_FACTOR = 1.35
CHECK_UNITS = 1024
UNIT_BYTES = 1 << 16
#: The link between hosts, where the tuning file has none measured: a ping-pong between the
#: first ranks of two hosts at these sizes (one latency-bound, one where 1 Gb/s Ethernet is
#: 99% bandwidth and a 100 Gb/s NIC still 80%), NET_REPS round trips each (the fastest counts)
#: after an untimed one. Many of the small size: one round trip of it is under 0.1 ms, and on a
#: crowded host the fastest of 3 read 3x the latency (CI, 2026-11-29); 4 round trips of 1 MiB
#: take about 70 ms at 1 Gb/s, under 2 ms at 100 Gb/s.
NET_SIZES = (1 << 12, 1 << 20)
NET_REPS = (16, 3)


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


def net_link(one_way: dict[int, float], base: LinkCost) -> LinkCost | None:
    """The link between hosts from a ping-pong's one-way times ``{nbytes: seconds}`` (the
    fastest round trip at each size, halved): α the smallest size's time (latency-bound: a
    rate-limited link lets a small message through at its burst rate, so a line through both
    sizes can cross zero), β the slope from it to the largest; γ and ``busy`` from ``base``
    (the group's agreed model: the reduction runs on the hosts' cores, whatever the link).
    None without two sizes, or where the time does not grow with the size (nothing per byte
    measured: the defaults stay)."""
    if len(one_way) < 2:
        return None
    small, large = min(one_way), max(one_way)
    beta = (one_way[large] - one_way[small]) / (large - small)
    if beta <= 0:
        return None
    return LinkCost(one_way[small], beta, base.gamma, None, base.busy)


def describe_net(link: LinkCost) -> str:
    """The model source's words for a link between hosts probed in the job."""
    return (f"link between hosts probed in the job (ping-pong of {NET_SIZES[0]} B to "
            f"{NET_SIZES[-1] >> 10} KiB): α {link.alpha * 1e6:.1f} us, "
            f"{8 / link.beta / 1e9:.2f} Gb/s")


def sizes_of(points: dict[str, dict[int, float]]) -> list[int]:
    """Every size at which ``points`` ({algorithm: {nbytes: seconds}}) timed some algorithm, in
    order."""
    return sorted({n for pts in points.values() for n in pts})


def describe(ranks_here: int, cores: int, points: dict[str, dict[int, float]],
             seconds: float, link: LinkCost | None, runs: int = 1) -> str:
    """The model source's words for a probed entry (``explain`` prints them)."""
    sizes = sizes_of(points)
    share = ranks_here / cores if cores else float("nan")
    times = "in the job" if runs == 1 else f"{runs} times (the minimum of the probes)"
    text = (f"probed {times}: all_reduce of {len(points)} algorithms at {len(sizes)} sizes "
            f"({sizes[0] if sizes else 0} B to {(sizes[-1] if sizes else 0) >> 10} KiB) in "
            f"{seconds:.2f} s; {ranks_here} ranks on {cores} cores of this host "
            f"({share:.1f} per core)")
    if link is not None:
        text += f"; one step as measured by the ring: α {link.alpha * 1e6:.1f} us"
    return text


def units(nbytes: int) -> int:
    """What an all-reduce of ``nbytes`` counts toward the next check of the clock: 1 per call and
    1 per 64 KiB (8-byte calls check every 1024 calls, 64 MiB ones every call: one 8-byte
    agreement against a call of at least a few milliseconds either way)."""
    return 1 + nbytes // UNIT_BYTES


def check_plan(points: dict[str, dict[int, float]], every: bool = False
               ) -> list[tuple[int, list[str]]]:
    """What a check re-times: at every probed size where at least two algorithms were timed,
    those within :data:`DROP_FACTOR` of the fastest there (the ones the choice is between; with
    ``every``, all of them), in order of size. A probe can be slowed in any part of it: one
    slowed at 16 MiB only (the two-shot's point 3x too high, MPI's right) chose MPI's there and
    was right at 2 MiB. ``every`` is for probes :func:`cut_short`: on a crowded host the
    shared-memory algorithms, which keep their cores, were slowed less than the others."""
    plan = []
    for n in sizes_of(points):
        times = {a: pts[n] for a, pts in points.items() if n in pts}
        if len(times) < 2:
            continue
        best = min(times.values())
        plan.append((n, sorted(a for a, t in times.items() if every or t <= DROP_FACTOR * best)))
    return plan


def cut_short(points: dict[str, dict[int, float]]) -> bool:
    """The probes stopped before the largest of :data:`SIZES` (their budget ran out: on a crowded
    host one probe timed only 8 B in its second), so the model prices the larger sizes by formula
    and extrapolation: a check that finds the host faster now probes again."""
    return max(sizes_of(points), default=0) < SIZES[-1]


def stale(points: dict[str, dict[int, float]], now: dict[str, float], nbytes: int,
          factor: float = STALE_FACTOR) -> list[str]:
    """The algorithms whose re-timed ``now`` (name -> seconds at ``nbytes``) is ``factor`` times
    faster than ``points`` (the model's {algorithm: {nbytes: seconds}}) has them: where any is,
    the probe ran slowed and is worth doing again."""
    return sorted(a for a, t in now.items()
                  if nbytes in points.get(a, {}) and t * factor < points[a][nbytes])
