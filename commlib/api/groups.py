"""Initialization, groups and meshes: the public functions that create and release groups
(:class:`~commlib.runtime.group.Group` itself and the process's state are in the runtime)."""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import time
import traceback
from typing import Sequence

import torch
import torch.distributed

from .. import config
from ..engines import get_backend_class
from ..engines.base import Backend
from ..errors import CommArgumentError, CommStateError, CommTypeError, arg_error
from ..runtime import affinity as _affinity
from ..runtime import plans as _plans
from ..runtime import watchdog as _watchdog
from ..runtime.group import Group
from ..runtime.group import state as _state
from ..runtime import progress
from ..runtime.progress import unusable
from ..topology import mesh_order
from ..topology.gather import rank_locality

__all__ = [
    "Group", "Mesh", "init", "finalize", "is_initialized", "get_rank", "get_world_size",
    "new_group", "get_world_group", "resolve_group", "init_with", "member_group",
    "detect_backend",
]

log = logging.getLogger("commlib")


# ----- initialization ---------------------------------------------------------------------
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALRANKID",
            "MV2_COMM_WORLD_SIZE", "PMI_FD")


def detect_backend() -> str:
    """The engine :func:`init` uses when none is named: ``torch`` after torch.distributed's
    initialization or under torchrun, ``mpi`` under an MPI launcher, else ``self``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return "torch"
    env = os.environ
    if any(k in env for k in _MPI_ENV):
        return "mpi"
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return "torch"
    return "self"


def init(backend: str | None = None, *, timeout: float | None = None, debug: bool | None = None,
         log_level: str | None = None, timeout_mode: str | None = None) -> Group:
    """Initialize commlib and return the world group.

    With no argument it works under ``mpirun``/``mpiexec`` (backend ``mpi``), under ``torchrun``
    (``torch``), after ``torch.distributed.init_process_group`` (``torch``, on the default process
    group) and in a single plain process (``self``, world size 1). Calling it again returns the
    same world group.

    Args:
        backend: ``"mpi"``, ``"torch"``, ``"nccl"`` or ``"self"``; default ``COMMLIB_BACKEND`` or
            detected from the launcher.
        timeout: seconds before a stuck operation raises ``CommTimeoutError`` (0: none); default
            ``COMMLIB_TIMEOUT`` or 600.
        debug: check before every collective that all ranks agree; default ``COMMLIB_DEBUG``.
        log_level: level of the ``commlib`` logger; default ``COMMLIB_LOG`` or WARNING.
        timeout_mode: ``"abort"`` (a watchdog ends the job when a blocking collective exceeds
            the timeout) or ``"raise"`` (every call polled, ``CommTimeoutError`` raised); default
            ``COMMLIB_TIMEOUT_MODE`` or abort. See docs/configuration.md.
    """
    if _state.world is not None:
        if backend is not None and backend != _state.backend_name:
            raise CommStateError(
                f"commlib.init(): already initialized with backend {_state.backend_name!r}, "
                f"asked for {backend!r}. Fix: call commlib.finalize() first."
            )
        return _state.world
    mode = _prepare("init", timeout, log_level, timeout_mode)
    name = config.get("backend", backend)
    source = "argument" if backend else ("COMMLIB_BACKEND" if name else "detected")
    name = name or detect_backend()
    cls = get_backend_class(name)
    return _start(cls.create_world(), name, source, timeout, debug, mode)


def init_with(world_backend: Backend, name: str, *, timeout: float | None = None,
              debug: bool | None = None, log_level: str | None = None,
              timeout_mode: str | None = None) -> Group:
    """Initialize commlib on a world communicator the caller built (``name``: its engine), as
    :func:`init` does on the one it detects: for layers that must build the world themselves
    (:mod:`commlib.torch_backend` builds it over torch's store while torch creates its default
    process group). Collective over the world."""
    if _state.world is not None:
        raise CommStateError(
            f"commlib.init_with(): commlib is already initialized with backend "
            f"{_state.backend_name!r}. Fix: call commlib.finalize() first."
        )
    mode = _prepare("init_with", timeout, log_level, timeout_mode)
    return _start(world_backend, name, "caller", timeout, debug, mode)


def _prepare(fn: str, timeout, log_level, timeout_mode) -> str:
    """The checks and logging set-up before the world is built; returns the timeout mode."""
    config.check_environment()
    level = config.get("log", log_level)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("commlib %(levelname)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(level)
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
        raise arg_error(fn, "timeout", timeout, "must be a number of seconds >= 0",
                        "pass e.g. timeout=300, or 0 for no timeout")
    mode = config.get("timeout_mode", timeout_mode)
    if mode not in ("abort", "raise"):
        raise arg_error(fn, "timeout_mode", mode, "must be 'abort' or 'raise'",
                        "pass timeout_mode='raise' for catchable timeouts")
    return mode


def _start(world_backend: Backend, name: str, source: str, timeout, debug, mode: str) -> Group:
    """Make ``world_backend`` commlib's world: its group, the abort hook and the watchdog."""
    timeout_s = config.get("timeout", timeout)
    timeout_s = None if not timeout_s else float(timeout_s)
    _state.timeout_mode = mode
    if world_backend.size > 1 and config.get("abort_on_exception"):
        # Before the world group is built: building it is collective (shared-memory segment, cost
        # model), and a rank failing there must end the job, not leave the others waiting.
        _install_abort_hook(world_backend)
    if world_backend.size > 1:
        log.info("rank %d: %s", world_backend.rank, _affinity.apply(world_backend))
    world = Group(world_backend, world_backend.global_ranks(), "world", timeout_s,
                  bool(config.get("debug", debug)))
    _state.world, _state.backend_name, _state.groups = world, name, [world]
    log.info("rank %d/%d: backend %s (%s), timeout %s (%s), debug %s", world.rank, world.size,
             name, source, timeout_s, mode, world.debug)
    if mode == "abort" and world.size > 1:
        _watchdog.start(lambda: _state.groups)
    _created(world)
    return world


#: Called with every group created here, right after it is built, on every rank that built it
#: (collective over its members): commlib/api/autotune.py registers the in-job calibration of a
#: group the tuning file does not know. A list, not an import: the calibration calls collectives,
#: which import this module.
GROUP_HOOKS: list = []


def _created(group: Group) -> Group:
    for hook in GROUP_HOOKS:
        hook(group)
    return group


def _install_abort_hook(backend: Backend) -> None:
    """An uncaught exception on one rank ends the job rather than leaving the others waiting."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        # A hook installed after this one may capture stderr in memory around its call, to print
        # it when this returns (torch.distributed's init_process_group does, to prefix the
        # rank): this one never returns, so it writes to the process's own stderr there.
        saved = sys.stderr
        sys.stderr = _lasting(saved)
        if previous is sys.__excepthook__:
            # One write, not one per line: mpiexec forwards what reached it when the abort
            # ends the job, and once passed on only the first two lines of the traceback (CI).
            sys.stderr.write("".join(traceback.format_exception(exc_type, exc, tb)))
        else:
            previous(exc_type, exc, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        sys.stderr = saved
        time.sleep(0.2)  # the launcher forwards the output before the abort tears the job down
        backend.abort(1)

    _state.excepthook = previous
    sys.excepthook = hook


def _lasting(stream):
    """``stream``, or the process's own stderr where ``stream`` lives in memory only (no file
    descriptor: a capture, whose text an abort would lose)."""
    try:
        stream.fileno()
        return stream
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: both of the last
        return sys.__stderr__ if sys.__stderr__ is not None else stream


def finalize() -> None:
    """Release every group commlib created. ``init()`` may be called again afterwards."""
    if _state.world is None:
        return
    # No thread of commlib outlives finalize (it also runs at exit): one still inside a torch
    # call when the interpreter finalizes aborts the process (see engines/torch_dist._Waiters).
    _watchdog.stop()
    progress.shutdown()  # no thread touches an engine while the groups go
    for group in reversed(_state.groups):
        # A Group object the user still holds must raise CommStateError, not reach a freed
        # communicator.
        group.broken = "commlib.finalize() released it. Fix: create groups again after commlib.init()"
        group.resources.close()  # the transports: segment, shared buffers, CUDA IPC handles
        if group.backend is not None:
            group.backend.close()
    _affinity.release()
    if _state.excepthook is not None:
        sys.excepthook = _state.excepthook
        _state.excepthook = None
    _state.world, _state.backend_name, _state.groups = None, None, []
    _plans.clear()


atexit.register(finalize)


def is_initialized() -> bool:
    return _state.world is not None


def get_world_group() -> Group:
    if _state.world is None:
        raise CommStateError("commlib: not initialized. Fix: call commlib.init() first.")
    return _state.world


def resolve_group(group, fn: str) -> Group:
    """The group a call runs on (default: world), checked to contain this rank."""
    if group is None:
        world = _state.world
        if world is None:
            world = init()
        return world
    if isinstance(group, Mesh):
        raise arg_error(fn, "group", group, "a Mesh is not a group",
                        "pass mesh.group('name') for one mesh dimension", CommArgumentError)
    if not isinstance(group, Group):
        raise arg_error(fn, "group", group, "must be a commlib.Group or None",
                        "create groups with commlib.new_group(ranks) or commlib.Mesh", CommTypeError)
    if group.backend is None:
        raise CommStateError(
            f"commlib.{fn}(): this rank (world rank {get_world_group().rank}) is not a member of "
            f"group {group.name!r} (world ranks {list(group.ranks)}). Fix: call collectives on a "
            f"group only from its members."
        )
    return group


def get_rank(group: Group | None = None) -> int:
    """This process's rank in ``group`` (default: world); -1 if it is not a member."""
    if group is None:
        return get_world_group().rank
    return group.rank


def get_world_size(group: Group | None = None) -> int:
    return (get_world_group() if group is None else group).size


def _check_ranks(fn: str, ranks, world_size: int) -> list[int]:
    try:
        ranks = [int(r) for r in ranks]
    except (TypeError, ValueError):
        raise arg_error(fn, "ranks", ranks, "must be a sequence of world ranks",
                        "pass e.g. [0, 2]") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise arg_error(fn, "ranks", ranks, f"ranks {bad} are outside the world (size {world_size})",
                        f"use ranks in 0..{world_size - 1}")
    if len(set(ranks)) != len(ranks) or not ranks:
        raise arg_error(fn, "ranks", ranks, "must be non-empty with no repeated rank",
                        "list each rank once")
    return ranks


def new_group(ranks: Sequence[int] | None = None, *, name: str | None = None,
              timeout: float | None = None, group: Group | None = None) -> Group:
    """Create a group of world ranks ``ranks`` (in that order; default all of ``group``).

    Collective over ``group`` (default the world): every rank of it calls it with the same
    ``ranks``, as with ``torch.distributed.new_group``; ``ranks`` must be ranks of ``group``.
    Ranks outside ``ranks`` get a Group whose ``rank`` is -1 and on which collectives raise
    ``CommStateError``.
    """
    parent = get_world_group() if group is None else resolve_group(group, "new_group")
    world = get_world_group()
    if ranks is None:
        ranks = list(parent.ranks)
    else:
        ranks = _check_ranks("new_group", ranks, world.size)
        outside = [r for r in ranks if r not in parent.ranks]
        if outside:
            raise arg_error("new_group", "ranks", ranks,
                            f"ranks {outside} are not in the parent group {parent.name}",
                            "pass ranks of `group`, or create the group over the world")
    backend = parent.backend.new_subgroup([parent.group_rank(r) for r in ranks])
    name = name or f"group{len(_state.groups)}{_short(ranks)}"
    made = Group(backend, ranks, name, parent.timeout if timeout is None else (timeout or None),
                 parent.debug)
    _state.groups.append(made)
    return _created(made)


def member_group(ranks: Sequence[int], key: str, *, name: str | None = None) -> Group:
    """A group of world ranks ``ranks`` (in that order) created by its members only: the other
    ranks do not call. ``key`` names it, the same string on every member and different for groups
    created at the same time. For layers whose groups are entered by their members only
    (torch's ``new_group``, :mod:`commlib.torch_backend`); :func:`new_group` is collective over
    the parent."""
    world = get_world_group()
    ranks = _check_ranks("member_group", ranks, world.size)
    if world.rank not in ranks:
        raise arg_error("member_group", "ranks", ranks, f"do not include this rank ({world.rank})",
                        "call it on the members of the group only")
    backend = world.backend.member_subgroup([world.group_rank(r) for r in ranks], key)
    made = Group(backend, ranks, name or f"group{len(_state.groups)}{_short(ranks)}",
                 world.timeout, world.debug)
    _state.groups.append(made)
    return _created(made)


def _short(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}-{ranks[-1]}]"
    return "[" + ",".join(map(str, ranks)) + "]"


class Mesh:
    """Ranks of a group laid out row-major on an n-dimensional grid, with one subgroup per
    dimension for every rank.

    Collective over ``group`` (default world). ``mesh.group(d)`` is the group of ranks that differ
    from this rank only along dimension ``d`` (an index or a name from ``dim_names``).

    Example (4 ranks, ``Mesh((2, 2), ("dp", "tp"))``)::

        rank 0: coords (0, 0), group("dp") = ranks [0, 2], group("tp") = ranks [0, 1]
        rank 3: coords (1, 1), group("dp") = ranks [1, 3], group("tp") = ranks [2, 3]
    """

    def __init__(self, shape: Sequence[int] | int, dim_names: Sequence[str] | None = None, *,
                 group: Group | None = None, _order: Sequence[int] | None = None):
        parent = resolve_group(group, "Mesh")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
            raise arg_error("Mesh", "shape", shape, "must be positive integers",
                            f"pass e.g. ({parent.size},) or (2, {max(parent.size // 2, 1)})")
        if math.prod(shape) != parent.size:
            raise arg_error("Mesh", "shape", shape,
                            f"has {math.prod(shape)} ranks but the group has {parent.size}",
                            f"use a shape whose product is {parent.size}")
        if dim_names is None:
            dim_names = tuple(f"dim{i}" for i in range(len(shape)))
        dim_names = tuple(dim_names)
        if len(dim_names) != len(shape) or len(set(dim_names)) != len(dim_names):
            raise arg_error("Mesh", "dim_names", dim_names,
                            f"must be {len(shape)} distinct names, one per dimension of {shape}",
                            "pass one name per dimension")
        self.shape, self.dim_names, self.parent = shape, dim_names, parent
        # order[p]: the group rank at row-major position p (Mesh.from_topology permutes it).
        self.order = list(range(parent.size)) if _order is None else list(_order)
        self.coords = _unravel(self.order.index(parent.rank), shape)
        tag = "x".join(map(str, shape))
        self._groups: list[Group] = []
        for d in range(len(shape)):
            lines = [[self.order[p] for p in line] for line in _lines(shape, d)]
            line_of_me = next(line for line in lines if parent.rank in line)
            backend = parent.backend.split_lines(lines)
            ranks = [parent.ranks[r] for r in line_of_me]
            fixed = ",".join(str(c) for i, c in enumerate(self.coords) if i != d)
            group_ = Group(backend, ranks, f"mesh{tag}.{dim_names[d]}[{fixed}]", parent.timeout,
                           parent.debug)
            _state.groups.append(group_)
            self._groups.append(_created(group_))

    @classmethod
    def from_topology(cls, shape: Sequence[int] | int, dim_names: Sequence[str] | None = None, *,
                      group: Group | None = None, topology=None) -> "Mesh":
        """A mesh whose inner (last) dimensions stay inside the fastest domain.

        Collective over ``group``. Every rank's locality key (host, NVLink domain, NUMA node; see
        :func:`commlib.topology.gather.rank_locality`) is all-gathered, and ranks are placed on the
        row-major grid sorted by key (:func:`commlib.topology.mesh_order`, the same plan on every
        rank), so that e.g. ``Mesh.from_topology((hosts, per_host), ("dp", "tp"))`` gives "tp"
        groups inside one host even when ranks were launched round-robin across hosts.
        ``mesh.levels`` names the domain each dimension stays inside.
        """
        parent = resolve_group(group, "Mesh.from_topology")
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        if parent.broken is not None:
            unusable(parent, "Mesh.from_topology")
        # through the engine directly, like the group's own facts (commlib/runtime/resources.py)
        rows = [tuple(row) for row in parent.backend.all_gather_ints(list(rank_locality(topology)))]
        if not shape_t or any(not isinstance(s, int) or s < 1 for s in shape_t) or \
                math.prod(shape_t) != parent.size:
            return cls(shape, dim_names, group=parent)  # raises the standard shape error
        plan = mesh_order(rows, shape_t)
        mesh = cls(shape_t, dim_names, group=parent, _order=plan.order)
        mesh.levels = plan.levels
        return mesh

    def _dim(self, dim) -> int:
        if isinstance(dim, str):
            if dim not in self.dim_names:
                raise arg_error("Mesh.group", "dim", dim, f"is not one of {self.dim_names}",
                                "use a name given in dim_names or an index")
            return self.dim_names.index(dim)
        if not isinstance(dim, int) or not -len(self.shape) <= dim < len(self.shape):
            raise arg_error("Mesh.group", "dim", dim, f"must index a dimension of {self.shape}",
                            f"use 0..{len(self.shape) - 1} or a name in {self.dim_names}")
        return dim % len(self.shape)

    def group(self, dim=0) -> Group:
        return self._groups[self._dim(dim)]

    __getitem__ = group

    def size(self, dim=None) -> int:
        return self.parent.size if dim is None else self.shape[self._dim(dim)]

    def coordinate(self, dim) -> int:
        return self.coords[self._dim(dim)]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def rank_at(self, coords: Sequence[int]) -> int:
        """World rank at mesh coordinates ``coords``."""
        index = 0
        for c, s in zip(coords, self.shape):
            index = index * s + c
        return self.parent.ranks[self.order[index]]

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"<commlib.Mesh ({dims}) coords={self.coords}>"


def _unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for s in reversed(shape):
        coords.append(index % s)
        index //= s
    return tuple(reversed(coords))


def _lines(shape: Sequence[int], dim: int) -> list[list[int]]:
    """Partition of ranks 0..prod(shape)-1 into lines along ``dim`` (each in coordinate order)."""
    lines: dict[tuple, list[int]] = {}
    for r in range(math.prod(shape)):
        c = _unravel(r, shape)
        lines.setdefault(c[:dim] + c[dim + 1:], []).append(r)
    return list(lines.values())
