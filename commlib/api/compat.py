"""The rest of torch.distributed's module-level names, so that a program written for it runs with
``import torch.distributed as dist`` replaced by ``import commlib as dist``: process-group setup
and teardown (``init_process_group``, ``destroy_process_group``), the group queries
(``get_backend``, ``get_global_rank``, ``get_group_rank``, ``get_process_group_ranks``,
``is_available``), ``GroupMember`` and the legacy ``reduce_op``.

``init_process_group`` maps torch's backend names onto commlib's engines (the table is
:data:`BACKENDS`): "gloo" and "nccl" run on torch.distributed itself (commlib's ``torch`` engine,
over the process group that torch's ``init_process_group`` creates from the same arguments) where
torch can rendezvous, that is under torchrun or with an ``init_method`` or ``store``; under
``mpiexec``, where it cannot, they run on commlib's MPI engines instead. "mpi" is commlib's MPI
engine (mpi4py), and None or "commlib" lets ``commlib.init`` detect the launcher.
"""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed

from .. import config
from ..errors import CommArgumentError, CommBackendError, CommStateError, CommTypeError, arg_error
from ..ops import ReduceOp
from ..engines.torch_dist import release_default_group, restart_store
from ..runtime.group import Group
from ..runtime.group import state as _state
from .groups import finalize, get_world_group, init, resolve_group

__all__ = [
    "init_process_group", "destroy_process_group", "is_available", "get_backend",
    "get_global_rank", "get_group_rank", "get_process_group_ranks", "GroupMember", "reduce_op",
    "BACKENDS",
]

log = logging.getLogger("commlib")

#: torch's backend name -> (commlib engine where torch.distributed can rendezvous, engine where it
#: cannot). None: commlib.init() detects (mpi under mpiexec, torch under torchrun, else self).
BACKENDS = {
    None: ("torch", None),
    "commlib": ("torch", None),
    "gloo": ("torch", None),
    "nccl": ("torch", "nccl"),
    "mpi": ("mpi", "mpi"),
}

_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT")


class _Owned:
    torch_group = False  # whether init_process_group created torch's default process group


def _backend_name(backend) -> str | None:
    if backend is None:
        return None
    if not isinstance(backend, str):  # torch.distributed.Backend is a str too
        raise arg_error("init_process_group", "backend", backend, "must be a string or None",
                        f"pass one of {[k for k in BACKENDS if k]} or None", CommTypeError)
    name = backend.lower()
    if ":" in name:  # torch's per-device form, "cpu:gloo,cuda:nccl": torch.distributed's own
        return name
    if name not in BACKENDS:
        raise arg_error("init_process_group", "backend", backend,
                        f"is not a backend commlib runs on (it runs {[k for k in BACKENDS if k]})",
                        "pass 'gloo' or 'nccl' (torch.distributed), 'mpi' (mpi4py), or None to "
                        "detect the launcher")
    return name


def _seconds(fn: str, timeout) -> float | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        raise arg_error(fn, "timeout", timeout, "must be a positive timedelta or number of seconds",
                        "pass e.g. datetime.timedelta(minutes=10), or None for the default")
    return float(seconds)


def _torch_can_rendezvous(init_method, store) -> bool:
    """Whether torch.distributed.init_process_group can find its peers: a store, an init_method
    other than the environment, or torchrun's variables."""
    if store is not None:
        return True
    if init_method is not None and not str(init_method).startswith("env://"):
        return True
    return all(k in os.environ for k in _TORCHRUN_ENV)


def init_process_group(backend=None, init_method=None, timeout=None, world_size: int = -1,
                       rank: int = -1, store=None, group_name: str = "", pg_options=None,
                       device_id=None) -> None:
    """torch.distributed's ``init_process_group``: initialize commlib on the engine that
    ``backend`` names (see :data:`BACKENDS` and docs/api.md).

    "gloo", "nccl" (and torch's "cpu:gloo,cuda:nccl" forms): where torch can rendezvous (torchrun's
    variables, an ``init_method`` or a ``store``), ``torch.distributed.init_process_group`` runs with
    every argument as given (unless torch is initialized already) and commlib drives its default
    process group (engine ``torch``); under ``mpiexec`` "gloo" runs on engine ``mpi`` and "nccl"
    on engine ``nccl``. "mpi": engine ``mpi``. None or "commlib": torch's rendezvous where one is
    given, else what ``commlib.init()`` detects (``mpi`` under mpiexec, ``self`` alone).
    ``timeout`` (a timedelta or seconds) is commlib's operation timeout and torch's process-group
    timeout. ``rank`` and ``world_size``, when given, must match what the launcher started.
    """
    fn = "init_process_group"
    if _state.world is not None:
        raise CommStateError(
            f"commlib.{fn}(): commlib is already initialized (backend "
            f"{_state.backend_name!r}). Fix: call destroy_process_group() first, or call it once.")
    name = _backend_name(backend)
    seconds = _seconds(fn, timeout)
    dist = torch.distributed
    via_torch = dist.is_available() and (dist.is_initialized()
                                         or _torch_can_rendezvous(init_method, store))
    if name is None and config.get("backend") is not None:
        via_torch = False  # COMMLIB_BACKEND chooses, as for commlib.init()
    if name is not None and ":" in name:
        engine = "torch"
    else:
        engine = BACKENDS[name][0 if via_torch else 1]
    if engine == "torch":
        if not dist.is_initialized():
            _init_torch(name, init_method, seconds, world_size, rank, store, group_name, pg_options,
                        device_id)
        init("torch", timeout=seconds)
    else:
        given = {"init_method": (init_method, None), "store": (store, None),
                 "group_name": (group_name, ""), "pg_options": (pg_options, None),
                 "device_id": (device_id, None)}
        for arg, (value, default) in given.items():
            if value != default and not (arg == "init_method" and str(value).startswith("env://")):
                raise arg_error(fn, arg, value,
                                f"applies to torch.distributed's process groups, and backend "
                                f"{backend!r} runs here on commlib's {engine or 'detected'} engine",
                                "drop it, or launch with torchrun to run on torch.distributed")
        world = init(engine, timeout=seconds)
        started = _state.backend_name
        log.info("init_process_group(backend=%r): commlib engine %s", backend, started)
        launched = os.environ.get("WORLD_SIZE")
        if started == "mpi" and launched and launched.isdigit() and int(launched) != world.size:
            finalize()  # torchrun's ranks, each its own MPI world: every result would be wrong
            raise CommBackendError(
                f"commlib.{fn}(): backend {backend!r} runs on MPI, which sees {world.size} rank(s), "
                f"but the launcher started WORLD_SIZE={launched}. Fix: launch with mpiexec, or "
                f"use backend='gloo' under torchrun.")
        for arg, value, actual in (("world_size", world_size, world.size), ("rank", rank, world.rank)):
            if value not in (-1, None) and value != actual:
                finalize()
                raise arg_error(fn, arg, value,
                                f"differs from what the launcher started ({arg} {actual}, engine "
                                f"{started})", f"drop {arg}, or launch the job with it")


def _init_torch(name, init_method, seconds, world_size, rank, store, group_name, pg_options,
                device_id) -> None:
    kwargs = {"init_method": init_method, "world_size": world_size, "rank": rank, "store": store,
              "pg_options": pg_options, "device_id": device_id}
    if seconds is not None:
        kwargs["timeout"] = timedelta(seconds=seconds)
    if group_name:
        kwargs["group_name"] = group_name
    backend = None if name in (None, "commlib") else name
    again = restart_store() if store is None and init_method in (None, "env://") else None
    if again is not None:  # a new world after destroy_process_group(): the first one's store
        kwargs.update(init_method=None, store=again,
                      rank=int(os.environ["RANK"]) if rank in (None, -1) else rank,
                      world_size=int(os.environ["WORLD_SIZE"]) if world_size in (None, -1)
                      else world_size)
    try:
        torch.distributed.init_process_group(backend, **kwargs)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CommBackendError(
            f"commlib.init_process_group(): torch.distributed.init_process_group({backend!r}) "
            f"failed: {exc}. Fix: check init_method/store, rank and world_size (or torchrun's "
            f"MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), or use backend='mpi' under mpiexec."
        ) from exc
    _Owned.torch_group = True


def destroy_process_group(group: Group | None = None) -> None:
    """torch.distributed's ``destroy_process_group``: with no group (or the world group), release
    every group (``commlib.finalize``) and torch's default process group if
    ``init_process_group`` created it, or ``commlib.init()`` from torchrun's variables (the next
    ``init()`` then rendezvouses again: a restart after a failure); with a group, release that group only: calls on it raise
    ``CommStateError`` afterwards. Collective over the group's ranks for the MPI engine."""
    if group is None or group is _state.world:
        finalize()
        if _Owned.torch_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _Owned.torch_group = False
        release_default_group()  # the one commlib.init() created from torchrun's variables
        return
    if not isinstance(group, Group):
        raise arg_error("destroy_process_group", "group", group, "must be a commlib.Group or None",
                        "pass a group from commlib.new_group, or None for all", CommTypeError)
    if group not in _state.groups:
        return  # released already (torch ignores a second destroy of a group too)
    _state.groups.remove(group)
    group.broken = ("commlib.destroy_process_group() released it. Fix: create the group again "
                    "with commlib.new_group()")
    group.resources.close()
    if group.backend is not None:
        group.backend.close()


def is_available() -> bool:
    """True: commlib's collectives are available (torch.distributed's ``is_available``)."""
    return True


def get_backend(group: Group | None = None) -> str:
    """The name of the engine ``group`` (default the world) runs on: ``"mpi"``, ``"torch"``,
    ``"nccl"`` or ``"self"``."""
    g = get_world_group() if group is None else resolve_group(group, "get_backend")
    return g.backend.name


def _group(fn: str, group) -> Group:
    if group is None:
        return get_world_group()
    if not isinstance(group, Group):
        raise arg_error(fn, "group", group, "must be a commlib.Group or None",
                        "pass a group from commlib.new_group or a Mesh", CommTypeError)
    return group


def get_global_rank(group: Group | None, group_rank: int) -> int:
    """The world rank of rank ``group_rank`` of ``group``."""
    g = _group("get_global_rank", group)
    if isinstance(group_rank, bool) or not isinstance(group_rank, int) \
            or not 0 <= group_rank < g.size:
        raise arg_error("get_global_rank", "group_rank", group_rank,
                        f"must be a rank of group {g.name!r} (0..{g.size - 1})",
                        "pass a rank within the group")
    return g.global_rank(group_rank)


def get_group_rank(group: Group | None, global_rank: int) -> int:
    """The rank within ``group`` of world rank ``global_rank``."""
    g = _group("get_group_rank", group)
    r = g.group_rank(global_rank) if isinstance(global_rank, int) else -1
    if r < 0:
        raise arg_error("get_group_rank", "global_rank", global_rank,
                        f"is not a member of group {g.name!r} (world ranks {list(g.ranks)})",
                        "pass one of those world ranks", CommArgumentError)
    return r


def get_process_group_ranks(group: Group | None) -> list[int]:
    """The world ranks of ``group`` (default the world), in group order."""
    return list(_group("get_process_group_ranks", group).ranks)


class _NonGroupMember:
    """What ``GroupMember.NON_GROUP_MEMBER`` is: equal to a group this rank is not a member of
    (torch's ``new_group`` returns the constant to those ranks; commlib's returns a Group whose
    ``rank`` is -1, which compares equal to it)."""

    def __eq__(self, other) -> bool:
        return other is self or (isinstance(other, Group) and not other.is_member)

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return "commlib.GroupMember.NON_GROUP_MEMBER"


class _GroupMemberType(type):
    @property
    def WORLD(cls) -> Group | None:
        """The world group now (None before init), read at each access as torch's is."""
        return _state.world


class GroupMember(metaclass=_GroupMemberType):
    """torch.distributed's ``GroupMember``: ``GroupMember.WORLD`` is the world group at the time
    it is read (None before init); ``GroupMember.NON_GROUP_MEMBER`` compares equal to a group this
    rank is not a member of."""

    NON_GROUP_MEMBER = _NonGroupMember()


class _LegacyReduceOp:
    """``commlib.reduce_op``: torch.distributed's deprecated ``reduce_op``; each attribute is the
    ``ReduceOp`` member of that name, with a ``FutureWarning``."""

    def __getattr__(self, name: str):
        value = getattr(ReduceOp, name)
        warnings.warn("commlib.reduce_op is deprecated (as torch.distributed.reduce_op is): use "
                      "commlib.ReduceOp", FutureWarning, stacklevel=2)
        return value

    def __repr__(self) -> str:
        return "commlib.reduce_op (deprecated: use commlib.ReduceOp)"


reduce_op = _LegacyReduceOp()
