"""The ring executor shared by the blockwise ring and RSA, and their autograd functions.

:func:`ring_loop` walks a :class:`~commlib.nn._plan.RingPlan`. At every step it first posts the
non-blocking transfer of the block it holds to the next rank (and the receive of the next block
from the previous rank) with one ``commlib.batch_isend_irecv``, then computes on the block it
holds, then waits: double buffering with one step of lookahead, so the transfer runs while the
block computes. In the backward pass the gradient accumulators of each K/V block travel the same
way one step behind their block and arrive home after a last hop.

Why the compute polls. With one thread per rank, an MPI engine moves a large (rendezvous) message
only inside MPI calls: posted before a kernel and waited for after it, the transfer would start
at the wait and none of it would be hidden. So every compute callback works in sub-blocks (one KV
head each) and calls ``poll()`` between them, which tests the step's requests
(``Work.is_completed``): the engine answers the peer's handshake and moves the data while the
next sub-block computes. Measured here (bench/seq_attention.py, 2 ranks): the transfer left to
wait for after the compute went from the whole transfer to about nothing.

Messages per call, on a ring of N > 1 (N = 1 sends nothing):

* ring forward: N-1 batches, each sending K and V and receiving the next K and V;
* ring backward: N-1 K/V hops plus N hops of the (dK, dV) accumulators, in N+1 batches;
* rsa forward: N-1 hops of K then N-1 hops of V; rsa backward as the ring backward.

Time spent in each phase is recorded in :data:`STATS`; with ``STATS["trace"]`` set to a list, every
batch also appends its (posted, compute done, wait done) ``time.perf_counter`` stamps. The
benchmark lines the stamps up across ranks (one host: one monotonic clock) to split the wait into
load imbalance (a peer had not posted yet) and transfer still running after the compute.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

import commlib

from ._blocks import block_ops, math_grads_from_p, merge_
from ._layout import positions
from ._plan import RingPlan

__all__ = ["ring_loop", "STATS", "reset_stats", "RingAttention", "RSAAttention", "head_groups"]

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
              carry: Callable | None = None):
    """Pass ``moving`` (this rank's blocks) around the ring; at each step call
    ``compute(step, current_blocks, poll)`` (a :class:`_Poller`: ``poll()`` between sub-blocks
    progresses the step's transfers, ``poll.done()`` says whether they are complete).

    Without ``carry``: returns None. With ``carry``: ``compute`` returns this rank's contribution
    to the current block's accumulators (or None); ``carry(contribution, incoming)`` adds it to the
    accumulators that arrived from the previous rank (``incoming`` None at step 0) and returns the
    accumulators to pass on. Returns the accumulators of this rank's own block, complete."""
    cur = tuple(moving)
    acc = None
    last = plan.size - 1
    for step in plan.steps:
        ops, nxt, incoming = [], None, None
        if step.index < last:
            nxt = tuple(torch.empty_like(t) for t in cur)
            ops += _exchange(group, plan, cur, nxt, _TAG_MOVE)
        if carry is not None and step.index > 0:
            incoming = tuple(torch.empty_like(a) for a in acc)
            ops += _exchange(group, plan, acc, incoming, _TAG_CARRY)
        t0 = _clock()
        works = _post(ops)
        poll = _Poller(works) if works and POLL else _NO_POLL
        poll()  # at once: the handshake starts, and a transfer already done needs no pieces
        contribution = compute(step, cur, poll)
        t1 = _clock()
        STATS["compute_s"] += t1 - t0
        _wait(works, t0, t1)
        if carry is not None:
            acc = carry(contribution, incoming)
        cur = nxt
    if carry is None:
        return None
    if plan.size > 1:  # the last hop: the accumulators of this rank's own block come home
        home = tuple(torch.empty_like(a) for a in acc)
        t0 = _clock()
        _wait(_post(_exchange(group, plan, acc, home, _TAG_CARRY)), t0, t0)
        acc = home
    return acc


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


class _CarryKV:
    """``carry`` for (dK, dV) accumulators kept in the user's (b, s, h_kv, d) layout, shaped like
    ``like``. Partial gradients are (first key token, end, KV head slice, dk, dv) in (b, h, s, d)
    views. Step 0 (the own block) adds them with :meth:`own` straight into fresh zeroed
    accumulators as the compute produces them, so no step-0 part is held; later steps return
    their parts (disjoint key ranges), added once the incoming accumulators arrive."""

    def __init__(self, like: Sequence[torch.Tensor]):
        self.like, self.acc = like, None

    def own(self, k0: int, k1: int, heads: slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        if self.acc is None:
            self.acc = tuple(torch.zeros(t.shape, dtype=_acc_dtype(t.dtype), device=t.device)
                             for t in self.like)
        self._add(self.acc, ((k0, k1, heads, dk, dv),))

    @staticmethod
    def _add(acc, parts):
        for k0, k1, heads, dk, dv in parts:
            acc[0][:, k0:k1, heads].add_(_bhsd(dk))
            acc[1][:, k0:k1, heads].add_(_bhsd(dv))

    def __call__(self, parts, incoming):
        if incoming is None:
            acc, self.acc = self.acc, None
            return acc
        self._add(incoming, parts or ())
        return incoming


# ----- blockwise ring attention with online softmax ----------------------------------------
def head_groups(h: int, hk: int, chunks: int):
    """(query head slice, KV head slice) of each of ``chunks`` groups of whole KV heads (query
    head i reads KV head i // (h // hk), so a KV head range owns a contiguous query range)."""
    g, hc = h // hk, hk // chunks
    return [(slice(j * hc * g, (j + 1) * hc * g), slice(j * hc, (j + 1) * hc)) for j in range(chunks)]


# Sub-blocks per ring step (one poll after each): enough that a transfer posted by a neighbour
# that is a little behind still finds a poll or two before the compute ends.
SUBBLOCKS = 8


def _bounds(lo: int, hi: int, parts: int, done: Callable[[], bool]):
    """[a, b) pieces of [lo, hi): ``parts`` equal ones while ``done()`` is false (the step's
    transfer is still in flight and needs poll points between kernel calls), then the rest in
    one piece (fewer, larger kernel calls: each call has a fixed cost)."""
    n = hi - lo
    p = max(1, min(parts, n))
    a, i = lo, 0
    while a < hi:
        b = hi if done() else lo + n * (i + 1) // p
        yield a, b
        a, i = b, i + 1


def _row_pieces(call, c: int, parts: int, done: Callable[[], bool]):
    """Split a call into pieces of query rows (see :func:`_bounds`): (first part of its rows,
    rows, keys, causal), token slices. A causal call is the diagonal block (plan_ring: same chunks
    for queries and keys), so a piece of rows [a, b) is the keys before it (full) and its own
    square triangle (causal, top-left aligned as the kernels define it)."""
    r0, r1, k0, k1 = call.q0 * c, call.q1 * c, call.k0 * c, call.k1 * c
    for a, b in _bounds(r0, r1, parts, done):
        if not call.causal:
            yield True, slice(a, b), slice(k0, k1), False
            continue
        if a > r0:
            yield True, slice(a, b), slice(k0, k0 + a - r0), False
        yield a == r0, slice(a, b), slice(k0 + a - r0, k0 + b - r0), True


def _col_pieces(call, c: int, parts: int, done: Callable[[], bool]):
    """Split a non-causal call into pieces of key columns (disjoint dK/dV; see :func:`_bounds`):
    (rows, keys)."""
    rows = slice(call.q0 * c, call.q1 * c)
    for a, b in _bounds(call.k0 * c, call.k1 * c, parts, done):
        yield rows, slice(a, b)


class RingAttention(torch.autograd.Function):
    """Blockwise ring attention. The ring runs once per head group (``chunks`` groups of whole KV
    heads, one after the other): every in-flight buffer is 1/chunks of the rank's K/V, at the
    price of ``chunks`` times the messages (each 1/chunks the size). Inside a step the block is
    computed one KV head (with its query heads) at a time, polling the transfers in between."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, plan, chunks):
        ops = block_ops(q.device, q.dtype)
        c = q.shape[1] // plan.steps[0].calls[0].q1  # tokens per chunk
        acc_dtype = _acc_dtype(q.dtype)
        b, sl, h, _ = q.shape
        out_acc = _bhsd(torch.empty(b, sl, h, v.shape[3], dtype=acc_dtype, device=q.device))
        lse_acc = torch.empty(b, h, sl, dtype=acc_dtype, device=q.device)
        for qh, kh in head_groups(h, k.shape[2], chunks):
            qt, out_g, lse_g = _bhsd(q)[:, qh], out_acc[:, qh], lse_acc[:, qh]
            subs = head_groups(qt.shape[1], kh.stop - kh.start, kh.stop - kh.start)
            pieces = -(-SUBBLOCKS // len(subs))

            def compute(step, cur, poll, qt=qt, out_g=out_g, lse_g=lse_g, subs=subs,
                        pieces=pieces):
                kt, vt = _bhsd(cur[0]), _bhsd(cur[1])
                for call in step.calls:
                    for sq, sk in subs:
                        for first, rows, cols, causal in _row_pieces(call, c, pieces, poll.done):
                            o, lse = ops.forward(qt[:, sq, rows], kt[:, sk, cols],
                                                 vt[:, sk, cols], causal, scale)
                            if step.index == 0 and first:  # step 0 covers every row once
                                out_g[:, sq, rows].copy_(o)
                                lse_g[:, sq, rows].copy_(lse)
                            else:
                                merge_(out_g[:, sq, rows], lse_g[:, sq, rows], o, lse)
                            poll()

            ring_loop(plan, group, (k[:, :, kh], v[:, :, kh]), compute)
        out = out_acc.to(q.dtype)  # (b, h, s, d) view of (b, s, h, d) memory
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.args = (scale, group, plan, c, chunks)
        ctx.mark_non_differentiable(lse_acc)
        return _bhsd(out), lse_acc

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, group, plan, c, chunks = ctx.args
        ops = block_ops(q.device, q.dtype)
        dq_acc = torch.empty(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)
        # one head group: the ring's accumulators are the gradients (no copy)
        dk_acc = torch.empty_like(k) if chunks > 1 else None
        dv_acc = torch.empty_like(v) if chunks > 1 else None
        for qh, kh in head_groups(q.shape[2], k.shape[2], chunks):
            qt, dot, out_g, lse_g = _bhsd(q)[:, qh], _bhsd(dout)[:, qh], out[:, qh], lse[:, qh]
            dq_g = _bhsd(dq_acc)[:, qh]
            subs = head_groups(qt.shape[1], kh.stop - kh.start, kh.stop - kh.start)
            pieces = -(-SUBBLOCKS // len(subs))
            moving = (k[:, :, kh], v[:, :, kh])
            carry = _CarryKV(moving)

            def block(sq, sk, rows, cols, causal, kt, vt, qt=qt, dot=dot, out_g=out_g,
                      lse_g=lse_g):
                return ops.backward(dot[:, sq, rows], qt[:, sq, rows], kt[:, sk, cols],
                                    vt[:, sk, cols], out_g[:, sq, rows], lse_g[:, sq, rows],
                                    causal, scale)

            def compute(step, cur, poll, dq_g=dq_g, subs=subs, pieces=pieces, carry=carry,
                        block=block):
                kt, vt = _bhsd(cur[0]), _bhsd(cur[1])
                parts = []
                for call in step.calls:
                    for sq, sk in subs:
                        if step.index == 0:  # the own block, by rows: dK/dV add up at home
                            for first, rows, cols, causal in _row_pieces(call, c, pieces,
                                                                         poll.done):
                                dq, dk, dv = block(sq, sk, rows, cols, causal, kt, vt)
                                (dq_g[:, sq, rows].copy_ if first else dq_g[:, sq, rows].add_)(dq)
                                carry.own(cols.start, cols.stop, sk, dk, dv)
                                poll()
                            continue
                        for rows, cols in _col_pieces(call, c, pieces, poll.done):  # disjoint dK/dV
                            dq, dk, dv = block(sq, sk, rows, cols, False, kt, vt)
                            dq_g[:, sq, rows].add_(dq)
                            parts.append((cols.start, cols.stop, sk, dk, dv))
                            poll()
                return parts

            dk, dv = ring_loop(plan, group, moving, compute, carry)
            if dk_acc is None:
                dk_acc, dv_acc = dk.to(k.dtype), dv.to(v.dtype)
            else:
                dk_acc[:, :, kh].copy_(dk)
                dv_acc[:, :, kh].copy_(dv)
        return dq_acc.to(q.dtype), dk_acc, dv_acc, None, None, None, None, None


# ----- RSA: the paper's two ring passes over materialized score rows -------------------------
class RSAAttention(torch.autograd.Function):
    """Ring self-attention (Li et al.): a ring pass of K builds the full score rows
    (b, h, s_local, s) of this rank's queries, softmax, then a ring pass of V accumulates P V.
    Memory O(s_local x s) per rank, as in the paper; the backward is exact (the blocks' gradients
    from the stored probabilities, dK/dV accumulators traveling home)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, plan, chunks=1):
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

        carry = _CarryKV((k, v))

        def compute(step, cur, poll):
            kt, vt = _bhsd(cur[0]), _bhsd(cur[1])
            parts = []
            for j, (sq, sk) in enumerate(heads):  # one KV head at a time, polling in between
                dq, dk, dv = math_grads_from_p(pb[:, j:j + 1, :, :, step.source], dot[:, sq],
                                               qt[:, sq], kt[:, sk], vt[:, sk], delta[:, sq], scale)
                if step.index == 0:
                    state["dq"][:, sq].copy_(dq)
                    carry.own(0, sl, sk, dk, dv)
                else:
                    state["dq"][:, sq].add_(dq)
                    parts.append((0, sl, sk, dk, dv))
                poll()
            return parts

        dk, dv = ring_loop(plan, group, (k, v), compute, carry)
        return (_bhsd(state["dq"]).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None)
