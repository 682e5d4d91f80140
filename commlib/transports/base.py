"""The interface of a transport: a data plane a group uses beside its engine (shared memory for
CPU ranks of one host, CUDA IPC for GPUs of one host), registered by name.

A transport attaches to a group when the group is created: :meth:`Transport.attach` is collective
over the group's engine and returns the attached transport, or a string saying why the group
does not qualify (the same answer on every rank). Algorithms that run on a transport name it in
their record (``transport="shm"``) and find it in their context's resources; the selector offers
them only where it is attached. ``buffers`` are the memory it offers the group's collectives.

Adding one is a new module with a ``Transport`` subclass decorated by
``@register_transport("name")``, and its import in ``commlib/transports/__init__.py``.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from .. import config

__all__ = ["Transport", "GroupFacts", "register_transport", "transports", "refusal"]


class GroupFacts(NamedTuple):
    """What every rank of a group published when the group was created (one all-gather, by the
    runtime), the same on every rank: per rank, its host's identity, whether commlib's C
    extension loaded there, and how many CUDA devices it sees."""

    hosts: tuple[int, ...]
    shm_ext: tuple[bool, ...]
    cuda_devices: tuple[int, ...]

    @property
    def one_host(self) -> bool:
        return len(set(self.hosts)) == 1

    @property
    def host_count(self) -> int:
        return len(set(self.hosts))


class Transport:
    """A data plane attached to one group."""

    name: ClassVar[str] = "?"

    @classmethod
    def attach(cls, engine, group_name: str, facts: GroupFacts) -> "Transport | str":
        """Collective over ``engine`` (every rank of the group calls it at group creation): the
        attached transport, or why not."""
        raise NotImplementedError

    @property
    def buffers(self) -> Any:
        """The memory this transport offers the group (for example, shared-memory regions)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what ``attach`` acquired (``commlib.finalize``)."""


def refusal(engine, device: str, option: str) -> str | None:
    """Why no transport for ``device`` memory can attach to a group on ``engine`` whatever the
    facts (one rank, an engine that moves no such memory, switched off by ``option``), or None."""
    if engine.size < 2:
        return "one rank"
    if device not in engine.devices:
        return f"the {engine.name} engine moves no {device.upper()} memory"
    if not config.get(option):
        return f"COMMLIB_{option.upper()}=0"
    return None


_REGISTRY: dict[str, type[Transport]] = {}


def register_transport(name: str):
    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def transports() -> dict[str, type[Transport]]:
    """Every registered transport, by name, in the order they attach."""
    return dict(_REGISTRY)
