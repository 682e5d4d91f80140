"""The ring executor shared by the blockwise ring and RSA, and their autograd functions.

:func:`ring_loop` walks a :class:`~commlib.nn._plan.RingPlan`. At every step it first posts the
non-blocking transfer of the block it holds to the next rank (and the receive of the next block
from the previous rank) with one ``commlib.batch_isend_irecv``, then computes on the block it
holds, then waits: double buffering with one step of lookahead, so the transfer runs while the
block computes. In the backward pass the gradient accumulators of each K/V block travel the same
way one step behind their block and arrive home after a last hop.

Messages per call, on a ring of N > 1 (N = 1 sends nothing):

* ring forward: N-1 batches, each sending K and V and receiving the next K and V;
* ring backward: N-1 K/V hops plus N hops of the (dK, dV) accumulators, in N+1 batches;
* rsa forward: N-1 hops of K then N-1 hops of V; rsa backward as the ring backward.

Time spent in each phase is recorded in :data:`STATS` (the benchmark reads it to report how much
of the communication was hidden behind compute).
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
# communication), summed over calls; batches posted.
STATS = {"compute_s": 0.0, "wait_s": 0.0, "batches": 0}


def reset_stats() -> None:
    STATS.update(compute_s=0.0, wait_s=0.0, batches=0)


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


def _wait(works: list) -> None:
    t0 = _clock()
    for w in works:
        w.wait()
    STATS["wait_s"] += _clock() - t0


def ring_loop(plan: RingPlan, group, moving: Sequence[torch.Tensor], compute: Callable,
              carry: Callable | None = None):
    """Pass ``moving`` (this rank's blocks) around the ring; at each step call
    ``compute(step, current_blocks)``.

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
        works = _post(ops)
        t0 = _clock()
        contribution = compute(step, cur)
        STATS["compute_s"] += _clock() - t0
        _wait(works)
        if carry is not None:
            acc = carry(contribution, incoming)
        cur = nxt
    if carry is None:
        return None
    if plan.size > 1:  # the last hop: the accumulators of this rank's own block come home
        home = tuple(torch.empty_like(a) for a in acc)
        _wait(_post(_exchange(group, plan, acc, home, _TAG_CARRY)))
        acc = home
    return acc


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def _carry_kv(chunk: int):
    """``carry`` for (dK, dV) accumulators kept in the user's (b, s, h_kv, d) layout: add this
    rank's partial gradients (list of (first key chunk, last, dk, dv) in (b, h, s, d) views)."""
    def carry(parts, incoming):
        if incoming is None:  # step 0: the own block, whose first call covers every key
            (k0, k1, dk, dv), rest = parts[0], parts[1:]
            acc = (_bhsd(dk).to(_acc_dtype(dk.dtype)).contiguous(),
                   _bhsd(dv).to(_acc_dtype(dv.dtype)).contiguous())
            assert (k0, k1) == (0, acc[0].shape[1] // chunk)
        else:
            acc, rest = incoming, parts or ()
        for k0, k1, dk, dv in rest:
            rows = slice(k0 * chunk, k1 * chunk)
            acc[0][:, rows].add_(_bhsd(dk))
            acc[1][:, rows].add_(_bhsd(dv))
        return acc
    return carry


# ----- blockwise ring attention with online softmax ----------------------------------------
def head_groups(h: int, hk: int, chunks: int):
    """(query head slice, KV head slice) of each of ``chunks`` groups of whole KV heads (query
    head i reads KV head i // (h // hk), so a KV head range owns a contiguous query range)."""
    g, hc = h // hk, hk // chunks
    return [(slice(j * hc * g, (j + 1) * hc * g), slice(j * hc, (j + 1) * hc)) for j in range(chunks)]


class RingAttention(torch.autograd.Function):
    """Blockwise ring attention. The ring runs once per head group (``chunks`` groups of whole KV
    heads, one after the other): every in-flight buffer is 1/chunks of the rank's K/V, at the
    price of ``chunks`` times the messages (each 1/chunks the size)."""

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

            def compute(step, cur, qt=qt, out_g=out_g, lse_g=lse_g):
                kt, vt = _bhsd(cur[0]), _bhsd(cur[1])
                for call in step.calls:
                    rows, cols = slice(call.q0 * c, call.q1 * c), slice(call.k0 * c, call.k1 * c)
                    o, lse = ops.forward(qt[:, :, rows], kt[:, :, cols], vt[:, :, cols],
                                         call.causal, scale)
                    if step.index == 0:  # covers every row (plan_ring guarantees it)
                        out_g.copy_(o)
                        lse_g.copy_(lse)
                    else:
                        merge_(out_g[:, :, rows], lse_g[:, :, rows], o, lse)

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
        dks, dvs = [], []
        for qh, kh in head_groups(q.shape[2], k.shape[2], chunks):
            qt, dot, out_g, lse_g = _bhsd(q)[:, qh], _bhsd(dout)[:, qh], out[:, qh], lse[:, qh]
            dq_g = _bhsd(dq_acc)[:, qh]

            def compute(step, cur, qt=qt, dot=dot, out_g=out_g, lse_g=lse_g, dq_g=dq_g):
                kt, vt = _bhsd(cur[0]), _bhsd(cur[1])
                parts = []
                for call in step.calls:
                    rows, cols = slice(call.q0 * c, call.q1 * c), slice(call.k0 * c, call.k1 * c)
                    dq, dk, dv = ops.backward(dot[:, :, rows], qt[:, :, rows], kt[:, :, cols],
                                              vt[:, :, cols], out_g[:, :, rows], lse_g[:, :, rows],
                                              call.causal, scale)
                    (dq_g.copy_ if step.index == 0 else dq_g[:, :, rows].add_)(dq)
                    parts.append((call.k0, call.k1, dk, dv))
                return parts

            dk, dv = ring_loop(plan, group, (k[:, :, kh], v[:, :, kh]), compute, _carry_kv(c))
            dks.append(dk.to(k.dtype))
            dvs.append(dv.to(v.dtype))
        dk = dks[0] if chunks == 1 else torch.cat(dks, dim=2)
        dv = dvs[0] if chunks == 1 else torch.cat(dvs, dim=2)
        return dq_acc.to(q.dtype), dk, dv, None, None, None, None, None


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

        def scores(step, cur):
            kt = _bhsd(cur[0]).to(acc).unsqueeze(2)  # (b, hk, 1, sl, d)
            blk = s[:, :, :, :, step.source]
            torch.mul(torch.matmul(qg, kt.transpose(-1, -2)), scale, out=blk)
            if causal:
                kpos = positions(plan.layout, step.source, n, sl).to(q.device)
                blk.masked_fill_(kpos.view(1, -1) > qpos.view(-1, 1), float("-inf"))

        ring_loop(plan, group, (k,), scores)
        s = s.view(b, hk, g, sl, n * sl)
        lse = torch.logsumexp(s, dim=-1)
        p = s.sub_(lse.unsqueeze(-1)).exp_()  # the probabilities, in place of the scores
        o = torch.zeros(b, hk, g, sl, v.shape[3], dtype=acc, device=q.device)
        pb = p.view(b, hk, g, sl, n, sl)

        def values(step, cur):
            o.add_(torch.matmul(pb[:, :, :, :, step.source], _bhsd(cur[0]).to(acc).unsqueeze(2)))

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
        state = {}

        def compute(step, cur):
            dq, dk, dv = math_grads_from_p(pb[:, :, :, :, step.source], dot, qt, _bhsd(cur[0]),
                                           _bhsd(cur[1]), delta, scale)
            if step.index == 0:
                state["dq"] = dq.to(p.dtype)
            else:
                state["dq"].add_(dq)
            return [(0, 1, dk, dv)]

        dk, dv = ring_loop(plan, group, (k, v), compute, _carry_kv(sl))
        return (_bhsd(state["dq"]).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None)
