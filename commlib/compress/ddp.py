"""A communication hook for ``torch.nn.parallel.DistributedDataParallel`` that averages each
gradient bucket with :func:`commlib.compress.all_reduce` (with error feedback by default)::

    ddp = DistributedDataParallel(model)                 # gloo or NCCL, any torch.distributed group
    ddp.register_comm_hook(*commlib.compress.ddp_hook("int8"))

**Overlap.** DDP calls a bucket's hook from inside the backward pass as soon as the bucket's
gradients are ready. By default (``overlap=False``) the hook runs the all-reduce to the end and
returns a completed future, so the rest of the backward waits for it. With ``overlap=True``, or
``"auto"`` where the group's collectives can overlap compute (a progress thread serves it: ranks
on several hosts, or a host with a core free), the hook hands the bucket to one thread of its
own, which runs the buckets' compressed all-reduces one after another in the order DDP gave them
(so every rank issues the group's collectives in one order), and returns a future that thread
completes: the backward of the remaining layers runs meanwhile, as with DDP's default hook. The
caller must then issue no other collective on the hook's group until DDP has the futures (the
end of the backward): the two threads' collectives would meet in different orders on different
ranks. Measured on the multi-host cluster of this machine (two hosts sharing 2 cores), the
thread gained nothing: the codec and the network's work run on the cores that compute
(docs/compression.md). A failure in the thread ends the process with the error printed, or makes
the future raise under ``COMMLIB_TIMEOUT_MODE=raise`` (:func:`commlib.api.entry.fail_future`:
DDP's reducer cannot take a Python exception).

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

import queue
import threading
from typing import Callable

import torch

from commlib.api.entry import fail_future
from commlib.api.groups import resolve_group
from commlib.errors import CommTypeError, arg_error
from commlib.ops import ReduceOp
from commlib.runtime.progress import overlaps

from .codec import Codec, as_codec
from .collectives import _algorithm, all_reduce
from .feedback import ErrorFeedback

__all__ = ["ddp_hook", "DDPHookState", "compressed_allreduce_hook"]


class DDPHookState:
    """What :func:`compressed_allreduce_hook` carries across calls.

    ``codec``, ``group``, ``algorithm``: those of the all-reduce. ``error_feedback``: whether
    residuals are kept. ``overlap``: whether the all-reduces run on the state's own thread.
    ``calls``: buckets handed to the hook so far (a check that DDP runs it). ``resets``:
    residuals started afresh because a bucket index changed layout (DDP's rebuild after the
    first iteration).
    """

    def __init__(self, codec: Codec, error_feedback: bool, group, algorithm: str,
                 overlap: bool = False):
        self.codec, self.error_feedback = codec, error_feedback
        self.group, self.algorithm, self.overlap = group, algorithm, overlap
        self.calls = self.resets = 0
        self._feedback: dict[int, ErrorFeedback] = {}
        self._layout: dict[int, tuple] = {}
        self._worker: _Worker | None = None

    def submit(self, run: Callable[[], torch.Tensor]):
        """A future of ``run()``: run here and complete, or queued on the state's thread."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if not self.overlap:
            fut.set_result(run())
            return fut
        if self._worker is None:
            self._worker = _Worker()
        self._worker.tasks.put((run, fut))
        return fut

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


class _Worker:
    """The thread that runs one hook state's all-reduces, in the order the hook queued them."""

    def __init__(self):
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="commlib-ddp-hook", daemon=True).start()

    def _run(self) -> None:
        while True:
            run, fut = self.tasks.get()
            try:
                result = run()
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the future
                fail_future(exc, fut)
                continue
            fut.set_result(result)


# ``bucket`` and the result are not annotated: DDP's register_comm_hook compares those
# annotations with the classes dist.GradBucket and torch.futures.Future[torch.Tensor], and this
# module's annotations are strings.
def compressed_allreduce_hook(state: DDPHookState, bucket):
    """Average ``bucket`` (a ``torch.distributed.GradBucket``)'s flat gradient buffer over
    ``state.group`` in place with :func:`commlib.compress.all_reduce`; return a
    ``torch.futures.Future[torch.Tensor]`` holding it: completed, or completed by the state's
    thread under ``state.overlap``."""
    buf, feedback, index = bucket.buffer(), state.feedback(bucket), bucket.index()

    def run() -> torch.Tensor:
        all_reduce(buf, codec=state.codec, op=ReduceOp.AVG, group=state.group,
                   error_feedback=feedback, algorithm=state.algorithm, key=index)
        return buf

    state.calls += 1
    return state.submit(run)


def ddp_hook(codec, *, error_feedback: bool = True, group=None, algorithm: str = "auto",
             overlap=False) -> tuple[DDPHookState, Callable]:
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
        overlap: ``False`` (default): each all-reduce runs in the hook. ``True``: on a thread
            of the hook's own, behind the backward pass. ``"auto"``: on the thread where a
            progress thread serves the group (ranks on several hosts, or a host with a core
            free), else in the hook (module docstring).

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
    if not (isinstance(overlap, bool) or overlap == "auto"):
        raise arg_error(fn, "overlap", overlap, "must be True, False or 'auto'",
                        "pass overlap=False (in the hook), True (on the hook's thread) or "
                        "'auto' (the thread where the group's collectives can overlap compute)")
    g = resolve_group(group, fn)
    if overlap == "auto":
        overlap = overlaps(g)
    return (DDPHookState(c, error_feedback, group, algorithm, overlap),
            compressed_allreduce_hook)
