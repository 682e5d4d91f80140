"""Buffers that every rank of a group maps: ``commlib.shared_empty``.

A collective on a host reads its peers' data through the group's shared-memory segment: each rank
copies its part into the segment and the peers copy it out, two copies. When the data already
lies in memory the peers map, the first copy goes: ``all_gather_into_tensor``'s input,
``reduce_scatter_tensor``'s input and ``broadcast``'s buffer at the root are read in place. This
is torch's symmetric memory (``torch.distributed._symmetric_memory.empty``) or vLLM's registered
buffers, for CPU tensors: allocate once the buffers a training loop communicates every step
(parameter shards to all-gather, gradient buckets to reduce-scatter) and write into them.

Nothing else changes: the tensor is an ordinary CPU tensor, any collective takes it, and a call
whose data is not in a shared buffer (or on some ranks only) runs the two-copy path on those
ranks. The all-reduce keeps copying (reading in place measured no faster: docs/shm.md).

The memory returns to the system when the group goes (``commlib.finalize()``), not when the
tensor does: the peers keep their mappings. Allocate buffers once, not per step.
"""

from __future__ import annotations

import math

import torch

from ..errors import CommArgumentError, CommError, CommMismatchError, arg_error
from ..runtime.group import Group
from .groups import resolve_group

__all__ = ["shared_empty"]

_FN = "shared_empty"


def _shape(size) -> tuple[int, ...]:
    dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise arg_error(_FN, "size", tuple(dims), "must be non-negative ints",
                        "pass the shape as torch.empty takes it, e.g. shared_empty(1024, 256)")
    return tuple(dims)


def _check(size, dtype) -> tuple[tuple[int, ...], torch.dtype]:
    shape = _shape(size)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise arg_error(_FN, "dtype", dtype, "must be a torch.dtype",
                        "pass e.g. dtype=torch.float32")
    return shape, dtype


def shared_empty(*size, dtype: torch.dtype | None = None, group: Group | None = None) -> torch.Tensor:
    """An uninitialized CPU tensor of ``size`` and ``dtype`` (default: torch's default dtype) in
    memory that every rank of ``group`` (default: world) maps, so that its collectives read it in
    place (see the module docstring).

    Collective: every rank of the group calls it at the same point with the same size and dtype.
    A rank with invalid arguments raises its own error and the others raise
    :class:`CommArgumentError` naming it; ranks asking for different sizes all raise
    :class:`CommMismatchError`. Where the group cannot share memory (one rank, ranks on several
    hosts, ``COMMLIB_SHM=0``, no usable /dev/shm) the tensor is an ordinary one
    (``torch.empty``) and every collective still works.
    """
    g = resolve_group(group, _FN)
    error: CommError | None = None
    try:
        shape, dtype = _check(size, dtype)
        nbytes = math.prod(shape) * dtype.itemsize
    except CommError as exc:
        error, nbytes = exc, -1
    shm = g.resources.transports.get("shm")
    if shm is not None:  # agree before allocating: a bad rank must not leave the others waiting
        asked = [n for (n,) in g.backend.all_gather_ints([nbytes])]
        if error is not None:
            raise error
        bad = [r for r, n in enumerate(asked) if n < 0]
        if bad:
            raise CommArgumentError(
                f"commlib.{_FN}(): group rank(s) {bad} of {g.name!r} passed invalid arguments "
                f"(their own errors say which), so no rank allocates. Fix: pass the same valid "
                f"size and dtype on every rank")
        if len(set(asked)) != 1:
            raise CommMismatchError(
                f"commlib.{_FN}(): the ranks of group {g.name!r} asked for different sizes "
                f"(bytes by group rank: {asked}). Fix: call it with the same size and dtype on "
                f"every rank, at the same point")
    elif error is not None:
        raise error
    raw = shm.share(nbytes) if shm is not None and nbytes > 0 else None
    if raw is None:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).view(shape)
