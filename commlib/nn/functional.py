"""Sequence-parallel attention, functional form.

Every rank of a sequence-parallel group holds a shard of the sequence; tensors are shaped
``(batch, seq_local, heads, head_dim)`` as in flash-attention. See ``docs/sequence-parallel.md``.

Example (2 ranks, total length 8, zigzag layout: rank 0 holds tokens 0,1,6,7; rank 1 holds
2,3,4,5)::

    x = torch.randn(1, 8, 4, 16)                 # the same full tensor on every rank
    q = shard_sequence(x, dim=1)                 # (1, 4, 4, 16): this rank's tokens
    out = ring_attention(q, q, q, causal=True)   # this rank's rows of full causal attention
    full = unshard_sequence(out, dim=1)          # (1, 8, 4, 16), in global order, on every rank

Tensor parallelism (Megatron-style 1D, the functional form of ``commlib.nn.ColumnParallelLinear``
and ``RowParallelLinear``; see ``docs/overlap.md``): :func:`column_parallel_linear`,
:func:`row_parallel_linear`. The 2-D layout of Optimus-style 2D tensor parallelism
(``docs/tensor-parallel-2d.md``): :func:`split_2d`, :func:`gather_2d`, the vocabulary-parallel
loss :func:`cross_entropy_2d`; :func:`traffic` counts
the bytes this rank sends through the layers' collectives.
"""

from __future__ import annotations

import math

import torch

import commlib
import commlib.overlap
from commlib.api.entry import checked_call
from commlib.errors import CommTypeError, arg_error

from ._cross_entropy_2d import cross_entropy_2d
from ._grid import gather_2d, split_2d
from ._layout import LAYOUTS, gather_order, global_chunks
from ._plan import plan_ring
from ._ring import RingAttention, RSAAttention
from ._traffic import traffic

__all__ = ["ring_attention", "ulysses_attention", "shard_sequence", "unshard_sequence",
           "ALGORITHMS", "default_head_chunks", "default_seq_chunks",
           "column_parallel_linear", "row_parallel_linear", "DEFAULT_OVERLAP_CHUNKS",
           "split_2d", "gather_2d", "traffic", "cross_entropy_2d"]

# algorithm= of ring_attention: the autograd function that runs it
ALGORITHMS = {"ring": RingAttention, "rsa": RSAAttention}


# ----- checks ----------------------------------------------------------------------------------


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
    with checked_call(fn, group) as (g, call):
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
    with checked_call(fn, group) as (g, call):
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
    with checked_call(fn, group) as (g, call):
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


# ----- tensor parallelism (Megatron-style 1D) ---------------------------------------------------
# Two linear maps with a weight sharded over a group of N ranks (Shoeybi et al., Megatron-LM, and
# Korthikanti et al. for sequence parallelism), each one autograd function holding the layer's
# collectives so that, with overlap, they run while the other half of the step computes:
#
#   column (weight rows, i.e. output features, sharded):  forward          backward (input grad)
#     sequence_parallel=False  ("f")                       identity         all-reduce
#     sequence_parallel=True                               all-gather dim 0 reduce-scatter dim 0
#   row (weight columns, i.e. input features, sharded):   forward (output) backward
#     sequence_parallel=False  ("g")                       all-reduce       identity
#     sequence_parallel=True                               reduce-scatter 0 all-gather dim 0
#
# Sequence-parallel activations follow Megatron's [s, b, h] convention: the sequence is dim 0 and
# rank r holds rows [r * s/N, (r + 1) * s/N) (the contiguous layout: shard_sequence(x, dim=0,
# layout="contiguous")). Gradients: an output that is replicated (row without sequence_parallel,
# column with gather_output) carries one loss computed identically on every rank, counted once;
# an output that is sharded (column without gather_output: by features; row with
# sequence_parallel: by sequence) carries a loss per rank, and the total is their sum. Every
# parameter's gradient is then this total's exact gradient, on every rank that holds it.

# Row chunks of the row-parallel GEMM whose all-reduces overlap the next chunk's GEMM
# (sequence_parallel=False, overlap=True): enough to hide all but one chunk's reduction, few
# enough that each all-reduce still carries at least 1/4 of the output.
DEFAULT_OVERLAP_CHUNKS = 4


def _gather_rows(x: torch.Tensor, g) -> torch.Tensor:
    """All-gather along dim 0 in rank order: ``(s, ...)`` -> ``(N * s, ...)``."""
    x = x.contiguous()
    out = x.new_empty((g.size * x.shape[0],) + tuple(x.shape[1:]))
    commlib.all_gather_into_tensor(out, x, group=g)
    return out


def _scatter_rows(x: torch.Tensor, g, async_op: bool = False):
    """Reduce-scatter along dim 0: ``(N * s, ...)`` summed over ranks -> rank r's ``(s, ...)``."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // g.size,) + tuple(x.shape[1:]))
    return out, commlib.reduce_scatter_tensor(out, x, group=g, async_op=async_op)


def _sum_ranks(x: torch.Tensor, g, async_op: bool = False):
    """All-reduce (sum) in place; (tensor, Work)."""
    return x, commlib.all_reduce(x, group=g, async_op=async_op)


def _row_bounds(m: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` near-equal, non-empty row ranges covering ``[0, m)`` (fewer if m is smaller)."""
    c = max(1, min(chunks, m))
    return [(i * m // c, (i + 1) * m // c) for i in range(c)]


def _matmul_sum_chunked(x: torch.Tensor, weight: torch.Tensor, g, chunks: int) -> torch.Tensor:
    """``x @ weight.T`` summed over the group, cut into row chunks: each chunk's all-reduce is
    posted as soon as its GEMM is done and progresses while the next chunk computes."""
    x2 = x.reshape(-1, x.shape[-1])
    out = x2.new_empty((x2.shape[0], weight.shape[0]))
    works = []
    for a, b in _row_bounds(x2.shape[0], chunks):
        torch.matmul(x2[a:b], weight.t(), out=out[a:b])
        works.append(commlib.all_reduce(out[a:b], group=g, async_op=True))
        for w in works[:-1]:
            w.is_completed()  # advance the earlier chunks' reductions (never blocks)
    for w in works:
        w.wait()
    return out.view(tuple(x.shape[:-1]) + (weight.shape[0],))


class _ColumnLinear(torch.autograd.Function):
    """``y = x_full W^T + b``, W sharded by rows. Forward: ``x_full`` is x (Megatron's f) or the
    all-gather of the sequence shards. Backward: the input gradient, a partial sum on each rank,
    is all-reduced (or reduce-scattered); with ``overlap`` it travels while the weight gradient is
    computed (Megatron's async gradient all-reduce). A sequence-parallel input is kept as its
    shard only (activation memory s/N) and gathered again for the weight gradient. (With both
    sequence_parallel and overlap the layer runs commlib.overlap.all_gather_matmul instead.)"""

    @staticmethod
    def forward(ctx, x, weight, bias, g, sp, overlap):
        comm = g.size > 1
        full = _gather_rows(x, g) if sp and comm else x
        ctx.save_for_backward(x, weight)
        ctx.args = (g, sp, overlap, bias is not None)
        return torch.nn.functional.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        g, sp, overlap, has_bias = ctx.args
        comm = g.size > 1
        full = _gather_rows(x, g) if sp and comm and ctx.needs_input_grad[1] else x
        dx = work = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(weight)  # this rank's term of the input gradient
            if comm:
                dx, work = (_scatter_rows if sp else _sum_ranks)(dx, g, overlap)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = dy2.t().matmul(full.reshape(-1, full.shape[-1])) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        return dx, dw, db, None, None, None


class _RowLinear(torch.autograd.Function):
    """``y = sum over ranks of x_r W_r^T, + b``, W sharded by columns. Forward: all-reduce
    (Megatron's g; with ``overlap``, in row chunks, each reduced while the next one computes) or
    reduce-scatter along dim 0 (sequence_parallel); the replicated bias is added once, after the
    reduction. Backward: identity, or the all-gather of the sequence-sharded output gradient,
    whose row sum is then the bias's exact gradient on every rank (no extra reduction)."""

    @staticmethod
    def forward(ctx, x, weight, bias, g, sp, overlap, chunks):
        comm = g.size > 1
        ctx.save_for_backward(x, weight)
        ctx.args = (g, sp, bias is not None)
        if sp and comm:
            y = _scatter_rows(x.matmul(weight.t()), g)[0]
        elif comm and overlap and chunks > 1:
            y = _matmul_sum_chunked(x, weight, g, chunks)
        else:
            y = x.matmul(weight.t())
            if comm:
                commlib.all_reduce(y, group=g)
        return y if bias is None else y.add_(bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        g, sp, has_bias = ctx.args
        if sp and g.size > 1:
            dy = _gather_rows(dy, g)
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = dy2.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None


class _SumBiasGrad(torch.autograd.Function):
    """``y + b`` for a replicated bias on a sequence-sharded output: the bias's gradient (this
    rank's rows only) is summed over the group in backward, so that it is exact on every rank."""

    @staticmethod
    def forward(ctx, y, bias, g):
        ctx.g = g
        return y + bias

    @staticmethod
    def backward(ctx, dy):
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        if db is not None and ctx.g.size > 1:
            commlib.all_reduce(db, group=ctx.g)
        return dy, db, None


class _GatherLast(torch.autograd.Function):
    """All-gather along the last dim (rank order); backward: this rank's columns (Megatron's
    gather_from_tensor_parallel_region: the output is replicated, its loss counted once)."""

    @staticmethod
    def forward(ctx, y, g):
        ctx.g = g
        stacked = y.new_empty((g.size,) + tuple(y.shape))
        commlib.all_gather_into_tensor(stacked, y.contiguous(), group=g)
        return stacked.movedim(0, -2).reshape(tuple(y.shape[:-1]) + (g.size * y.shape[-1],))

    @staticmethod
    def backward(ctx, dy):
        n = dy.shape[-1] // ctx.g.size
        return dy.narrow(-1, ctx.g.rank * n, n), None


class _SplitLast(torch.autograd.Function):
    """This rank's columns of a replicated tensor; backward: all-gather of the column gradients
    (Megatron's scatter_to_tensor_parallel_region)."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        n = x.shape[-1] // g.size
        return x.narrow(-1, g.rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, dx):
        return _GatherLast.apply(dx, ctx.g), None


def _tp_input(fn: str, x, weight, k: int, what: str, sp: bool, size: int, divide: bool) -> None:
    """Checks of a tensor-parallel linear's input: a floating tensor of the weight's dtype whose
    last dim is ``k`` (``what`` says which features those are); with sequence parallelism at
    least 2-D, and (``divide``) a sequence length that splits into ``size`` equal shards."""
    if not isinstance(x, torch.Tensor):
        raise arg_error(fn, "x", type(x).__name__, "must be a torch.Tensor",
                        "pass a tensor shaped (..., features)", CommTypeError)
    if not x.is_floating_point() or x.dtype != weight.dtype:
        raise arg_error(fn, "x", f"<tensor dtype={x.dtype}>",
                        f"must have the weight's dtype {weight.dtype}",
                        f"convert the input with x.to({weight.dtype}) or build the layer with "
                        f"dtype={x.dtype}", CommTypeError)
    if x.dim() == 0 or x.shape[-1] != k:
        raise arg_error(fn, "x", f"<tensor shape={tuple(x.shape)}>",
                        f"its last dim must be {k} ({what})", f"pass (..., {k}) activations: {what}")
    if sp and x.dim() < 2:
        raise arg_error(fn, "x", f"<tensor shape={tuple(x.shape)}>",
                        "must be at least 2-D with sequence_parallel=True (dim 0 is the "
                        "sequence, Megatron's [s, b, h])", "pass (seq, ..., features) activations")
    if sp and divide and x.shape[0] % size:
        s = x.shape[0]
        raise arg_error(fn, "x", f"<tensor shape={tuple(x.shape)}>",
                        f"sequence length {s} along dim 0 must be a multiple of the group size "
                        f"{size} (sequence_parallel=True reduce-scatters it into {size} equal "
                        "shards)", f"pad the sequence to a multiple of {size} (e.g. "
                        f"{s + (-s) % size}), masking the padding in the loss")


def _tp_params(fn: str, weight, bias) -> None:
    """The weight (2-D, floating) and bias (None, or 1-D with the weight's rows and dtype)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise arg_error(fn, "weight", f"<{type(weight).__name__} "
                        f"shape={tuple(getattr(weight, 'shape', ()))}>",
                        "must be a 2-D floating-point tensor (out_local, in) as nn.Linear's",
                        "pass this rank's shard of the weight", CommTypeError)
    bias_len = weight.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1
                             or bias.shape[0] != bias_len or bias.dtype != weight.dtype):
        raise arg_error(fn, "bias", f"<{type(bias).__name__} "
                        f"shape={tuple(getattr(bias, 'shape', ()))}>",
                        f"must be None or a 1-D tensor of {bias_len} elements of the weight's dtype",
                        "pass the bias matching the weight (None for no bias)")


def _column_linear(fn: str, x, weight, bias, group, gather_output: bool,
                   sequence_parallel: bool, overlap: bool) -> torch.Tensor:
    """The column-parallel linear, checked under ``fn``'s name (the layer's or the function's)."""
    with checked_call(fn, group) as (g, call):
        _tp_params(fn, weight, bias)
        gather_output = _bool(fn, "gather_output", gather_output)
        sequence_parallel = _bool(fn, "sequence_parallel", sequence_parallel)
        overlap = _bool(fn, "overlap", overlap)
        _tp_input(fn, x, weight, weight.shape[1], "in_features", sequence_parallel, g.size,
                  False)
        call.update(_shapes(x=x, weight=weight), bias=bias is not None,
                    gather_output=gather_output, sequence_parallel=sequence_parallel,
                    overlap=overlap)
    if sequence_parallel and overlap and g.size > 1:
        # the all-gather pipelined with the GEMM (commlib.overlap's autograd does the backward)
        y = commlib.overlap.all_gather_matmul(x, weight.t(), group=g, gather_dim=0)[1]
        y = y if bias is None else y + bias
    else:
        y = _ColumnLinear.apply(x, weight, bias, g, sequence_parallel, overlap)
    return _GatherLast.apply(y, g) if gather_output and g.size > 1 else y


def _row_linear(fn: str, x, weight, bias, group, input_is_parallel: bool,
                sequence_parallel: bool, overlap: bool, overlap_chunks) -> torch.Tensor:
    """The row-parallel linear, checked under ``fn``'s name (the layer's or the function's)."""
    with checked_call(fn, group) as (g, call):
        _tp_params(fn, weight, bias)
        input_is_parallel = _bool(fn, "input_is_parallel", input_is_parallel)
        sequence_parallel = _bool(fn, "sequence_parallel", sequence_parallel)
        overlap = _bool(fn, "overlap", overlap)
        chunks = _overlap_chunks(fn, overlap_chunks)
        k = weight.shape[1] * (1 if input_is_parallel else g.size)
        what = (f"this rank's in_features / {g.size}, input_is_parallel=True" if input_is_parallel
                else "in_features, input_is_parallel=False")
        _tp_input(fn, x, weight, k, what, sequence_parallel, g.size, True)
        call.update(_shapes(x=x, weight=weight), bias=bias is not None,
                    input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                    overlap=overlap, chunks=chunks)
    if not input_is_parallel and g.size > 1:
        x = _SplitLast.apply(x, g)
    if sequence_parallel and overlap and g.size > 1:
        # the GEMM pipelined with the reduce-scatter (commlib.overlap's autograd does the backward)
        y = commlib.overlap.matmul_reduce_scatter(x, weight.t(), group=g, scatter_dim=0)
        return y if bias is None else _SumBiasGrad.apply(y, bias, g)
    return _RowLinear.apply(x, weight, bias, g, sequence_parallel, overlap, chunks)


def _overlap_chunks(fn: str, chunks) -> int:
    if chunks is None:
        return DEFAULT_OVERLAP_CHUNKS
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise arg_error(fn, "overlap_chunks", chunks, "must be a positive int or None",
                        f"pass None for the default ({DEFAULT_OVERLAP_CHUNKS}), or 1 for one GEMM "
                        "and one all-reduce")
    return chunks


def column_parallel_linear(x, weight, bias=None, *, group=None, gather_output: bool = False,
                           sequence_parallel: bool = False, overlap: bool = True) -> torch.Tensor:
    """``x @ weight.T + bias`` for this rank's rows of a weight sharded by output features
    (Megatron's column-parallel linear): ``weight`` is ``(out_features / N, in_features)``,
    ``bias`` ``(out_features / N,)``, both this rank's shard.

    Args:
        x: ``(..., in_features)``, the same on every rank; with ``sequence_parallel=True`` this
            rank's sequence shard ``(s / N, ..., in_features)`` (dim 0 is the sequence, rank r
            holds rows ``[r s/N, (r+1) s/N)``), all-gathered before the GEMM.
        gather_output: all-gather the output along the last dim (every rank gets
            ``(..., out_features)``; its loss is then counted once). Default: this rank's
            ``(..., out_features / N)``.
        overlap: hide communication (see :class:`commlib.nn.ColumnParallelLinear`); the result
            is the same either way, within float rounding.

    Returns:
        ``(..., out_features / N)`` (``(s, ..., out_features / N)`` with sequence_parallel), or
        the gathered ``out_features`` with ``gather_output=True``.

    Example (2 ranks, ``w`` the dense ``(4, 3)`` weight, ``x`` ``(5, 3)`` on both)::

        y = column_parallel_linear(x, w[2 * rank:2 * rank + 2])   # rank r: (x @ w.T)[:, 2r:2r+2]
    """
    return _column_linear("nn.functional.column_parallel_linear", x, weight, bias, group,
                          gather_output, sequence_parallel, overlap)


def row_parallel_linear(x, weight, bias=None, *, group=None, input_is_parallel: bool = True,
                        sequence_parallel: bool = False, overlap: bool = True,
                        overlap_chunks: int | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a weight sharded by input features (Megatron's row-parallel
    linear): ``weight`` is this rank's ``(out_features, in_features / N)`` columns, ``bias`` the
    whole ``(out_features,)`` (replicated), added once after the reduction.

    Args:
        x: this rank's ``(..., in_features / N)`` features (``input_is_parallel=True``, e.g. a
            column-parallel layer's output), or the replicated ``(..., in_features)``, which the
            function splits (its gradient is all-gathered back).
        sequence_parallel: reduce-scatter the output along dim 0 (the sequence, whose length must
            divide by N): this rank gets rows ``[r s/N, (r+1) s/N)``, and the total loss is the
            sum of the ranks' losses. Default: all-reduce, every rank gets the whole output.
        overlap: hide communication (see :class:`commlib.nn.RowParallelLinear`).
        overlap_chunks: row chunks of the GEMM whose all-reduces overlap the next chunk's GEMM
            (``sequence_parallel=False``, ``overlap=True``); default
            :data:`DEFAULT_OVERLAP_CHUNKS`.

    Example (2 ranks, ``w`` the dense ``(4, 6)`` weight, ``x`` ``(5, 6)``)::

        y = row_parallel_linear(x[:, 3 * rank:3 * rank + 3], w[:, 3 * rank:3 * rank + 3], b)
        # every rank: x @ w.T + b
    """
    return _row_linear("nn.functional.row_parallel_linear", x, weight, bias, group,
                       input_is_parallel, sequence_parallel, overlap, overlap_chunks)

