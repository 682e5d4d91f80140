"""Everything a group needs besides its engine, built once, in one place, when the group is created.

:func:`build` is collective over the group's engine (every member creates the group at the same
point) and runs, in this order:

1. one all-gather of every rank's facts (:class:`~commlib.transports.GroupFacts`: its host, whether
   commlib's C extension loaded, how many CUDA devices it sees), from which the host layout
   (:class:`~commlib.topology.host.HostLayout`) follows;
2. every registered transport's ``attach`` (shared memory, CUDA IPC), each attached or saying why
   not, the same on every rank;
3. the agreed cost model: rank 0 builds it (:func:`commlib.tuning.selector.local_model`, from the
   tuning file or defaults and a probe) and broadcasts it.

The result, :class:`Resources`, is what algorithms receive as ``ctx.res`` and what selection
reads; nothing is set on the engine object. Algorithms that build more per-group state on first
use (collectively, at the same call on every rank: the hierarchical all-reduce's
sub-communicators) keep it in ``Resources.state``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ..topology.host import HostLayout, host_hash
from ..transports import GroupFacts, Transport, transports
from ..transports import shm as _shm
from ..tuning.selector import GroupModel, local_model, model_from_bytes, model_to_bytes

__all__ = ["Resources", "build"]

log = logging.getLogger("commlib")


@dataclass(eq=False)
class Resources:
    """A group's resources. ``engine``: its communicator (None on ranks outside the group).
    ``layout``: which of its ranks share a host. ``transports``: the attached transports by
    name, and ``why_not``: why each other one is not. ``model``: the agreed cost model (None for
    one rank). ``broken``: why the group cannot run operations any more (finalized, an earlier
    timeout), else None. ``inflight``: the blocking operation running in C or the engine, for the
    watchdog. ``state``: what algorithms build for this group on first use. ``choices``:
    selection's memo for this group."""

    name: str
    engine: Any = None
    layout: HostLayout | None = None
    transports: dict[str, Transport] = field(default_factory=dict)
    why_not: dict[str, str] = field(default_factory=dict)
    model: GroupModel | None = None
    inflight: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    #: the algorithms selection chose for this group's calls (commlib.tuning.select's memo)
    choices: dict[tuple, Any] = field(default_factory=dict)
    #: the shared-memory segment (``transports["shm"].segment``), read on every shm call
    shm: Any = None

    def close(self) -> None:
        """Release every transport (``commlib.finalize``)."""
        for transport in self.transports.values():
            transport.close()
        self.transports, self.shm = {}, None


def _cuda_devices() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as none
        return 0


def _facts(engine) -> GroupFacts:
    rows = engine.all_gather_ints([host_hash(), int(_shm.available()), _cuda_devices()])
    return GroupFacts(*(tuple(col) for col in zip(*rows)))


def _agree_model(engine, layout: HostLayout) -> GroupModel:
    """Collective: rank 0's model, broadcast (for engines that move CPU memory; the GPU table is
    the same on every rank without communicating)."""
    if "cpu" not in engine.devices:
        return local_model(engine, layout)
    length = torch.zeros(1, dtype=torch.int64)
    payload = b""
    if engine.rank == 0:
        payload = model_to_bytes(local_model(engine, layout))
        length[0] = len(payload)
    engine.wait([engine.broadcast(length, 0, True)])
    buf = torch.zeros(int(length[0]), dtype=torch.uint8)
    if engine.rank == 0:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    engine.wait([engine.broadcast(buf, 0, True)])
    return model_from_bytes(payload if engine.rank == 0 else bytes(buf.tolist()), engine.devices)


def build(engine, name: str) -> Resources:
    """Collective over ``engine``: the resources of group ``name`` (see the module docstring).
    ``engine`` None (this rank is not a member): empty resources, no communication."""
    res = Resources(name, engine)
    if engine is None:
        return res
    if engine.size < 2:
        res.layout = HostLayout(((0,),))
        res.why_not = {t: "one rank" for t in transports()}
        return res
    facts = _facts(engine)
    res.layout = HostLayout.from_hashes(facts.hosts)
    for tname, cls in transports().items():
        attached = cls.attach(engine, name, facts)
        if isinstance(attached, str):
            res.why_not[tname] = attached
            log.info("group %s: no %s transport: %s", name, tname, attached)
        else:
            res.transports[tname] = attached
    shm = res.transports.get("shm")
    res.shm = shm.segment if shm is not None else None
    res.model = _agree_model(engine, res.layout)
    return res
