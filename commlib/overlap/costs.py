"""What the planner reads of a group: the cost of one point-to-point step on its link (from the
group's agreed cost model) and how fast it multiplies matrices (agreed once per group, dtype and
device type).

The matmul rate is measured, so ranks would measure different numbers, and plans made from
different numbers would cut blocks differently and never match their messages. So rank 0's
measurement is the group's: the first collective matmul of a dtype on a group (collective, like
every call) broadcasts it, and every later call reads the cached value. :func:`known_rate`, for
:func:`commlib.overlap.explain` and the ``plan_*`` functions, never communicates: before the
group has agreed it uses this rank's own measurement, and says so.
"""

from __future__ import annotations

import time
import weakref

import torch

import commlib

from ..tuning import explain_call
from ..tuning.model import DEFAULT_LINKS, LinkCost
from .plan import MatmulRate

__all__ = ["p2p_link", "plain_seconds", "shares_cores", "agree", "agreed_so_far",
           "agreed_rate", "known_rate", "measure",
           "MEASURE_N", "PIECE_OVERHEAD_S"]

# Square operands of the rate measurement (2·N³ flops: 14 MFLOP, ~0.3 ms in float32 on one
# core), and of the call-cost measurement (a matmul that costs nothing but its call).
MEASURE_N, TINY_N = 192, 4

# The executor's own work per piece besides the matmul call: the views, a test of the pending
# receives, a message posted: a few µs of Python (an estimate; the message's own cost is the
# link's α).
PIECE_OVERHEAD_S = 4e-6

_LOCAL: dict = {}  # (device, dtype) -> (flops/s, call s): this process's measurements
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> {key: (values, source)}


def p2p_link(group, device: str) -> tuple[LinkCost, str]:
    """The cost of one point-to-point step between neighbours of ``group`` for tensors on
    ``device`` (``"cpu"``/``"cuda"``): the flat link of the group's agreed model (the inter-host
    one when the group spans hosts: a ring's step ends with its slowest hop), and where it comes
    from."""
    model = group.model
    table = None if model is None else model.table_for(device)
    if table is None:
        return DEFAULT_LINKS["shm"], "no cost model for this engine: commlib's default shm step"
    spans = table.inter is not None and table.local is not None and table.local < group.size
    return table.flat_link(group.size), f"{'inter-host' if spans else 'p2p'} step, {model.source}"


def plain_seconds(group, collective: str, nbytes: int, dtype: torch.dtype, device: str,
                  link: LinkCost) -> tuple[float, str]:
    """The predicted time of the plain collective (``"all_gather"`` of ``nbytes`` out, or
    ``"reduce_scatter"`` of ``nbytes`` in) on ``group``: the algorithm commlib's selection would
    run and the model's time for it; without a model, a ring of the flat link."""
    exp = explain_call(collective, nbytes, group, dtype, device)
    for row in exp.rows:
        if row.algorithm == exp.chosen:
            return row.seconds, f"{collective} {exp.chosen}, {exp.source}"
    p = group.size
    return (p - 1) * link.step(nbytes / p), f"{collective} as a ring of the flat link"


def shares_cores(group, device: str) -> bool:
    """Whether communication on ``group`` is copying by the cores that also compute: CPU tensors
    on a group whose ranks share one host (shared memory, or the engine's own). There nothing is
    hidden: a piece's transfer and a piece's matmul take turns on the same cores."""
    layout = getattr(group.resources, "layout", None)
    return device == "cpu" and layout is not None and len(layout.hosts) == 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device: torch.device, repeat: int = 3) -> float:
    fn()  # warm-up: first-call allocation and dispatch
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[float, float]:
    """This process's matmul rate for ``dtype`` on ``device``: (flops per second on
    ``MEASURE_N``-square operands, seconds of one call including :data:`PIECE_OVERHEAD_S`).
    Measured once per process (about a millisecond), best of three."""
    device = torch.device(device)
    key = (str(device), dtype)
    hit = _LOCAL.get(key)
    if hit is None:
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randn(MEASURE_N, MEASURE_N, generator=g).to(device=device, dtype=dtype)
                for _ in range(2))
        tx, ty = x[:TINY_N, :TINY_N].contiguous(), y[:TINY_N, :TINY_N].contiguous()
        out, tiny_out = torch.empty_like(x), torch.empty_like(tx)
        call = _best(lambda: torch.matmul(tx, ty, out=tiny_out), device)
        big = _best(lambda: torch.matmul(x, y, out=out), device)
        flops = 2.0 * MEASURE_N ** 3
        hit = _LOCAL[key] = (flops / max(big - call, 1e-9), call + PIECE_OVERHEAD_S)
    return hit


def agree(group, key, measure, n: int) -> tuple[tuple[float, ...], str]:
    """Rank 0's ``measure()`` (``n`` floats) as the group's, and where it comes from: collective
    the first time per (group, key), every rank calls; cached after. Every measured number a plan
    or a choice reads goes through here, so that every rank makes the same plan or choice."""
    agreed = _AGREED.setdefault(group, {})
    hit = agreed.get(key)
    if hit is None:
        if group.size == 1:
            hit = (tuple(measure()), "measured, one rank")
        else:
            t = torch.tensor(measure() if group.rank == 0 else (0.0,) * n, dtype=torch.float64)
            commlib.broadcast(t, group=group, group_src=0)
            hit = (tuple(t.tolist()), "rank 0's measurement, agreed")
        agreed[key] = hit
    return hit


def agreed_so_far(group, key) -> tuple[tuple[float, ...], str] | None:
    """What :func:`agree` cached for (group, key), or None (never communicates)."""
    return _AGREED.get(group, {}).get(key)


def agreed_rate(group, dtype: torch.dtype, device: torch.device) -> MatmulRate:
    """The group's matmul rate for ``dtype`` on ``device``'s type. Collective the first time per
    (group, device type, dtype): rank 0 measures and broadcasts; cached after."""
    (flops, call), source = agree(group, ("matmul", torch.device(device).type, dtype),
                                  lambda: measure(dtype, device), 2)
    return MatmulRate(flops, call, source)


def known_rate(group, dtype: torch.dtype, device: torch.device) -> MatmulRate:
    """The agreed rate if the group has one for ``dtype``, else this rank's measurement (local:
    never communicates)."""
    hit = agreed_so_far(group, ("matmul", torch.device(device).type, dtype))
    if hit is not None:
        return MatmulRate(*hit[0], hit[1])
    flops, call = measure(dtype, device)
    return MatmulRate(flops, call, "this rank's measurement; the group agrees rank 0's at its "
                                   "first collective matmul of this dtype")
