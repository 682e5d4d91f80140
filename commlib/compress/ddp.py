"""A communication hook for ``torch.nn.parallel.DistributedDataParallel`` that averages each
gradient bucket with :func:`commlib.compress.all_reduce` (with error feedback by default)::

    ddp = DistributedDataParallel(model)                 # gloo or NCCL, any torch.distributed group
    ddp.register_comm_hook(*commlib.compress.ddp_hook("int8"))

**Synchronous.** The hook runs the compressed all-reduce to the end and returns a completed
future. DDP calls a bucket's hook from inside the backward pass as soon as the bucket's gradients
are ready, so the backward of the remaining layers waits for each bucket's reduction: there is no
overlap of communication with computation (DDP's default hook posts an asynchronous all-reduce
and overlaps). commlib's staged work finishes on the thread that waits for it, and DDP waits for
the future in C++ after the backward, so an asynchronous hook would need its own thread running
collectives beside the backward's: not done.

**Error feedback** keeps one :class:`~commlib.compress.ErrorFeedback` per bucket index. DDP builds
its buckets in reverse parameter order, then rebuilds them once after the first iteration in the
order the gradients became ready, so a bucket index may then hold other parameters or another
number of elements: the hook remembers each index's layout (its parameters and element count) and
starts a fresh residual when the layout changes (the residual of another layout would be added to
the wrong gradients). From the second iteration on, indices and layouts are stable.

**Groups.** The hook reduces over a commlib group (default: the world; ``commlib.init()`` under
torchrun or after ``init_process_group`` runs on torch.distributed's default process group), which
must hold the same ranks as DDP's ``process_group``.
"""

from __future__ import annotations

from typing import Callable

import torch

from commlib.api.groups import resolve_group
from commlib.errors import CommTypeError, arg_error
from commlib.ops import ReduceOp

from .codec import Codec, as_codec
from .collectives import _algorithm, all_reduce
from .feedback import ErrorFeedback

__all__ = ["ddp_hook", "DDPHookState", "compressed_allreduce_hook"]


class DDPHookState:
    """What :func:`compressed_allreduce_hook` carries across calls.

    ``codec``, ``group``, ``algorithm``: those of the all-reduce. ``error_feedback``: whether
    residuals are kept. ``calls``: buckets reduced so far (a check that DDP runs the hook).
    ``resets``: residuals started afresh because a bucket index changed layout (DDP's rebuild
    after the first iteration).
    """

    def __init__(self, codec: Codec, error_feedback: bool, group, algorithm: str):
        self.codec, self.error_feedback = codec, error_feedback
        self.group, self.algorithm = group, algorithm
        self.calls = self.resets = 0
        self._feedback: dict[int, ErrorFeedback] = {}
        self._layout: dict[int, tuple] = {}

    def feedback(self, bucket) -> ErrorFeedback | None:
        """The bucket index's residuals, fresh if its layout changed (None without feedback)."""
        if not self.error_feedback:
            return None
        index = bucket.index()
        layout = (bucket.buffer().numel(),
                  tuple((p.data_ptr(), p.numel()) for p in bucket.parameters()))
        if self._layout.get(index) != layout:
            self.resets += index in self._layout
            self._layout[index] = layout
            self._feedback[index] = ErrorFeedback()
        return self._feedback[index]


# ``bucket`` and the result are not annotated: DDP's register_comm_hook compares those
# annotations with the classes dist.GradBucket and torch.futures.Future[torch.Tensor], and this
# module's annotations are strings.
def compressed_allreduce_hook(state: DDPHookState, bucket):
    """Average ``bucket`` (a ``torch.distributed.GradBucket``)'s flat gradient buffer over
    ``state.group`` in place with :func:`commlib.compress.all_reduce`; return a completed
    ``torch.futures.Future[torch.Tensor]`` holding it."""
    buf = bucket.buffer()
    all_reduce(buf, codec=state.codec, op=ReduceOp.AVG, group=state.group,
               error_feedback=state.feedback(bucket), algorithm=state.algorithm,
               key=bucket.index())
    state.calls += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def ddp_hook(codec, *, error_feedback: bool = True, group=None,
             algorithm: str = "auto") -> tuple[DDPHookState, Callable]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``: each
    gradient bucket averaged with :func:`commlib.compress.all_reduce` (``op=AVG``), as DDP's
    default hook averages it exactly.

    Args:
        codec: a codec name (``"int8"``, ``"int4"``, ``"fp8"``, ``"topk"``) or a
            :class:`~commlib.compress.Codec`.
        error_feedback: keep what each encode lost and add it to the same bucket's next
            gradient (one residual per bucket index, reset when DDP rebuilds the bucket).
        group: the commlib group of DDP's ranks (default: the world).
        algorithm: :func:`commlib.compress.all_reduce`'s; ``"auto"`` runs the exact all-reduce
            where compression does not pay (on one host: always), ``"compressed"`` forces the
            codec.

    Collective: every rank of the group calls it (the world group is initialized on first use).

    Example::

        state, hook = commlib.compress.ddp_hook("int8", algorithm="compressed")
        ddp.register_comm_hook(state, hook)
        ...                                   # train; state.calls counts the buckets reduced
    """
    fn = "compress.ddp_hook"
    c = as_codec(codec)
    if not isinstance(error_feedback, bool):
        raise arg_error(fn, "error_feedback", error_feedback, "must be True or False",
                        "pass error_feedback=True (residuals per bucket) or False", CommTypeError)
    algorithm = _algorithm(fn, algorithm)
    resolve_group(group, fn)
    return DDPHookState(c, error_feedback, group, algorithm), compressed_allreduce_hook
