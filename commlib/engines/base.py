"""The interface every engine (``Backend``: mpi, torch, nccl, self) implements.

A backend instance is one communicator: the ranks of one group, numbered 0..size-1. It moves flat,
contiguous torch tensors (the API layer has already flattened, made contiguous, upcast half
precision for reductions and turned bool into uint8). Every operation is non-blocking and returns a
request handle; ``test`` and ``wait`` complete lists of handles. This one shape serves the
blocking calls, ``async_op=True`` and the timeout loop alike.

Point-to-point must not overtake: two messages from one rank to another with the same tag arrive
in the order they were sent (MPI's rule). Algorithms rely on it, since every step of one collective
uses the same tag.

Two channels keep commlib's own traffic apart from the user's: ``isend``/``irecv`` with
``user=False`` (algorithm steps, tagged by collective sequence number) never match a user's
``commlib.send``/``recv`` on the same ranks (``user=True``).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from ..ops import ReduceOp

__all__ = ["Backend", "Handle", "mpi_world_ranks"]

Handle = Any  # a backend's request object


def mpi_world_ranks(MPI, comm) -> list[int]:
    """The MPI_COMM_WORLD rank of each rank of ``comm`` (``MPI``: the mpi4py module, which the
    engines that bootstrap through MPI import themselves)."""
    world, mine = MPI.COMM_WORLD.Get_group(), comm.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world))
    finally:
        mine.Free()
        world.Free()


class Backend:
    """Abstract communicator. Subclasses register themselves with ``@register_backend(name)``."""

    name: str = "?"
    #: dtypes the engine reduces natively with acceptable accumulation; others are upcast first.
    native_reduce_dtypes: frozenset = frozenset(
        {torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64}
    )
    #: ops the engine's native collectives implement (AVG is always SUM + division by commlib).
    native_ops: frozenset = frozenset(ReduceOp) - {ReduceOp.AVG}
    #: which device types the backend can move ("cpu", "cuda").
    devices: frozenset = frozenset({"cpu"})

    rank: int
    size: int

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def create_world(cls, **options) -> "Backend":
        """Create the world communicator (called once, by ``commlib.init``)."""
        raise NotImplementedError

    def new_subgroup(self, ranks: Sequence[int]) -> "Backend | None":
        """Collective over this communicator: a communicator of ``ranks`` (ranks of ``self``, in
        the order given), or None on ranks not in it."""
        raise NotImplementedError

    def member_subgroup(self, ranks: Sequence[int], key: str) -> "Backend":
        """Collective over the members of ``ranks`` only (ranks of ``self``, in order, this rank
        among them; the other ranks do not call): their communicator. ``key`` names the group:
        the same string on every member, different for groups being created at the same time.
        torch's ``new_group`` enters only the members (:mod:`commlib.torch_backend`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot create a group from its members "
                                  f"only")

    def split_lines(self, lines: Sequence[Sequence[int]]) -> "Backend | None":
        """Collective over this communicator: ``lines`` partitions its ranks (every rank passes
        the same list); return the communicator of the line holding this rank."""
        mine = None
        for line in lines:
            sub = self.new_subgroup(line)
            if sub is not None:
                mine = sub
        return mine

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Collective, blocking: every rank's 1-D CPU tensor ``row`` (the same length and dtype on
        every rank) as the rows of a CPU tensor, rank order; through host memory where the engine
        moves it, else CUDA. For bootstrapping (group facts, transports), not for data."""
        device = "cpu" if "cpu" in self.devices else "cuda"
        inp = row.to(device)
        out = torch.empty(self.size * row.numel(), dtype=row.dtype, device=device)
        self.wait([self.all_gather(out, inp, True)])
        return out.cpu().view(self.size, row.numel())

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Collective: every rank's ``values`` (the same count on every rank), blocking."""
        return self.all_gather_rows(torch.tensor(values, dtype=torch.int64)).tolist()

    def global_ranks(self) -> list[int]:
        """World rank of each rank of this communicator."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        """End every process of the job (used for uncaught exceptions under a launcher)."""
        os._exit(code)

    # ----- completion ---------------------------------------------------------------------
    #: Whether commlib's progress thread may advance this engine's asynchronous operations
    #: (test handles, post later steps) while the caller's thread uses the engine too
    #: (commlib/runtime/progress.py). False for GPU engines: CUDA's current stream is per thread
    #: and an NCCL communicator must not be used from two threads at once; their device work runs
    #: on its own, and later steps are posted by the caller's next commlib call.
    progress_in_thread: bool = True

    def test(self, handles: list) -> bool:
        """True when every handle has completed (advancing progress); never blocks."""
        raise NotImplementedError

    def wait(self, handles: list) -> None:
        """Block until every handle has completed (no timeout)."""
        raise NotImplementedError

    def idle(self, handles: list, seconds: float) -> bool:
        """Block up to ``seconds`` until one of ``handles`` may have completed, without spinning,
        where the engine can (a handle another thread completes); True if it blocked. The default
        cannot: a blocking call's poll loop then yields the core instead."""
        return False

    def source_of(self, handle) -> int | None:
        """For a completed ``irecv(..., peer=None)``: the rank the message came from."""
        return None

    # ----- point-to-point -----------------------------------------------------------------
    def isend(self, buf: torch.Tensor, peer: int, tag: int, user: bool = False) -> Handle:
        raise NotImplementedError

    def irecv(self, buf: torch.Tensor, peer: int | None, tag: int, user: bool = False) -> Handle:
        raise NotImplementedError

    # ----- native collectives (all in place on contiguous tensors) --------------------------
    # ``blocking=True`` allows the engine's blocking variant: the call returns when done, with an
    # already-completed handle, and sets ``self.inflight`` to the collective's name meanwhile so
    # that the watchdog (commlib/_watchdog.py) can end a stuck job. Backends without a blocking
    # variant ignore it.
    inflight: str | None = None

    def all_reduce(self, buf: torch.Tensor, op: ReduceOp, blocking: bool = False) -> Handle:
        raise NotImplementedError

    def prepare_all_reduce(self, buf: torch.Tensor, op: ReduceOp, blocking: bool = False):
        """Optional: a zero-argument callable that runs ``all_reduce(buf, op, blocking)`` (and
        returns its handle when not blocking), bound once for repeated calls on the same buffer;
        None if not offered. It must not keep ``buf`` alive (the caller does, for each call)."""
        return None

    def broadcast(self, buf: torch.Tensor, root: int, blocking: bool = False) -> Handle:
        raise NotImplementedError

    def reduce(self, buf: torch.Tensor, op: ReduceOp, root: int, blocking: bool = False) -> Handle:
        """Result in ``buf`` on ``root``; other ranks' ``buf`` is left unchanged."""
        raise NotImplementedError

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, blocking: bool = False) -> Handle:
        """``out`` holds ``size`` blocks of ``inp.numel()``, block i from rank i."""
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp,
                       blocking: bool = False) -> Handle:
        """``inp`` holds ``size`` blocks of ``out.numel()``; rank i gets the reduced block i."""
        raise NotImplementedError

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_counts: list[int],
                   in_counts: list[int], blocking: bool = False) -> Handle:
        """Element counts per peer; blocks laid out in rank order."""
        raise NotImplementedError

    def barrier(self, blocking: bool = False) -> Handle:
        raise NotImplementedError
