"""Sequence-parallel attention on real ranks, against torch's scaled_dot_product_attention on the
full sequence computed in one process (here, on every rank, from the same seeded inputs).

Run under ``mpiexec -n N`` (mpi), torchrun (gloo), or as one plain process (self). Each rank
slices its own expected rows out of the full reference by the layout's definition written here
(chunks r, or r and 2N-1-r), never with the library's helpers. Messages are counted by wrapping
``commlib.batch_isend_irecv`` / ``commlib.all_to_all_single`` (the calls still run).
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _harness import expect_error, main  # noqa: E402

import commlib  # noqa: E402
from commlib.errors import CommMismatchError  # noqa: E402
from commlib.nn import SequenceParallelAttention  # noqa: E402
from commlib.nn import functional as F  # noqa: E402

RTOL = 1e-5  # max |got - expected| <= RTOL * max |expected|, float32


def world():
    return commlib.get_rank(), commlib.get_world_size()


def my_chunks(layout, r, n):
    return [r] if layout == "contiguous" else [r, 2 * n - 1 - r]


def local(x, layout, dim=1):
    """This rank's rows of the full tensor x, by the layout's definition."""
    r, n = world()
    per = 1 if layout == "contiguous" else 2
    c = x.shape[dim] // (per * n)
    return torch.cat([x.narrow(dim, g * c, c) for g in my_chunks(layout, r, n)], dim)


def inputs(b, s, h, hk, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g) * 1.5  # peaked softmaxes
    k = torch.randn(b, s, hk, d, generator=g) * 1.5
    v = torch.randn(b, s, hk, d, generator=g)
    do = torch.randn(b, s, h, d, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]


def reference(q, k, v, do, causal, scale=None):
    """Full-sequence out, lse, dq, dk, dv with torch (SDPA; lse from the scores in float64)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    h, hk = q.shape[2], k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
        enable_gqa=h != hk, scale=scale).transpose(1, 2)
    out.backward(do)
    kr = k.detach().double().repeat_interleave(h // hk, dim=2)
    sc = torch.einsum("bqhd,bkhd->bhqk", q.detach().double(), kr) * (scale or q.shape[3] ** -0.5)
    if causal:
        s = q.shape[1]
        sc = sc.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return out.detach(), torch.logsumexp(sc, -1), q.grad, k.grad, v.grad


def close(name, got, want, rtol=RTOL, scale=None):
    """max |got - want| <= rtol * max |want| (or rtol * scale)."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    err = (got.double() - want.double()).abs().max().item()
    bound = rtol * (want.double().abs().max().item() if scale is None else scale)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (rank {commlib.get_rank()})"


class Count:
    """Counts sends/receives passing through commlib's public p2p and all-to-all calls."""

    def __enter__(self):
        self.batches = self.sends = self.recvs = self.alltoall = 0
        self._b, self._a = commlib.batch_isend_irecv, commlib.all_to_all_single

        def batch(ops):
            self.batches += 1
            self.sends += sum(op.op is commlib.isend for op in ops)
            self.recvs += sum(op.op is commlib.irecv for op in ops)
            return self._b(ops)

        def a2a(*args, **kwargs):
            self.alltoall += 1
            return self._a(*args, **kwargs)

        commlib.batch_isend_irecv, commlib.all_to_all_single = batch, a2a
        return self

    def __exit__(self, *exc):
        commlib.batch_isend_irecv, commlib.all_to_all_single = self._b, self._a


def run_ring(algorithm, layout, causal, h, hk, chunk, seed, d=8, b=2, dtype=torch.float32,
             rtol=RTOL, head_chunks=None, seq_chunks=None):
    _, n = world()
    per = 1 if layout == "contiguous" else 2
    s = chunk * per * n
    q, k, v, do = inputs(b, s, h, hk, d, seed)
    out, lse, dq, dk, dv = reference(q, k, v, do, causal)
    ql, kl, vl = (local(t, layout).to(dtype).requires_grad_() for t in (q, k, v))
    with Count() as fwd:
        o, lse_got = F.ring_attention(ql, kl, vl, causal=causal, layout=layout, return_lse=True,
                                algorithm=algorithm, head_chunks=head_chunks,
                                seq_chunks=seq_chunks)
    with Count() as bwd:
        o.backward(local(do, layout).to(dtype))
    what = f"{algorithm} {layout} causal={causal} h={h}/{hk} s={s}"
    close(f"out {what}", o.float(), local(out, layout), rtol)
    close(f"lse {what}", lse_got.double(), local(lse, layout, dim=2), rtol)
    for name, got, want in (("dq", ql.grad, dq), ("dk", kl.grad, dk), ("dv", vl.grad, dv)):
        assert got.dtype == dtype, (name, got.dtype)
        close(f"{name} {what}", got.float(), local(want, layout), rtol)
    # messages: K and V hop N-1 times forward (twice over for rsa: K pass, V pass); backward
    # K/V hop N-1 times and the (dK, dV) accumulators N times, in 2N-1 batches; all of it once
    # per ring pass (documented default: one head group per KV head times key segments of at
    # least 768 tokens of each layout chunk, up to 32 passes in all; 1 if N = 1).
    ring = algorithm == "ring" and n > 1
    if head_chunks is None:
        head_chunks = hk if ring else 1
    if seq_chunks is None:
        seq_chunks = max(1, min(-(-32 // head_chunks), chunk // 768)) if ring else 1
    # The ring packs a pass's K and V (and its dK and dV) in one message; rsa sends each alone.
    passes = 2 if algorithm == "rsa" else head_chunks * seq_chunks
    if n == 1:
        assert (fwd.batches, bwd.batches, fwd.sends + bwd.sends) == (0, 0, 0)
    else:
        assert (fwd.batches, fwd.sends, fwd.recvs) == \
            (passes * (n - 1), passes * (n - 1), passes * (n - 1)), vars(fwd)
        passes = head_chunks * seq_chunks  # rsa's backward is one pass
        per_hop = 2 if algorithm == "rsa" else 1
        hops = passes * per_hop * ((n - 1) + n)
        batches = passes * (2 * n - 1)  # K/V hops with compute, accumulators between steps
        assert (bwd.batches, bwd.sends, bwd.recvs) == (batches, hops, hops), vars(bwd)


# ----- cases -------------------------------------------------------------------------------------
def case_ring_matrix():
    """ring and rsa x zigzag/contiguous x causal or not x (odd head count MHA, GQA 4:1), at a
    non-power-of-two length (10 tokens per rank), out/lse/dq/dk/dv and message counts."""
    for seed, (alg, layout, causal, (h, hk)) in enumerate(itertools.product(
            ("ring", "rsa"), ("zigzag", "contiguous"), (False, True), ((5, 5), (8, 2)))):
        run_ring(alg, layout, causal, h, hk, chunk=5, seed=seed)


def case_ring_odd_lengths():
    """Longer odd chunks (2N x 13 and N x 37 tokens), one KV head for 4 query heads."""
    run_ring("ring", "zigzag", True, 4, 1, chunk=13, seed=100)
    run_ring("ring", "contiguous", True, 4, 1, chunk=37, seed=101)
    run_ring("ring", "contiguous", False, 3, 3, chunk=37, seed=102)
    run_ring("ring", "zigzag", True, 8, 4, chunk=6, seed=103, head_chunks=4)
    run_ring("ring", "zigzag", False, 8, 4, chunk=6, seed=104, head_chunks=1)
    # key segments: uneven (chunks of 13 tokens in 3 and 4), down to one token each
    run_ring("ring", "zigzag", True, 4, 2, chunk=13, seed=105, seq_chunks=3)
    run_ring("ring", "contiguous", False, 4, 2, chunk=13, seed=106, head_chunks=1, seq_chunks=4)
    run_ring("ring", "zigzag", True, 2, 1, chunk=3, seed=107, seq_chunks=3)


def case_default_segments():
    """Long enough for the default to cut the keys into segments (1536 tokens per rank, one
    head: 2 segments of 768); gradients exact, message counts per pass."""
    run_ring("ring", "contiguous", True, 1, 1, chunk=1536, seed=108, d=4, b=1)


def case_low_precision():
    """bfloat16 in, gradients come back in bfloat16 (no hard-coded dtype), within bf16 error."""
    run_ring("ring", "zigzag", True, 4, 2, chunk=8, seed=200, dtype=torch.bfloat16, rtol=3e-2)


def case_float64():
    """float64 runs through the same kernels at float64 accuracy."""
    _, n = world()
    q, k, v, do = (t.double() for t in inputs(1, 4 * n, 3, 1, 8, 300))
    ql, kl, vl = (local(t, "zigzag").requires_grad_() for t in (q, k, v))
    o = F.ring_attention(ql, kl, vl, causal=True)
    o.backward(local(do, "zigzag"))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), is_causal=True,
        enable_gqa=True).transpose(1, 2)
    ref.backward(do)
    for got, want in ((o, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)):
        close("float64", got, local(want.detach(), "zigzag"), 1e-12)


def case_ulysses():
    """all-to-all over heads, contiguous layout; 4 all-to-alls forward and 4 backward."""
    _, n = world()
    for seed, (causal, (h, hk)) in enumerate(itertools.product(
            (False, True), ((2 * n, n), (4 * n, n), (3 * n, 3 * n)))):
        s = 7 * n
        q, k, v, do = inputs(2, s, h, hk, 8, 400 + seed)
        out, _, dq, dk, dv = reference(q, k, v, do, causal)
        ql, kl, vl = (local(t, "contiguous").requires_grad_() for t in (q, k, v))
        with Count() as fwd:
            o = F.ulysses_attention(ql, kl, vl, causal=causal)
        with Count() as bwd:
            o.backward(local(do, "contiguous"))
        close("ulysses out", o, local(out, "contiguous"))
        for name, got, want in (("dq", ql.grad, dq), ("dk", kl.grad, dk), ("dv", vl.grad, dv)):
            close(f"ulysses {name}", got, local(want, "contiguous"))
        assert (fwd.alltoall, bwd.alltoall) == ((4, 4) if n > 1 else (0, 0))


def case_shard_roundtrip():
    """shard_sequence gives the layout's chunks; unshard_sequence restores global order; the
    unshard gradient is the rank's slice."""
    r, n = world()
    for layout in ("zigzag", "contiguous"):
        per = 1 if layout == "contiguous" else 2
        x = torch.arange(2 * 3 * per * n * 2, dtype=torch.float32).view(2, 3 * per * n, 2)
        mine = F.shard_sequence(x, dim=1, layout=layout)
        assert torch.equal(mine, local(x, layout)), layout
        y = mine.clone().requires_grad_()
        full = F.unshard_sequence(y, dim=-2, layout=layout)
        assert torch.equal(full, x), layout
        # each rank's loss weights the full tensor differently: sum(full * x * (rank + 1))
        full.backward(x * (r + 1))  # grad="sum": d(sum of every rank's loss)/d(shard)
        assert torch.equal(y.grad, local(x * (n * (n + 1) // 2), layout)), layout
        y2 = mine.clone().requires_grad_()
        F.unshard_sequence(y2, dim=-2, layout=layout, grad="local").backward(x * (r + 1))
        assert torch.equal(y2.grad, local(x * (r + 1), layout)), layout




def case_debug_mismatch():
    """Under COMMLIB_DEBUG=1, ranks that disagree on a call's shapes or options raise
    CommMismatchError on every rank (naming the odd rank and both descriptions) instead of
    hanging in the ring; a rank whose own checks fail raises its error and the others name it."""
    r, n = world()
    assert commlib.get_world_group().debug, "run with COMMLIB_DEBUG=1"
    last = n - 1
    q = torch.randn(1, 6 if r == last else 4, 2, 8)  # the last rank has another seq_local
    expect_error(lambda: F.ring_attention(q, q, q, causal=True), "ring_attention",
                 f"ranks [{last}] differ", "(1, 6, 2, 8)", "(1, 4, 2, 8)", kind=CommMismatchError)
    q = torch.randn(1, 4, 2, 8)
    expect_error(lambda: F.ring_attention(q, q, q, layout="contiguous" if r == last else "zigzag"),
                 "layout=contiguous", f"ranks [{last}] differ", kind=CommMismatchError)
    qu = torch.randn(1, 4, n, 8)
    expect_error(lambda: F.ulysses_attention(qu, qu, qu, causal=r == last), "ulysses_attention",
                 "causal=True", kind=CommMismatchError)
    x = torch.randn(2, 6 if r == last else 4, 3)
    expect_error(lambda: F.unshard_sequence(x), "unshard_sequence", "(2, 6, 3)",
                 kind=CommMismatchError)
    bad = torch.randn(1, 3, 2, 8) if r == 0 else q  # rank 0 alone fails its length check
    if r == 0:
        expect_error(lambda: F.ring_attention(bad, bad, bad), "length 3", "divide by 2")
    else:
        expect_error(lambda: F.ring_attention(bad, bad, bad), "ranks [0] failed",
                     kind=CommMismatchError)
    o = F.ring_attention(q, q, q, causal=True)  # agreeing ranks still run
    assert o.shape == q.shape and torch.isfinite(o).all()


def case_errors():
    """Indivisible lengths and heads raise a clear CommArgumentError on every rank."""
    r, n = world()
    q = torch.randn(1, 3, 4, 8)  # 3 tokens: not two equal zigzag chunks
    expect_error(lambda: F.ring_attention(q, q, q), "ring_attention", "'q'", "length 3",
                 "divide by 2", "pad")
    x = torch.randn(1, 2 * n + 1, 4)
    expect_error(lambda: F.shard_sequence(x), "shard_sequence", "'x'", f"divide by {2 * n}", "pad")
    expect_error(lambda: F.ring_attention(q, q, q, layout="stripes"), "layout", "stripes")
    expect_error(lambda: F.ring_attention(q, q[:, :, :3], q[:, :, :3], layout="contiguous"),
                 "multiple of the 3 KV heads")
    q4 = torch.randn(1, 4, 4, 8)
    for bad in (0, 3, 2.0, True):
        expect_error(lambda bad=bad: F.ring_attention(q4, q4, q4, seq_chunks=bad), "seq_chunks",
                     repr(bad), "from 1 to the 2 tokens of a layout chunk")
    expect_error(lambda: F.ring_attention(q4, q4, q4, algorithm="rsa", seq_chunks=2),
                 "seq_chunks", "1 for rsa")
    if n > 1:
        qh = torch.randn(1, 4, n + 1, 8)
        expect_error(lambda: F.ulysses_attention(qh, qh, qh), "ulysses_attention",
                     f"heads must divide by the group size {n}", "ring_attention")


def case_module():
    """SequenceParallelAttention (GQA, causal) on shards = the same projections and attention on
    the full sequence; weight gradients summed over ranks = the one-process gradients."""
    r, n = world()
    for algorithm in ("ring", "rsa", "ulysses"):
        torch.manual_seed(7)
        heads, kv = (4 * n, n) if algorithm == "ulysses" else (4, 1)
        m = SequenceParallelAttention(8 * heads, heads, kv, causal=True, algorithm=algorithm)
        g = torch.Generator().manual_seed(8)
        x = torch.randn(2, 6 * n, 8 * heads, generator=g)
        dy = torch.randn(2, 6 * n, 8 * heads, generator=g)
        y = m(F.shard_sequence(x, layout=m.layout))
        y.backward(F.shard_sequence(dy, layout=m.layout))
        grads = [p.grad.clone() for p in m.parameters()]
        for t in grads:
            commlib.all_reduce(t)
        # reference: the same weights, plain torch on the full sequence
        b, s, e = x.shape
        hd = e // heads
        q = m.q_proj(x).view(b, s, heads, hd).transpose(1, 2)
        k = m.k_proj(x).view(b, s, kv, hd).transpose(1, 2)
        v = m.v_proj(x).view(b, s, kv, hd).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)
        ref = m.out_proj(a.transpose(1, 2).reshape(b, s, e))
        m.zero_grad()
        ref.backward(dy)
        close(f"module {algorithm} out", y.detach(), local(ref.detach(), m.layout), 1e-5)
        # k_proj.bias has an exactly-zero gradient (softmax ignores a per-row shift): errors are
        # measured against the largest weight gradient
        top = max(p.grad.abs().max().item() for p in m.parameters())
        for (name, p), got in zip(m.named_parameters(), grads):
            close(f"module {algorithm} {name}.grad", got, p.grad, 1e-5, scale=top)


if __name__ == "__main__":
    main(globals())
