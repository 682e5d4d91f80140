"""The ring executor shared by the blockwise ring and RSA, and their autograd functions.

:func:`ring_loop` walks a :class:`~commlib.nn._plan.RingPlan`. At every step it first posts the
non-blocking transfer of the block it holds to the next rank (and the receive of the next block
from the previous rank) with one ``commlib.batch_isend_irecv``, then computes on the block it
holds, then waits: double buffering with one step of lookahead, so the transfer runs while the
block computes. In the backward pass the gradient accumulators of each K/V block follow their
block between steps and arrive home after a last hop.

Why the compute polls. With one thread per rank, an MPI engine moves a large (rendezvous) message
only inside MPI calls: posted before a kernel and waited for after it, the transfer would start
at the wait and none of it would be hidden. So every compute callback works in sub-blocks (one KV
head each) and calls ``poll()`` between them, which tests the step's requests
(``Work.is_completed``): the engine answers the peer's handshake and moves the data while the
next sub-block computes. Measured here (bench/seq_attention.py, 2 ranks): the transfer left to
wait for after the compute went from the whole transfer to about nothing.

Messages per call, on a ring of N > 1 (N = 1 sends nothing):

* ring forward: N-1 batches, each sending K and V and receiving the next K and V;
* ring backward: N-1 K/V hops plus N hops of the (dK, dV) accumulators, in 2N-1 batches (the
  accumulators move between steps, alone: see :func:`ring_loop`);
* rsa forward: N-1 hops of K then N-1 hops of V; rsa backward as the ring backward.

Time spent in each phase is recorded in :data:`STATS`; with ``STATS["trace"]`` set to a list, every
batch also appends its (posted, compute done, wait done) ``time.perf_counter`` stamps. The
benchmark lines the stamps up across ranks (one host: one monotonic clock) to split the wait into
load imbalance (a peer had not posted yet) and transfer still running after the compute.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

import commlib

from ._blocks import block_ops, math_grads_from_p, merge_
from ._layout import positions
from ._plan import RingPlan

__all__ = ["ring_loop", "STATS", "reset_stats", "RingAttention", "RSAAttention", "head_groups",
           "ring_passes"]

_clock = time.perf_counter

# Seconds spent computing blocks, and waiting for transfers after the compute (exposed
# communication), summed over calls; batches posted; polls made during compute; trace: None, or
# a list that receives (posted, computed, waited) stamps per batch.
STATS = {"compute_s": 0.0, "wait_s": 0.0, "batches": 0, "polls": 0, "trace": None}


# Poll the transfers between sub-blocks (True; False only to measure what polling buys, as
# bench/seq_attention.py --no-poll does).
POLL = True


def reset_stats(trace: bool = False) -> None:
    STATS.update(compute_s=0.0, wait_s=0.0, batches=0, polls=0, trace=[] if trace else None)


_TAG_MOVE, _TAG_CARRY = 0, 8  # tags of traveling blocks and of traveling accumulators (+ index)


def _exchange(group, plan: RingPlan, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor],
              tag: int) -> list:
    ops = [commlib.P2POp(commlib.isend, t, group=group, tag=tag + i, group_peer=plan.send_to)
           for i, t in enumerate(send)]
    ops += [commlib.P2POp(commlib.irecv, t, group=group, tag=tag + i, group_peer=plan.recv_from)
            for i, t in enumerate(recv)]
    return ops


def _post(ops: list) -> list:
    if not ops:
        return []
    STATS["batches"] += 1
    return commlib.batch_isend_irecv(ops)


def _wait(works: list, posted: float, computed: float) -> None:
    for w in works:
        w.wait()
    done = _clock()
    STATS["wait_s"] += done - computed
    if STATS["trace"] is not None:
        STATS["trace"].append((posted, computed, done))


class _Poller:
    """What the compute calls between sub-blocks: ``poll()`` tests the step's requests, which
    lets the engine progress them (a test of a finished request is a flag check); ``done()``
    says whether all are complete, from when on the compute needs no more poll points and may
    work in larger pieces."""

    __slots__ = ("pending",)

    def __init__(self, works):
        self.pending = list(works)

    def __call__(self) -> None:
        if self.pending:
            STATS["polls"] += 1
            self.pending = [w for w in self.pending if not w.is_completed()]

    def done(self) -> bool:
        return not self.pending


_NO_POLL = _Poller(())  # nothing in flight (or polling off): nothing to test, no pieces


def ring_loop(plan: RingPlan, group, moving: Sequence[torch.Tensor], compute: Callable,
              carry: "_CarryKV | None" = None):
    """Pass ``moving`` (this rank's blocks) around the ring; at each step call
    ``compute(step, current_blocks, poll)`` (a :class:`_Poller`: ``poll()`` between sub-blocks
    progresses the step's transfers, ``poll.done()`` says whether they are complete).

    With ``carry`` (a :class:`_CarryKV`), ``compute`` adds this rank's share of the current
    block's gradients into ``carry``'s accumulators, which arrived with the block's previous
    holder's shares; after the compute (and the block's transfer) they go on to the next rank in
    one exchange, and the accumulators of the next block come in. The exchange is not hidden behind
    compute, on purpose: in flight during the compute are then only the block held, the next one
    and one set of accumulators (three block-sized buffers, not five). Returns None, or with
    ``carry`` the accumulators of this rank's own block, complete, after the last hop home."""
    cur, moving = tuple(moving), None  # the caller's blocks may be copies: free them on the way
    last = plan.size - 1
    for step in plan.steps:
        ops, nxt = [], None
        if step.index < last:
            nxt = tuple(torch.empty_like(t) for t in cur)
            ops += _exchange(group, plan, cur, nxt, _TAG_MOVE)
        t0 = _clock()
        works = _post(ops)
        poll = _Poller(works) if works and POLL else _NO_POLL
        poll()  # at once: the handshake starts, and a transfer already done needs no pieces
        compute(step, cur, poll)
        t1 = _clock()
        STATS["compute_s"] += t1 - t0
        _wait(works, t0, t1)
        cur = nxt  # the block computed is freed
        if carry is not None and plan.size > 1:  # pass the accumulators on, take the next ones
            acc = carry.take()
            incoming = tuple(torch.empty_like(a) for a in acc)
            t0 = _clock()
            _wait(_post(_exchange(group, plan, acc, incoming, _TAG_CARRY)), t0, t0)
            del acc
            carry.give(incoming)
    return None if carry is None else carry.take()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


class _CarryKV:
    """The (dK, dV) accumulators of the block a ring step computes: tensors of the (shape, dtype,
    device) in ``like`` (in the accumulation dtype), seen through ``views`` as a (dK, dV) pair in
    the user's (b, s, h_kv, d) layout (default: the tensors themselves). :meth:`add` adds a
    partial gradient (first key token, end, KV head slice, dk, dv; dk/dv in (b, h, s, d) views)
    into the current accumulators (zeros until some arrive); :meth:`take` hands them over
    (:func:`ring_loop` sends them on), :meth:`give` installs the ones that arrived."""

    def __init__(self, like: Sequence, views: Callable = lambda acc: acc):
        # (shape, dtype, device), not tensors: a ring's blocks are freed on the way
        self.like = [(shape, _acc_dtype(dtype), device) for shape, dtype, device in like]
        self.views = views
        self.acc = self.dkv = None

    def give(self, acc) -> None:
        self.acc, self.dkv = acc, self.views(acc)

    def _held(self) -> None:
        if self.acc is None:  # nothing arrived (the own block, step 0): start from zeros
            self.give(tuple(torch.zeros(shape, dtype=dtype, device=device)
                            for shape, dtype, device in self.like))

    def take(self):
        self._held()
        acc, self.acc, self.dkv = self.acc, None, None
        return acc

    def add(self, k0: int, k1: int, heads: slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self._held()
        self.dkv[0][:, k0:k1, heads].add_(_bhsd(dk))
        self.dkv[1][:, k0:k1, heads].add_(_bhsd(dv))


# ----- blockwise ring attention with online softmax ----------------------------------------
def head_groups(h: int, hk: int, chunks: int):
    """(query head slice, KV head slice) of each of ``chunks`` groups of whole KV heads (query
    head i reads KV head i // (h // hk), so a KV head range owns a contiguous query range)."""
    g, hc = h // hk, hk // chunks
    return [(slice(j * hc * g, (j + 1) * hc * g), slice(j * hc, (j + 1) * hc)) for j in range(chunks)]


def ring_passes(h: int, hk: int, c: int, per: int, head_chunks: int, seq_chunks: int):
    """The ring passes, in order: (query head slice, KV head slice, key token spans) for each of
    ``head_chunks`` groups of whole KV heads times ``seq_chunks`` segments. Segment j is the same
    near-equal j-th part of each of the rank's ``per`` chunks of ``c`` tokens (one span per chunk,
    all of the same length; the whole block as one span when there is one segment): the same
    token ranges on every rank, so messages match in size, and under causal zigzag every pass
    keeps the layout's balance (a segment of a rank's early chunk is seen by more ranks' queries,
    that of its late chunk by fewer; together the same work on every rank at every step)."""
    if seq_chunks == 1:
        segments = [((0, per * c),)]
    else:
        segments = [tuple((i * c + c * j // seq_chunks, i * c + c * (j + 1) // seq_chunks)
                          for i in range(per)) for j in range(seq_chunks)]
    return [(qh, kh, spans) for qh, kh in head_groups(h, hk, head_chunks) for spans in segments]


# Poll points per ring step of the whole block (one after each kernel call): enough that a
# transfer posted by a neighbour that is a little behind still finds a poll or two before the
# compute ends. Split over the KV heads of a pass's group and its key segments, at least 2 each.
SUBBLOCKS = 8

# Backward kernel calls take at most this share of the rank's query rows x query heads: torch's CPU
# flash backward copies a strided dout view and writes dq and fp32 scratch, about four times the
# rows it is given, all alive at once (1/64 of the rank's q: ~0.06 of a q-sized tensor; 1/32 made
# the peak per rank 0.15 of one larger, measured at 2 and 4 ranks).
BACKWARD_ROW_SHARE = 1 / 64
MIN_ROWS = 128


def _sub_blocks(h: int, kv_heads: slice, seq_chunks: int):
    """A pass's sub-blocks (one KV head with its query heads, of the pass's ``h`` query heads)
    and the poll pieces each is cut into while the step's transfer runs (see SUBBLOCKS)."""
    hk = kv_heads.stop - kv_heads.start
    subs = head_groups(h, hk, hk)
    return subs, max(2, -(-SUBBLOCKS // (len(subs) * seq_chunks)))


def _bounds(lo: int, hi: int, parts: int, done: Callable[[], bool], cap: int | None = None):
    """[a, b) pieces of [lo, hi): ``parts`` equal ones while ``done()`` is false (the step's
    transfer is still in flight and needs poll points between kernel calls), then the rest in
    one piece (fewer, larger kernel calls: each call has a fixed cost); with ``cap``, no piece is
    longer than ``cap``."""
    n = hi - lo
    p = max(1, min(parts, n))
    a, i = lo, 0
    while a < hi:
        end = hi if done() else lo + n * (i + 1) // p
        b = end if cap is None else min(end, a + cap)
        yield a, b
        a, i = b, i + (b == end)


def _tiles(call, c: int, spans, parts: int, done: Callable[[], bool], cap: int | None = None):
    """Cut ``call`` (local query chunks x key chunks, ``c`` tokens per chunk), restricted to the
    pass's key ``spans``, into kernel calls over pieces of query rows (see :func:`_bounds`):
    (first, rows, keys, causal), keys in *packed* positions: the spans' tokens one after the
    other, as :class:`_Pack` lays them out. ``first`` marks the first call of its rows within this
    call. A non-causal call sees whole chunks, so its keys are consecutive in packed positions:
    one kernel call. A causal call is the diagonal block (plan_ring: the same chunks for queries
    and keys); restricted to the span [x, y) of a chunk, its rows [x, y) see the square triangle
    (causal, top-left aligned as the kernels define it) after the span's keys before them, rows
    from y on see the whole span, and rows before x none."""
    r0, r1 = call.q0 * c, call.q1 * c
    whole = len(spans) == 1  # the whole block: packed positions are the local tokens
    span = c if whole else spans[0][1] - spans[0][0]  # packed positions per chunk
    if not call.causal:
        for a, b in _bounds(r0, r1, parts, done, cap):
            yield True, slice(a, b), slice(call.k0 * span, call.k1 * span), False
        return
    lead = True
    for i, (s0, s1) in enumerate(spans):
        x, y = max(call.k0 * c, s0), min(call.k1 * c, s1)
        if x >= y:
            continue
        shift = s0 - (0 if whole else i * span)  # local token - packed position
        for lo, hi in _bounds(x, r1, parts, done, cap):
            for a, b in ((lo, min(hi, y)), (max(lo, y), hi)):  # in the triangle, below it
                if a >= b:
                    continue
                if a >= y:  # below the triangle: every key of the span
                    yield lead, slice(a, b), slice(x - shift, y - shift), False
                    continue
                if a > x:
                    yield lead, slice(a, b), slice(x - shift, a - shift), False
                yield lead and a == x, slice(a, b), slice(a - shift, b - shift), True
        lead = False


class _Pack:
    """One pass's K and V in one flat buffer, so a hop is one message: K then V, each a
    contiguous (b, spans x span length, KV heads, d) tensor holding the spans' tokens one after
    the other (packed positions); the pass's dK/dV accumulators use the same layout in the
    accumulation dtype. On one rank with one span nothing travels: K and V are views, no copy."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, spans, heads: slice, size: int):
        self.spans, self.heads = spans, heads
        b, hk = k.shape[0], heads.stop - heads.start
        packed = sum(s1 - s0 for s0, s1 in spans)
        self.shapes = [(b, packed, hk, k.shape[3]), (b, packed, hk, v.shape[3])]
        self.flat = size > 1 or len(spans) > 1

    def views(self, held: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """(K, V) of what :meth:`moving` made, or of its accumulators."""
        if not self.flat:
            return list(held)
        buf, out, at = held[0], [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(buf[at:at + n].view(shape))
            at += n
        return out

    def like(self, k: torch.Tensor) -> list[tuple]:
        """(shape, dtype, device) of each tensor :meth:`moving` returns."""
        shapes = [(sum(math.prod(s) for s in self.shapes),)] if self.flat else self.shapes
        return [(torch.Size(shape), k.dtype, k.device) for shape in shapes]

    def moving(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the ring passes on."""
        if not self.flat:
            (s0, s1), = self.spans
            return k[:, s0:s1, self.heads], v[:, s0:s1, self.heads]
        buf = torch.empty(sum(math.prod(s) for s in self.shapes), dtype=k.dtype, device=k.device)
        self.unpack_((buf,), k, v, into=True)
        return (buf,)

    def unpack_(self, held, k: torch.Tensor, v: torch.Tensor, into: bool = False) -> None:
        """Copy the packed (K, V) of ``held`` to their tokens of ``k`` and ``v`` (``into``: the
        other way, tokens to the packed buffer)."""
        for packed, t in zip(self.views(held), (k, v)):
            at = 0
            for s0, s1 in self.spans:
                src, dst = t[:, s0:s1, self.heads], packed[:, at:at + s1 - s0]
                (dst.copy_(src) if into else src.copy_(dst))
                at += s1 - s0


class RingAttention(torch.autograd.Function):
    """Blockwise ring attention. The ring runs once per pass (:func:`ring_passes`: a group of
    whole KV heads x a segment of the key tokens, one after the other): every in-flight buffer is
    1/(head_chunks x seq_chunks) of the rank's K/V, at the price of that many times the messages
    (each as much smaller). Inside a step the block is computed one KV head (with its query
    heads) and one piece of query rows at a time, polling the transfers in between."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, plan, chunks, seq_chunks=1):
        ops = block_ops(q.device, q.dtype)
        per = plan.steps[0].calls[0].q1  # chunks per rank
        c = q.shape[1] // per  # tokens per chunk
        acc_dtype = _acc_dtype(q.dtype)
        b, sl, h, _ = q.shape
        out_acc = _bhsd(torch.empty(b, sl, h, v.shape[3], dtype=acc_dtype, device=q.device))
        lse_acc = torch.empty(b, h, sl, dtype=acc_dtype, device=q.device)
        for qh, kh, spans in ring_passes(h, k.shape[2], c, per, chunks, seq_chunks):
            qt, out_g, lse_g = _bhsd(q)[:, qh], out_acc[:, qh], lse_acc[:, qh]
            subs, pieces = _sub_blocks(qt.shape[1], kh, seq_chunks)
            assign = spans[0][0] == 0  # the first segment's step 0 reaches every row first
            pack = _Pack(k, v, spans, kh, plan.size)

            def compute(step, cur, poll, qt=qt, out_g=out_g, lse_g=lse_g, subs=subs,
                        pieces=pieces, spans=spans, assign=assign, pack=pack):
                kt, vt = (_bhsd(t) for t in pack.views(cur))
                for call in step.calls:
                    for sq, sk in subs:
                        for first, rows, cols, causal in _tiles(call, c, spans, pieces, poll.done):
                            o, lse = ops.forward(qt[:, sq, rows], kt[:, sk, cols],
                                                 vt[:, sk, cols], causal, scale)
                            if assign and step.index == 0 and first:
                                out_g[:, sq, rows].copy_(o)
                                lse_g[:, sq, rows].copy_(lse)
                            else:
                                merge_(out_g[:, sq, rows], lse_g[:, sq, rows], o, lse)
                            poll()

            ring_loop(plan, group, pack.moving(k, v), compute)
        out = out_acc.to(q.dtype)  # (b, h, s, d) view of (b, s, h, d) memory
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.args = (scale, group, plan, per, c, chunks, seq_chunks)
        ctx.mark_non_differentiable(lse_acc)
        return _bhsd(out), lse_acc

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, group, plan, per, c, chunks, seq_chunks = ctx.args
        ops = block_ops(q.device, q.dtype)
        b, sl, h, _ = q.shape
        dq_acc = torch.zeros(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)
        dk_acc = dv_acc = None
        for qh, kh, spans in ring_passes(h, k.shape[2], c, per, chunks, seq_chunks):
            qt, dot, out_g, lse_g = _bhsd(q)[:, qh], _bhsd(dout)[:, qh], out[:, qh], lse[:, qh]
            dq_g = _bhsd(dq_acc)[:, qh]
            subs, pieces = _sub_blocks(qt.shape[1], kh, seq_chunks)
            cap = max(MIN_ROWS, int(sl * h * BACKWARD_ROW_SHARE) // (h // k.shape[2]))
            pack = _Pack(k, v, spans, kh, plan.size)
            carry = _CarryKV(pack.like(k), pack.views)

            def compute(step, cur, poll, qt=qt, dot=dot, out_g=out_g, lse_g=lse_g, dq_g=dq_g,
                        subs=subs, pieces=pieces, cap=cap, spans=spans, carry=carry, pack=pack):
                kt, vt = (_bhsd(t) for t in pack.views(cur))
                for call in step.calls:
                    for sq, sk in subs:
                        for _, rows, cols, causal in _tiles(call, c, spans, pieces, poll.done,
                                                            cap):
                            dq, dk, dv = ops.backward(
                                dot[:, sq, rows], qt[:, sq, rows], kt[:, sk, cols],
                                vt[:, sk, cols], out_g[:, sq, rows], lse_g[:, sq, rows], causal,
                                scale)
                            dq_g[:, sq, rows].add_(dq)
                            carry.add(cols.start, cols.stop, sk, dk, dv)
                            poll()

            grads = ring_loop(plan, group, pack.moving(k, v), compute, carry)
            if chunks * seq_chunks == 1 and len(spans) == 1:  # one pass: the gradients
                dk_acc, dv_acc = (t.to(k.dtype) for t in pack.views(grads))
                continue
            if dk_acc is None:
                dk_acc, dv_acc = torch.empty_like(k), torch.empty_like(v)
            pack.unpack_(grads, dk_acc, dv_acc)
        return dq_acc.to(q.dtype), dk_acc, dv_acc, None, None, None, None, None, None


# ----- RSA: the paper's two ring passes over materialized score rows -------------------------
class RSAAttention(torch.autograd.Function):
    """Ring self-attention (Li et al.): a ring pass of K builds the full score rows
    (b, h, s_local, s) of this rank's queries, softmax, then a ring pass of V accumulates P V.
    Memory O(s_local x s) per rank, as in the paper; the backward is exact (the blocks' gradients
    from the stored probabilities, dK/dV accumulators traveling home)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, plan, chunks=1, seq_chunks=1):
        b, sl, h, d = q.shape
        hk = k.shape[2]
        g = h // hk
        n = plan.size
        acc = _acc_dtype(q.dtype)
        qg = _bhsd(q).reshape(b, hk, g, sl, d).to(acc)
        s = torch.empty(b, hk, g, sl, n, sl, dtype=acc, device=q.device)
        qpos = positions(plan.layout, plan.rank, n, sl).to(q.device)

        def scores(step, cur, poll):
            kt = _bhsd(cur[0]).to(acc).unsqueeze(2)  # (b, hk, 1, sl, d)
            blk = s[:, :, :, :, step.source]
            for j in range(hk):  # one KV head at a time, polling the transfer in between
                torch.mul(torch.matmul(qg[:, j], kt[:, j].transpose(-1, -2)), scale,
                          out=blk[:, j])
                poll()
            if causal:
                kpos = positions(plan.layout, step.source, n, sl).to(q.device)
                blk.masked_fill_(kpos.view(1, -1) > qpos.view(-1, 1), float("-inf"))

        ring_loop(plan, group, (k,), scores)
        s = s.view(b, hk, g, sl, n * sl)
        lse = torch.logsumexp(s, dim=-1)
        p = s.sub_(lse.unsqueeze(-1)).exp_()  # the probabilities, in place of the scores
        o = torch.zeros(b, hk, g, sl, v.shape[3], dtype=acc, device=q.device)
        pb = p.view(b, hk, g, sl, n, sl)

        def values(step, cur, poll):
            vt = _bhsd(cur[0]).to(acc).unsqueeze(2)
            for j in range(hk):
                o[:, j].add_(torch.matmul(pb[:, j, :, :, step.source], vt[:, j]))
                poll()

        ring_loop(plan, group, (v,), values)
        out = o.reshape(b, h, sl, -1).to(q.dtype)
        lse = lse.reshape(b, h, sl)
        ctx.save_for_backward(q, k, v, out, p)
        ctx.args = (scale, group, plan)
        ctx.mark_non_differentiable(lse)
        return _bhsd(out), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, p = ctx.saved_tensors
        scale, group, plan = ctx.args
        b, sl, h, d = q.shape
        n = plan.size
        qt, dot = _bhsd(q), _bhsd(dout)
        delta = (dot.to(p.dtype) * out.to(p.dtype)).sum(-1)
        pb = p.view(*p.shape[:4], n, sl)

        heads = head_groups(h, k.shape[2], k.shape[2])
        state = {"dq": torch.empty(b, h, sl, d, dtype=p.dtype, device=q.device)}

        carry = _CarryKV([(t.shape, t.dtype, t.device) for t in (k, v)])

        def compute(step, cur, poll):
            kt, vt = _bhsd(cur[0]), _bhsd(cur[1])
            for j, (sq, sk) in enumerate(heads):  # one KV head at a time, polling in between
                dq, dk, dv = math_grads_from_p(pb[:, j:j + 1, :, :, step.source], dot[:, sq],
                                               qt[:, sq], kt[:, sk], vt[:, sk], delta[:, sq], scale)
                (state["dq"][:, sq].copy_ if step.index == 0 else state["dq"][:, sq].add_)(dq)
                carry.add(0, sl, sk, dk, dv)
                poll()

        dk, dv = ring_loop(plan, group, (k, v), compute, carry)
        return (_bhsd(state["dq"]).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None, None)
