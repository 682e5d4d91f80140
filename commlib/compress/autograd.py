"""Differentiable compressed communication for model parallelism: tensor-parallel collectives and
pipeline activations whose forward moves compressed bytes and whose backward is exact or
compressed, chosen by an argument.

**Tensor parallelism.** Each function is one step forward and one step backward (the gradient
of the input); which step backward depends on what the forward's output means, as in Megatron's
``mappings.py``:

=====================  =======================  ================================  ====================
function               forward                  backward (the input's gradient)   for
=====================  =======================  ================================  ====================
``all_reduce_fn``      all-reduce (compressed)  all-reduce (exact or compressed)  each rank's own loss
``reduce_fn``          all-reduce (compressed)  identity                          Megatron's *g*
``copy_fn``            identity                 all-reduce (exact or compressed)  Megatron's *f*
``reduce_scatter_fn``  reduce-scatter of dim 0  all-gather of dim 0               sequence parallel
``all_gather_fn``      all-gather of dim 0      reduce-scatter of dim 0           sequence parallel
=====================  =======================  ================================  ====================

``all_reduce_fn`` is for a total loss that is the sum of every rank's own loss on its copy of
the sum: the all-reduce is its own adjoint (as ``torch.distributed.nn.all_reduce``). ``reduce_fn``
is a row-parallel layer's output reduction: the output is replicated and its loss counted once
(commlib.nn's convention), so its gradient passes through. ``copy_fn`` is a column-parallel
layer's replicated input, whose partial gradients are summed. The last two are sequence
parallelism's pair (Megatron's ``reduce_scatter_to_sequence_parallel_region`` and
``gather_from_sequence_parallel_region``).

The forward never writes into its input (it reduces a copy) and the backward never writes into
the incoming gradient. ``algorithm`` is :func:`commlib.compress.all_reduce`'s (``"auto"``: exact
where the cost model says compression does not pay, which on one host is always; pass
``"compressed"`` to force the codec); reduce-scatter and all-gather always run the codec.

**Pipeline activations.** :func:`send_activation` / :func:`recv_activation` move a stage's
output to the next stage compressed, and its gradient back, exact or compressed (both ends pass
the same ``codec``, ``backward`` and ``tag``). The protocol, per micro-batch and pair of stages
(what Megatron's ``p2p_communication`` does with explicit ``send_backward`` / ``recv_backward``,
here inside autograd)::

    sender (stage s)                              receiver (stage s + 1)
    y = stage(x)
    token = send_activation(y, dst, codec=c)  ->  h = recv_activation(y.shape, y.dtype, src, codec=c)
      (forward: compressed send of y)               (forward: receive, decode; h requires grad)
                                                    loss = rest(h); loss.backward()
    token.backward()                          <-      (h's backward: sends dL/dh to src)
      (token's backward: receives dL/dy,
       then backpropagates through stage)

The token is a 0-d zero tensor in the graph of ``y``: ``token.backward()`` (or adding it to
this stage's own loss) runs the sender's backward. The gradient goes back on the same ``tag``,
in the opposite direction: give each stream of activations between the same two ranks its own
tag when activations flow both ways between them. The receiver's backward must run (``h`` must
reach its loss): the sender's backward waits for the gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import commlib
from commlib.api.entry import checked_call
from commlib.errors import CommTypeError, arg_error

from . import collectives
from .codec import Codec, as_codec, check_dtype, check_values

__all__ = ["all_reduce_fn", "reduce_fn", "copy_fn", "reduce_scatter_fn", "all_gather_fn",
           "send_activation", "recv_activation", "BACKWARD"]

# backward= of the functions whose backward communicates
BACKWARD = ("exact", "compressed")


# ----- one step: a collective, exact (codec None) or compressed, returning a new tensor ---------
class Step(NamedTuple):
    """What one direction of a differentiable collective runs: ``op`` (a key of ``_OPS``) on
    ``group``, with ``codec`` (None: the exact commlib collective) and ``algorithm`` (the
    compressed all-reduce's)."""
    op: str
    codec: Codec | None
    group: object
    algorithm: str


def _identity(t: torch.Tensor, s: Step) -> torch.Tensor:
    return t.view_as(t)


def _all_reduce(t: torch.Tensor, s: Step) -> torch.Tensor:
    out = t.clone(memory_format=torch.contiguous_format)
    if s.codec is None:
        commlib.all_reduce(out, group=s.group)
    else:
        collectives.all_reduce(out, codec=s.codec, group=s.group, algorithm=s.algorithm)
    return out


def _reduce_scatter(t: torch.Tensor, s: Step) -> torch.Tensor:
    """Dim 0 cut into group-size blocks; rank r gets block r of the sum."""
    out = t.new_empty((t.shape[0] // s.group.size,) + tuple(t.shape[1:]))
    if s.codec is None:
        commlib.reduce_scatter_tensor(out, t.contiguous(), group=s.group)
    else:
        collectives.reduce_scatter_tensor(out, t.contiguous(), codec=s.codec, group=s.group)
    return out


def _all_gather(t: torch.Tensor, s: Step) -> torch.Tensor:
    """Every rank's ``t`` stacked along dim 0 in rank order."""
    out = t.new_empty((t.shape[0] * s.group.size,) + tuple(t.shape[1:]))
    if s.codec is None:
        commlib.all_gather_into_tensor(out, t.contiguous(), group=s.group)
    else:
        collectives.all_gather_into_tensor(out, t.contiguous(), codec=s.codec, group=s.group)
    return out


_OPS = {"identity": _identity, "all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter,
        "all_gather": _all_gather}


def _run(s: Step, t: torch.Tensor) -> torch.Tensor:
    if s.op != "identity" and s.group.size == 1:
        return t.clone()  # nothing to exchange; still a new tensor
    return _OPS[s.op](t, s)


class _Collective(torch.autograd.Function):
    """``forward``: one step; ``backward``: the other (the table in the module docstring)."""

    @staticmethod
    def forward(ctx, x, fwd: Step, bwd: Step):
        ctx.bwd = bwd
        return _run(fwd, x)

    @staticmethod
    def backward(ctx, dy):
        return _run(ctx.bwd, dy), None, None


# ----- checks -----------------------------------------------------------------------------------
def _backward(fn: str, backward) -> str:
    if backward not in BACKWARD:
        raise arg_error(fn, "backward", backward, f"must be one of {BACKWARD}",
                        "pass backward='exact' (the gradient's collective uncompressed) or "
                        "'compressed' (with the same codec)")
    return backward


def _rows(fn: str, x: torch.Tensor, size: int, what: str) -> None:
    if x.dim() == 0 or x.shape[0] % size:
        s = x.shape[0] if x.dim() else 0
        raise arg_error(fn, "x", f"<tensor shape={tuple(x.shape)}>",
                        f"dim 0 must have a multiple of the group size {size} rows ({what})",
                        f"pad dim 0 to a multiple of {size} (e.g. {s + (-s) % size})")


def _collective(fn: str, x, codec, group, fwd: str, bwd: str, backward: str,
                algorithm: str, rows: str | None = None) -> torch.Tensor:
    """Check the arguments of one of the tensor-parallel functions and apply it: ``fwd`` runs
    with the codec, ``bwd`` with it if ``backward='compressed'``, exact otherwise."""
    with checked_call(fn, group) as (g, call):
        check_values(fn, "x", x)
        c = as_codec(codec)
        backward = _backward(fn, backward)
        algorithm = collectives._algorithm(fn, algorithm)
        if rows is not None:
            _rows(fn, x, g.size, rows)
        call.update(shape=tuple(x.shape), dtype=str(x.dtype), codec=repr(c), backward=backward,
                    algorithm=algorithm)
    back = Step(bwd, c if backward == "compressed" else None, g, algorithm)
    return _Collective.apply(x, Step(fwd, c, g, algorithm), back)


# ----- tensor parallelism -------------------------------------------------------------------------
def all_reduce_fn(x: torch.Tensor, *, codec, group=None, backward: str = "exact",
                  algorithm: str = "auto") -> torch.Tensor:
    """The sum of every rank's ``x``, all-reduced compressed; differentiable for a total loss
    that is the sum of every rank's own loss: ``x``'s gradient is the all-reduce of the output
    gradients (exact, or with ``codec`` when ``backward='compressed'``).

    Args:
        x: float32, bfloat16 or float16, any shape (the same on every rank).
        codec: a codec name or :class:`~commlib.compress.Codec`.
        backward: ``"exact"`` or ``"compressed"``.
        algorithm: :func:`commlib.compress.all_reduce`'s, for both directions.

    Example (2 ranks, ``x = torch.full((4,), rank + 1.0, requires_grad=True)``):
    ``y = all_reduce_fn(x, codec="int8", algorithm="compressed")`` is ``[3, 3, 3, 3]`` within the
    int8 bound on both; after ``y.backward(torch.full((4,), rank + 1.0))`` both ranks hold
    ``x.grad == [3, 3, 3, 3]``.
    """
    return _collective("compress.all_reduce_fn", x, codec, group, "all_reduce", "all_reduce",
                       backward, algorithm)


def reduce_fn(x: torch.Tensor, *, codec, group=None, algorithm: str = "auto") -> torch.Tensor:
    """Megatron's *g* (``reduce_from_tensor_parallel_region``): the compressed all-reduce of the
    partial sums ``x`` forward, the identity backward (the output is replicated and its loss is
    counted once, commlib.nn's convention: the gradient arriving on each rank is already the
    whole one). A row-parallel linear's output reduction."""
    return _collective("compress.reduce_fn", x, codec, group, "all_reduce", "identity", "exact",
                       algorithm)


def copy_fn(x: torch.Tensor, *, codec, group=None, backward: str = "compressed",
            algorithm: str = "auto") -> torch.Tensor:
    """Megatron's *f* (``copy_to_tensor_parallel_region``): the identity forward on a replicated
    ``x``; backward, the all-reduce of every rank's partial input gradient, compressed with
    ``codec`` (its only collective, hence the default) or ``backward='exact'``. A
    column-parallel linear's input."""
    return _collective("compress.copy_fn", x, codec, group, "identity", "all_reduce", backward,
                       algorithm)


def reduce_scatter_fn(x: torch.Tensor, *, codec, group=None,
                      backward: str = "exact") -> torch.Tensor:
    """Rank r gets rows ``[r s/N, (r+1) s/N)`` of the sum of every rank's ``x`` (``s`` rows on
    dim 0, compressed reduce-scatter); backward, the all-gather of the row gradients along dim 0
    (exact, or with ``codec``). Sequence parallelism's row-parallel output (Megatron's
    ``reduce_scatter_to_sequence_parallel_region``): every rank's loss on its rows, summed."""
    return _collective("compress.reduce_scatter_fn", x, codec, group, "reduce_scatter",
                       "all_gather", backward, "auto", rows="reduce-scatter cuts it into one "
                       "block per rank")


def all_gather_fn(x: torch.Tensor, *, codec, group=None, backward: str = "exact") -> torch.Tensor:
    """Every rank's ``x`` stacked along dim 0 in rank order, each sent compressed (every rank
    decodes every block, its own too, so all hold the same values); backward, the reduce-scatter
    of the gradient along dim 0 (exact, or with ``codec``). Sequence parallelism's
    column-parallel input (Megatron's ``gather_from_sequence_parallel_region``)."""
    return _collective("compress.all_gather_fn", x, codec, group, "all_gather",
                       "reduce_scatter", backward, "auto")


# ----- pipeline activations -----------------------------------------------------------------------
class Peer(NamedTuple):
    """The other end of an activation's trip: its world rank, the codec forward, the codec of
    the gradient's trip back (None: exact), the group and the tag."""
    rank: int
    codec: Codec
    grad_codec: Codec | None
    group: object
    tag: int


def _send(t: torch.Tensor, c: Codec | None, p: Peer) -> None:
    if c is None:
        commlib.send(t.contiguous(), p.rank, group=p.group, tag=p.tag)
    else:
        collectives.send(t, p.rank, codec=c, group=p.group, tag=p.tag)


def _recv(t: torch.Tensor, c: Codec | None, p: Peer) -> torch.Tensor:
    if c is None:
        commlib.recv(t, p.rank, group=p.group, tag=p.tag)
    else:
        collectives.recv(t, p.rank, codec=c, group=p.group, tag=p.tag)
    return t


class _SendActivation(torch.autograd.Function):
    """Forward: send ``x`` compressed, return a 0-d token; backward: receive ``x``'s gradient."""

    @staticmethod
    def forward(ctx, x, peer: Peer):
        ctx.peer, ctx.shape, ctx.dtype, ctx.device = peer, x.shape, x.dtype, x.device
        _send(x, peer.codec, peer)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        return _recv(grad, ctx.peer.grad_codec, ctx.peer), None


class _RecvActivation(torch.autograd.Function):
    """Forward: receive the activation (``anchor``, an empty tensor requiring grad, puts it in
    the graph); backward: send its gradient back."""

    @staticmethod
    def forward(ctx, anchor, shape, dtype, peer: Peer):
        ctx.peer = peer
        return _recv(torch.empty(shape, dtype=dtype, device=anchor.device), peer.codec, peer)

    @staticmethod
    def backward(ctx, dx):
        _send(dx, ctx.peer.grad_codec, ctx.peer)
        return None, None, None, None


def _peer(fn: str, arg: str, rank, codec, group, backward, tag) -> Peer:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise arg_error(fn, arg, rank, "must be a world rank (int)",
                        f"pass {arg}=<the other stage's world rank>", CommTypeError)
    c = as_codec(codec)
    backward = _backward(fn, backward)
    return Peer(rank, c, c if backward == "compressed" else None, group, tag)


def send_activation(x: torch.Tensor, dst: int, *, codec, group=None, backward: str = "exact",
                    tag: int = 0) -> torch.Tensor:
    """Send a pipeline stage's output ``x`` to world rank ``dst`` compressed with ``codec``
    (blocking, as :func:`commlib.compress.send`); return a 0-d token (zero, ``x``'s dtype) whose
    backward receives ``x``'s gradient from ``dst`` (exact, or with ``codec`` when
    ``backward='compressed'``: the receiver passes the same) and backpropagates it into ``x``'s
    graph. See the module docstring for the protocol.

    Example (stage 0 on rank 0)::

        token = send_activation(stage0(x), 1, codec="int8")
        token.backward()      # after rank 1's loss.backward(): x's graph gets the gradient
    """
    fn = "compress.send_activation"
    check_values(fn, "x", x)
    peer = _peer(fn, "dst", dst, codec, group, backward, tag)
    return _SendActivation.apply(x, peer)


def recv_activation(shape, dtype: torch.dtype, src: int, *, codec, group=None,
                    backward: str = "exact", tag: int = 0, device=None) -> torch.Tensor:
    """Receive the activation that :func:`send_activation` sent from world rank ``src``: a new
    tensor of ``shape`` and ``dtype`` (the sender's) that requires grad; its backward sends the
    gradient to ``src`` (exact, or with ``codec`` when ``backward='compressed'``).

    Example (stage 1 on rank 1)::

        h = recv_activation((8, 64), torch.float32, 0, codec="int8")
        stage1(h).sum().backward()        # sends dL/dh to rank 0
    """
    fn = "compress.recv_activation"
    check_dtype(fn, "dtype", dtype)
    try:
        size = torch.Size(shape)
    except TypeError:
        raise arg_error(fn, "shape", shape, "is not a shape", "pass the sender's x.shape",
                        CommTypeError) from None
    peer = _peer(fn, "src", src, codec, group, backward, tag)
    anchor = torch.empty(0, dtype=dtype, device=device, requires_grad=True)
    return _RecvActivation.apply(anchor, size, dtype, peer)
