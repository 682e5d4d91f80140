"""Sequence-parallel attention, functional form.

Every rank of a sequence-parallel group holds a shard of the sequence; tensors are shaped
``(batch, seq_local, heads, head_dim)`` as in flash-attention. See ``docs/sequence-parallel.md``.

Example (2 ranks, total length 8, zigzag layout: rank 0 holds tokens 0,1,6,7; rank 1 holds
2,3,4,5)::

    x = torch.randn(1, 8, 4, 16)                 # the same full tensor on every rank
    q = shard_sequence(x, dim=1)                 # (1, 4, 4, 16): this rank's tokens
    out = ring_attention(q, q, q, causal=True)   # this rank's rows of full causal attention
    full = unshard_sequence(out, dim=1)          # (1, 8, 4, 16), in global order, on every rank
"""

from __future__ import annotations

import contextlib
import math

import torch

import commlib
from commlib.runtime import debug
from commlib.errors import CommError, CommTypeError, arg_error
from commlib.api.groups import resolve_group

from ._layout import LAYOUTS, gather_order, global_chunks
from ._plan import plan_ring
from ._ring import RingAttention, RSAAttention

__all__ = ["ring_attention", "ulysses_attention", "shard_sequence", "unshard_sequence",
           "ALGORITHMS", "default_head_chunks", "default_seq_chunks"]

# algorithm= of ring_attention: the autograd function that runs it
ALGORITHMS = {"ring": RingAttention, "rsa": RSAAttention}


# ----- checks ----------------------------------------------------------------------------------
@contextlib.contextmanager
def _entry(fn: str, group):
    """Validate a public call: yields (the group, a dict the checks fill with the call's
    description). Under ``COMMLIB_DEBUG=1`` the ranks then compare descriptions (shapes, dtype,
    layout, options) with one small all-gather, so ranks that disagree, or a rank whose own
    checks failed, raise on every rank instead of hanging in the ring."""
    g = resolve_group(group, fn)
    call: dict = {}
    try:
        yield g, call
    except CommError as exc:
        if g.debug:
            debug.agree(g, fn, "", error=exc)
        raise
    if g.debug:
        debug.agree(g, fn, f"{fn}(" + ", ".join(f"{k}={v}" for k, v in call.items()) + ")")


def _shapes(**tensors) -> dict:
    return {name: f"{tuple(t.shape)}:{str(t.dtype)[6:]}" for name, t in tensors.items()}


def _choice(fn: str, arg: str, value, table) -> None:
    if not isinstance(value, str) or value not in table:
        raise arg_error(fn, arg, value, f"must be one of {sorted(table)}",
                        f"pass {arg}={sorted(table)[0]!r} or another listed name")


def _qkv(fn: str, q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise arg_error(fn, name, type(t).__name__, "must be a torch.Tensor",
                            "pass torch tensors shaped (batch, seq_local, heads, head_dim)",
                            CommTypeError)
        if t.dim() != 4:
            raise arg_error(fn, name, f"<tensor shape={tuple(t.shape)}>",
                            "must be 4-D (batch, seq_local, heads, head_dim)",
                            "reshape to (batch, seq_local, heads, head_dim), as flash-attention")
        if not t.is_floating_point():
            raise arg_error(fn, name, f"<tensor dtype={t.dtype}>", "must be floating point",
                            "convert to float32/bfloat16/float16/float64", CommTypeError)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise arg_error(fn, name, f"<tensor dtype={t.dtype} device={t.device}>",
                            f"must match q ({q.dtype} on {q.device})", "convert it like q",
                            CommTypeError)
    b, s, h, d = q.shape
    if k.shape != v.shape[:3] + (d,) or k.shape[:2] != (b, s):
        raise arg_error(fn, "k", f"<shape k={tuple(k.shape)} v={tuple(v.shape)}>",
                        f"k must be (batch={b}, seq_local={s}, kv_heads, head_dim={d}) and v "
                        "(batch, seq_local, kv_heads, any)", "give k and v q's batch, length and "
                        "the same number of KV heads")
    if h % k.shape[2]:
        raise arg_error(fn, "k", f"<tensor shape={tuple(k.shape)}>",
                        f"q's {h} heads must be a multiple of the {k.shape[2]} KV heads (GQA)",
                        "use a KV head count that divides the query head count")
    if s == 0:
        raise arg_error(fn, "q", f"<tensor shape={tuple(q.shape)}>", "seq_local must be > 0",
                        "give every rank at least one token")


def _scale(fn: str, softmax_scale, d: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale):
        raise arg_error(fn, "softmax_scale", softmax_scale, "must be a finite number or None",
                        "pass None for 1/sqrt(head_dim)")
    return float(softmax_scale)


def _bool(fn: str, arg: str, value) -> bool:
    if not isinstance(value, bool):
        raise arg_error(fn, arg, value, "must be True or False", f"pass {arg}=True or False",
                        CommTypeError)
    return value


def _divisible(fn: str, arg: str, shape, dim: int, length: int, parts: int, why: str) -> None:
    if length % parts:
        raise arg_error(fn, arg, f"<tensor shape={tuple(shape)}>",
                        f"length {length} along dim {dim} must divide by {parts} ({why})",
                        f"pad the sequence to a multiple of {parts} (e.g. {length + (-length) % parts})"
                        ", masking the padding in the loss")


def default_head_chunks(kv_heads: int, size: int) -> int:
    """One KV head per group on a ring (``kv_heads``; 1 when size is 1): the ring's buffers are
    then 1/kv_heads of the rank's K/V, while each step still computes for milliseconds, far above
    its fixed cost of well under one."""
    return 1 if size == 1 else kv_heads


# Ring passes (head groups x key segments) the default aims at, and the fewest tokens a segment
# takes of each layout chunk. During the backward three pass-sized buffers are in flight (the
# block held, the next one, one set of dK/dV accumulators) and each kernel call returns dK/dV for
# its keys, so with one KV head per group and no segments a rank holds ~1.4 q-sized tensors
# beyond the eight (q, k, v, out, their gradients) it keeps; 2 segments bring that to ~0.8, 3 to
# ~0.65. But every pass adds kernel calls (each paying per query row: dout's copy, merging or
# adding the rows' results) and ring steps (each a synchronization of neighbours): measured at 2
# ranks, 8192 tokens, 2 segments of 1024 cost 3% of the time, 4 of 512 16%. Segments start where
# memory starts to matter, on long sequences.
RING_PASSES, MIN_SEGMENT = 32, 768


def default_seq_chunks(head_chunks: int, chunk: int, size: int) -> int:
    """Key segments per head group: enough for ``RING_PASSES`` passes in all, each taking at least
    ``MIN_SEGMENT`` of the ``chunk`` tokens of every layout chunk (1 when size is 1: nothing
    travels)."""
    if size == 1:
        return 1
    return max(1, min(-(-RING_PASSES // head_chunks), chunk // MIN_SEGMENT))


# ----- ring attention ----------------------------------------------------------------------------
def ring_attention(q, k, v, *, causal: bool = False, group=None, layout: str = "zigzag",
                   softmax_scale: float | None = None, return_lse: bool = False,
                   algorithm: str = "ring", head_chunks: int | None = None,
                   seq_chunks: int | None = None):
    """Exact attention of this rank's queries over the whole sequence, K/V passed around a ring.

    Args:
        q, k, v: this rank's shard, ``(batch, seq_local, heads, head_dim)``; ``k``/``v`` may have
            fewer heads (GQA: ``heads`` a multiple of ``kv_heads``; only KV heads travel).
        causal: mask keys after the query in global order.
        group: the sequence-parallel group (default: the world).
        layout: ``"zigzag"`` (rank r holds chunks r and 2N-1-r of 2N; balanced under ``causal``)
            or ``"contiguous"`` (chunk r of N). Shard with :func:`shard_sequence`.
        softmax_scale: default ``1/sqrt(head_dim)``.
        return_lse: also return the log-sum-exp ``(batch, heads, seq_local)`` (float32, natural
            log; float64 for float64 inputs; not differentiable).
        algorithm: ``"ring"`` (blockwise, online softmax, O(s/N) memory) or ``"rsa"`` (the
            paper's K pass, softmax over full score rows, V pass; O(s_local x s) memory).
        head_chunks: ``"ring"`` only: run the ring once per group of KV heads, ``head_chunks``
            groups (must divide the KV head count): in-flight buffers shrink to 1/head_chunks,
            messages multiply by head_chunks. Default: the KV head count (one KV head per ring
            pass; 1 on one rank).
        seq_chunks: ``"ring"`` only: also cut each head group's keys into this many segments,
            one ring pass each; segment j is the j-th near-equal part of each of the rank's layout
            chunks (1 to the tokens of a chunk; zigzag's balance holds in every pass). Default
            (:func:`default_seq_chunks`): up to 32 passes in all, each segment at least 768 tokens
            of every chunk (1 on one rank): on long sequences the ring's buffers stay a small
            fraction of the rank's own tensors, so peak memory per rank stays near 1/N of one
            process.

    Returns:
        ``out`` shaped like q (and ``lse``): this rank's rows of the full-sequence attention.
    """
    fn = "nn.functional.ring_attention"
    with _entry(fn, group) as (g, call):
        _qkv(fn, q, k, v)
        causal = _bool(fn, "causal", causal)
        return_lse = _bool(fn, "return_lse", return_lse)
        _choice(fn, "layout", layout, LAYOUTS)
        _choice(fn, "algorithm", algorithm, ALGORITHMS)
        scale = _scale(fn, softmax_scale, q.shape[3])
        rank, size = g.rank, g.size
        per = LAYOUTS[layout].chunks_per_rank
        _divisible(fn, "q", q.shape, 1, q.shape[1], per,
                   f"layout {layout!r} holds {per} equal chunks per rank")
        hk = k.shape[2]
        if head_chunks is None:
            head_chunks = default_head_chunks(hk, size) if algorithm == "ring" else 1
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1 \
                or hk % head_chunks or (algorithm != "ring" and head_chunks != 1):
            raise arg_error(fn, "head_chunks", head_chunks,
                            f"must be a positive divisor of the {hk} KV heads (and 1 for rsa)",
                            "pass None for the default, or 1")
        c = q.shape[1] // per  # tokens per layout chunk
        if seq_chunks is None:
            seq_chunks = default_seq_chunks(head_chunks, c, size) if algorithm == "ring" else 1
        if isinstance(seq_chunks, bool) or not isinstance(seq_chunks, int) or seq_chunks < 1 \
                or seq_chunks > c or (algorithm != "ring" and seq_chunks != 1):
            raise arg_error(fn, "seq_chunks", seq_chunks,
                            f"must be an int from 1 to the {c} tokens of a layout chunk (and 1 "
                            "for rsa)", "pass None for the default, or 1")
        call.update(_shapes(q=q, k=k, v=v), causal=causal, layout=layout, algorithm=algorithm,
                    scale=scale, head_chunks=head_chunks, seq_chunks=seq_chunks)
    plan = plan_ring(rank, size, causal, layout)
    out, lse = ALGORITHMS[algorithm].apply(q, k, v, causal, scale, group, plan, head_chunks,
                                           seq_chunks)
    return (out, lse) if return_lse else out


# ----- Ulysses -------------------------------------------------------------------------------
def _seq_to_heads(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """(b, s/N, h, d) sharded by sequence -> (b, s, h/N, d) sharded by heads (contiguous)."""
    b, sl, h, d = x.shape
    send = x.reshape(b, sl, size, h // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    commlib.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, size * sl, h // size, d)


def _heads_to_seq(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    b, s, hl, d = x.shape
    send = x.reshape(b, size, s // size, hl, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    commlib.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * hl, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, to_heads: bool, size: int, group):
        ctx.args = (to_heads, size, group)
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, size, group)

    @staticmethod
    def backward(ctx, g):
        to_heads, size, group = ctx.args
        return (_heads_to_seq if to_heads else _seq_to_heads)(g.contiguous(), size, group), \
            None, None, None


def ulysses_attention(q, k, v, *, causal: bool = False, group=None,
                      softmax_scale: float | None = None):
    """DeepSpeed-Ulysses: all-to-all from sequence shards to head shards, attention on the full
    sequence with heads/N heads per rank, all-to-all back. Contiguous layout (rank r holds chunk
    r of N); both the query and the KV head counts must divide by the group size."""
    fn = "nn.functional.ulysses_attention"
    with _entry(fn, group) as (g, call):
        _qkv(fn, q, k, v)
        causal = _bool(fn, "causal", causal)
        scale = _scale(fn, softmax_scale, q.shape[3])
        size = g.size
        for name, t in (("q", q), ("k", k)):
            if t.shape[2] % size:
                raise arg_error(fn, name, f"<tensor shape={tuple(t.shape)}>",
                                f"its {t.shape[2]} heads must divide by the group size {size} "
                                "(Ulysses gives each rank heads/N whole heads)",
                                "use ring_attention (no head rule), or a group size that divides "
                                "the query and KV head counts")
        call.update(_shapes(q=q, k=k, v=v), causal=causal, scale=scale)
    if size == 1:
        qh, kh, vh = q, k, v
    else:
        qh, kh, vh = (_AllToAll.apply(t, True, size, group) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), is_causal=causal, scale=scale,
        enable_gqa=qh.shape[2] != kh.shape[2]).transpose(1, 2)
    return out if size == 1 else _AllToAll.apply(out, False, size, group)


# ----- sharding helpers -------------------------------------------------------------------------
def _dim(fn: str, x, dim):
    if not isinstance(x, torch.Tensor):
        raise arg_error(fn, "x", type(x).__name__, "must be a torch.Tensor", "pass a tensor",
                        CommTypeError)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise arg_error(fn, "dim", dim, f"must be a dimension of the {x.dim()}-D tensor",
                        f"pass 0..{x.dim() - 1} (the sequence dimension)")
    return dim % x.dim()


def _slice(x: torch.Tensor, dim: int, layout: str, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s chunks of the full tensor ``x`` along ``dim``, concatenated."""
    c = x.shape[dim] // (LAYOUTS[layout].chunks_per_rank * size)
    return torch.cat([x.narrow(dim, g * c, c) for g in global_chunks(layout, rank, size)], dim)


def shard_sequence(x: torch.Tensor, dim: int = 1, layout: str = "zigzag", group=None) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` (the same on every rank) along ``dim``: chunk r
    of N (``contiguous``) or chunks r and 2N-1-r of 2N (``zigzag``). Differentiable (a slice)."""
    fn = "nn.functional.shard_sequence"
    dim = _dim(fn, x, dim)
    _choice(fn, "layout", layout, LAYOUTS)
    rank, size = commlib.get_rank(group), commlib.get_world_size(group)
    n = LAYOUTS[layout].chunks_per_rank * size
    _divisible(fn, "x", x.shape, dim, x.shape[dim], n,
               f"layout {layout!r} on {size} ranks cuts the sequence into {n} equal chunks")
    return _slice(x, dim, layout, rank, size)


# grad= of unshard_sequence: how the full-sequence gradient arriving at each rank becomes the
# gradient of its shard
UNSHARD_GRADS = ("sum", "local")


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, layout, size, rank, group, grad):
        ctx.args = (dim, layout, rank, size, group, grad)
        front = x.movedim(dim, 0).contiguous()
        out = torch.empty((size * front.shape[0],) + front.shape[1:], dtype=x.dtype, device=x.device)
        commlib.all_gather_into_tensor(out, front, group=group)
        order = gather_order(layout, size)
        parts = out.chunk(len(order))
        full = torch.cat([parts[order.index(g)] for g in range(len(order))])
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, g):
        dim, layout, rank, size, group, grad = ctx.args
        if grad == "local" or size == 1:
            return _slice(g, dim, layout, rank, size), None, None, None, None, None, None
        # "sum": the adjoint of the all-gather, a reduce-scatter of every rank's full gradient
        # (rank-ordered: rank r's chunks first, then rank r+1's, ...)
        front = g.movedim(dim, 0)
        c = front.shape[0] // len(gather_order(layout, size))
        ordered = torch.cat([front[i * c:(i + 1) * c] for i in gather_order(layout, size)])
        mine = torch.empty((ordered.shape[0] // size,) + ordered.shape[1:], dtype=g.dtype,
                           device=g.device)
        commlib.reduce_scatter_tensor(mine, ordered, group=group)
        return mine.movedim(0, dim), None, None, None, None, None, None


def unshard_sequence(x: torch.Tensor, dim: int = 1, layout: str = "zigzag", group=None,
                     grad: str = "sum") -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: all-gathers every rank's shard and returns the full
    tensor in global order on every rank.

    Differentiable. ``grad`` says what the result's gradient means:

    * ``"sum"`` (default): the exact gradient of the sum of every rank's loss (the convention of
      the rest of commlib.nn, whose weight gradients are summed over the group): each shard gets
      the sum over ranks of their full-sequence gradients at its positions (a reduce-scatter,
      the adjoint of the all-gather). A loss computed identically on every rank from the full
      tensor therefore counts N times: scale it by 1/N, or use ``"local"``.
    * ``"local"``: no communication; the shard gets this rank's own full-sequence gradient at its
      positions. Exact when every rank computes the same loss from the full tensor.

    Example (2 ranks, zigzag): ``full = unshard_sequence(y)`` then ``full.sum().backward()``
    on both ranks gives ``y.grad`` = 2 everywhere with ``grad="sum"`` and 1 with ``"local"``.
    """
    fn = "nn.functional.unshard_sequence"
    with _entry(fn, group) as (g, call):
        dim = _dim(fn, x, dim)
        _choice(fn, "layout", layout, LAYOUTS)
        if grad not in UNSHARD_GRADS:
            raise arg_error(fn, "grad", grad, f"must be one of {list(UNSHARD_GRADS)}",
                            "pass grad='sum' (sum of every rank's loss) or 'local'")
        per = LAYOUTS[layout].chunks_per_rank
        _divisible(fn, "x", x.shape, dim, x.shape[dim], per,
                   f"layout {layout!r} holds {per} equal chunks per rank")
        call.update(_shapes(x=x), dim=dim, layout=layout, grad=grad)
    return _Gather.apply(x, dim, layout, g.size, g.rank, group, grad)
