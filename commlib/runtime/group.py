"""Groups and the process's commlib state (the world group, every group created, the timeout
mode). The public functions that create and release them are in :mod:`commlib.api.groups`."""

from __future__ import annotations

from typing import Sequence

from ..engines.base import Backend
from . import resources as _resources
from .mismatch import shm_hook

__all__ = ["Group", "state"]


class Group:
    """A set of ranks that run collectives together.

    ``ranks`` are world ranks in group order; ``rank`` is this process's rank in the group (-1 when
    it is not a member). Groups are created collectively by :func:`new_group` and :class:`Mesh`.
    """

    def __init__(self, backend: Backend | None, ranks: Sequence[int], name: str, timeout, debug):
        self.backend = backend
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = backend.rank if backend is not None else -1
        self.name = name
        self.timeout = timeout
        self.debug = debug
        # Blocking calls may block in the engine (fastest) when nothing has to interrupt them:
        # no timeout, or timeouts handled by the watchdog (COMMLIB_TIMEOUT_MODE=abort).
        self.blocking = timeout is None or state.timeout_mode == "abort"
        self.seq = 0
        #: why the group cannot run operations any more (finalized, an earlier timeout), or None
        self.broken: str | None = None
        #: called as ``on_all_reduce(group, nbytes)`` by every ``all_reduce`` on the group before
        #: it starts, on every member at the same call (the in-job re-check of a probed model,
        #: commlib/api/autotune.py), or None
        self.on_all_reduce = None
        self._index = {r: i for i, r in enumerate(self.ranks)}
        # Everything the group needs besides its engine: host layout, transports (shared memory,
        # CUDA IPC), the agreed cost model. Collective: every member constructs the group at the
        # same point. See commlib/runtime/resources.py.
        self.resources = _resources.build(backend, name)
        if self.resources.shm is not None:  # ranks that disagree raise on every rank, always
            self.resources.shm.on_mismatch = shm_hook(self)

    @property
    def shm(self):
        """The group's shared-memory segment (a ``commlib.transports._shm.Segment``), or None."""
        return self.resources.shm

    @property
    def model(self):
        """The group's agreed cost model (:class:`commlib.tuning.GroupModel`), or None."""
        return self.resources.model

    @property
    def is_member(self) -> bool:
        return self.backend is not None

    def group_rank(self, global_rank: int) -> int:
        """This group's rank of world rank ``global_rank`` (-1 if not a member)."""
        return self._index.get(global_rank, -1)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        backend = self.backend.name if self.backend is not None else "not a member"
        return f"<commlib.Group {self.name!r} size={self.size} rank={self.rank} backend={backend}>"


class _State:
    world: Group | None = None
    timeout_mode: str = "abort"
    backend_name: str | None = None
    groups: list[Group] = []
    excepthook = None


state = _State()
