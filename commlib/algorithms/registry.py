"""The algorithm registry: one record per (algorithm, collective), written in the algorithm's own file.

An algorithm is a generator function ``run(ctx, *buffers)`` that posts non-blocking operations on
``ctx.backend`` (or a transport of ``ctx.res``) and yields the list of handles it needs completed
before its next step (an algorithm that completes in one step may instead be a plain function
returning that list). Buffers are contiguous torch tensors of any shape (algorithms that slice
them call ``buf.view(-1)`` first); reductions already run in the accumulation dtype (bool arrives
as uint8) unless the record says it reduces natively. Signatures per collective::

    all_reduce(ctx, buf)                        in place
    broadcast(ctx, buf, root)                   root's buf to every rank
    reduce(ctx, buf, root)                      result in root's buf; others' buf unchanged
    all_gather(ctx, out, inp)                   out = size blocks of inp.numel(), block i from rank i
    reduce_scatter(ctx, out, inp)               inp = size blocks of out.numel(); rank i gets block i
    all_to_all(ctx, out, inp, out_counts, in_counts)
    barrier(ctx)

Everything the rest of commlib knows about an algorithm is its :class:`Algorithm` record, built by
:func:`register_algorithm` next to the generator: the cost the selector prices it with, when it
is eligible, and what the API layer may skip for it. Adding one is one new file::

    @register_algorithm("pairwise", "all_reduce", cost=lambda p, n, link: ...)
    def all_reduce(ctx, buf):
        ...

imported once (``commlib.algorithms`` imports the built-in modules; a user's module registers
when it is imported). docs/architecture.md walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from .. import config
from ..ops import ReduceOp

__all__ = ["Ctx", "Call", "Algorithm", "register_algorithm", "unregister_algorithm",
           "get_algorithm", "algorithm_names", "records", "COLLECTIVES", "chunk_bounds", "version"]

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "barrier")


class Ctx(NamedTuple):
    """What an algorithm needs: the communicator, its rank and size, the message tag of this
    call (unique per call on the group), the reduction op, whether the call may block in the
    engine (a blocking call under ``COMMLIB_TIMEOUT_MODE=abort``; engines' native collectives
    then run as their blocking variant, guarded by the watchdog), and the group's resources
    (:class:`commlib.runtime.resources.Resources`: transports, host layout), None for a bare
    communicator."""

    backend: Any
    rank: int
    size: int
    tag: int
    op: ReduceOp | None
    blocking: bool = False
    res: Any = None

    def isend(self, buf: torch.Tensor, peer: int):
        return self.backend.isend(buf, peer, self.tag)

    def irecv(self, buf: torch.Tensor, peer: int):
        return self.backend.irecv(buf, peer, self.tag)


class Call(NamedTuple):
    """What selection knows of one call: the collective, the bytes its cost is priced on, and for
    eligibility the tensor's device type, dtype and reduction op (None where not a reduction)."""

    collective: str
    nbytes: int
    device: str = "cpu"
    dtype: torch.dtype | None = None
    op: ReduceOp | None = None


CostFn = Callable[[int, float, Any], float]  # (ranks, nbytes, link) -> seconds
HierCostFn = Callable[..., float]  # (ranks, ranks per host, nbytes, intra, inter, flat costs)
EligibleFn = Callable[[Any, Call], "str | None"]  # (resources, call) -> None, or why not


@dataclass(frozen=True, eq=False)
class Algorithm:
    """One algorithm of one collective.

    ``run``: the generator function (see the module docstring). ``cost``: ``(p, nbytes, link) ->
    seconds`` on ``p`` ranks of one link class (``link.step(m)`` is one point-to-point step of
    ``m`` bytes, ``link.gamma`` the seconds per byte reduced, ``link.alpha``/``link.beta`` the line);
    None where the algorithm is priced only by a measured curve (``native``). ``cost_two_level``:
    ``(p, local, nbytes, intra, inter, flat)`` for algorithms that run in stages on the intra-host
    and the inter-host links (``flat``: the single-level costs of the collective, by name); priced
    only on groups that span hosts. ``transport``: the transport it runs on (``"shm"``,
    ``"cuda_ipc"``), priced on that transport's link class and eligible only where the group has
    it attached. ``devices``: the tensor device types it runs on. ``eligible``: a further rule
    over (resources, call), returning None or why not. Flags, each ``fn(res, tensor...)`` or None:
    ``prepare(res, out, inp, op, blocking)`` pre-binds a repeated blocking call (commlib's plan
    cache), ``reduces_natively(res, t)`` says it reduces ``t``'s dtype and AVG itself (no upcast,
    no division by the API), ``gathers_in_place(res, out)`` says an all-gather input that is this
    rank's block of ``out`` needs no copy. ``prices_native``: the engines' own collectives run
    this textbook algorithm (or better), so without a measured curve ``native`` is priced as the
    cheapest of these. ``shares_host_link``: every rank steps with a partner at a distance at the
    same time (recursive doubling and halving), so on a group spanning hosts, whose ranks are
    placed host by host, all the ranks of a host cross to other hosts at once at the far
    distances: priced on the hosts' link shared by their ranks (``Table.shard_inter``), not one
    rank's (the ring crosses once per host and step)."""

    name: str
    collective: str
    run: Callable
    cost: CostFn | None = None
    cost_two_level: HierCostFn | None = None
    transport: str | None = None
    devices: frozenset = frozenset({"cpu"})
    eligible: EligibleFn | None = None
    prepare: Callable | None = None
    reduces_natively: Callable | None = None
    gathers_in_place: Callable | None = None
    prices_native: bool = False
    shares_host_link: bool = False

    def __call__(self, ctx, *buffers):
        return self.run(ctx, *buffers)

    def why_not(self, res, call: Call) -> str | None:
        """None when this algorithm can run ``call`` on a group with resources ``res``, else
        why not (said by ``explain`` and the log)."""
        if call.device not in self.devices:
            return f"runs on {'/'.join(sorted(self.devices))} tensors, not {call.device}"
        if self.transport is not None:
            attached = res.transports.get(self.transport) if res is not None else None
            if attached is None:
                why = res.why_not.get(self.transport) if res is not None else None
                return f"no {self.transport} transport ({why or 'not attached'})"
        if self.cost_two_level is not None and (res is None or not res.layout.spans_hosts):
            return "the group does not span hosts with several ranks on one"
        if self.eligible is not None:
            return self.eligible(res, call)
        return None


_REGISTRY: dict[str, dict[str, Algorithm]] = {c: {} for c in COLLECTIVES}
_version = 0  # bumped on every change, so memoized choices are made again


def register_algorithm(name: str, *collectives: str, **record):
    """Decorator: register ``fn`` as algorithm ``name`` of each of ``collectives``, with the
    record's other fields (:class:`Algorithm`) as keywords. Returns ``fn`` unchanged."""
    def deco(fn):
        global _version
        for c in collectives:
            if c not in _REGISTRY:
                raise ValueError(f"unknown collective {c!r}; one of {COLLECTIVES}")
            _REGISTRY[c][name] = Algorithm(name, c, fn, **record)
        _version += 1
        return fn

    return deco


def unregister_algorithm(name: str, *collectives: str) -> None:
    """Remove algorithm ``name`` from ``collectives`` (default: every collective)."""
    global _version
    for c in collectives or COLLECTIVES:
        _REGISTRY[c].pop(name, None)
    _version += 1


def version() -> int:
    """A number that changes whenever the registry does."""
    return _version


def get_algorithm(collective: str, name: str) -> Algorithm | None:
    return _REGISTRY[collective].get(name)


def algorithm_names(collective: str) -> list[str]:
    return sorted(_REGISTRY[collective])


def records(collective: str) -> list[Algorithm]:
    """Every algorithm of ``collective``, by name."""
    reg = _REGISTRY[collective]
    return [reg[n] for n in sorted(reg)]


config.register_choices("algo", lambda: [a for c in COLLECTIVES for a in _REGISTRY[c]])


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Boundaries splitting ``n`` elements into ``parts`` contiguous chunks whose sizes differ by
    at most one (the first ``n % parts`` chunks are one longer). Length ``parts + 1``."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds
