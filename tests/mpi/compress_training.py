"""The training pieces of commlib.compress on real ranks: the differentiable tensor-parallel
collectives, RowParallelLinear(compress=...), pipeline activations and the DDP hook, each against
a dense single-process computation that every rank repeats from the same seeds.

Gradients arriving at the functions are small integers, so that exact reductions of them are
exact in float32 (any order): an exact backward must equal the dense gradient bit for bit, a
compressed one must stay within the codec's bound (or equal the codec's round trip, where the
collective encodes each value once).

Runs under ``mpiexec`` (every case) or torchrun-like (``case_ddp_int8_error_feedback``, by
tests/test_compress_training.py: commlib then runs on torch.distributed's gloo group, DDP's).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _harness import expect_error, init_gloo, main  # noqa: E402
from compress_cases import chunked_bound, data  # noqa: E402

import commlib  # noqa: E402
import commlib.compress as cc  # noqa: E402
from commlib.nn import ParallelMLP, RowParallelLinear  # noqa: E402
from commlib.nn.functional import traffic  # noqa: E402

CODECS = [cc.codec("int8"), cc.codec("fp8")]
MODES = ("exact", "compressed")


def world():
    return commlib.get_rank(), commlib.get_world_size()


def ints(r: int, shape, seed: int) -> torch.Tensor:
    """Rank ``r``'s output gradient: integers in [-3, 3] (float32 sums of them are exact)."""
    g = torch.Generator().manual_seed(7919 * seed + r)
    return torch.randint(-3, 4, shape, generator=g).float()


def roundtrip(c, t: torch.Tensor) -> torch.Tensor:
    """What one encode and decode of ``t`` gives: what a compressed send or all-gather delivers."""
    return c.decode(c.encode(t))


def sum_bound(c, ts, p: int) -> torch.Tensor:
    """The compressed all-reduce's error bound on the sum of ``ts`` (one per rank), shaped like
    them: every contribution's bound, cut as the all-reduce cuts it, plus the owner's encode of
    the sum, plus float32 rounding."""
    flat = [t.reshape(-1) for t in ts]
    exact = torch.stack([t.double() for t in flat]).sum(0)
    bound = sum(chunked_bound(c, t, p) for t in flat) + chunked_bound(c, exact, p)
    return (bound + 1e-5 * (exact.abs() + 1)).view(ts[0].shape)


def within(got: torch.Tensor, want: torch.Tensor, bound, what) -> None:
    err = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64)  # a number where no rank contributes
    assert bool((err <= bound).all()), (what, float((err - bound).max()))


def same_on_every_rank(t: torch.Tensor, what) -> None:
    every = torch.empty((commlib.get_world_size(),) + tuple(t.shape), dtype=t.dtype)
    commlib.all_gather_into_tensor(every, t.detach().contiguous())
    assert bool((every == every[0]).all()), (what, "ranks differ")


# ----- the tensor-parallel functions ------------------------------------------------------------
def dense_grads(kind: str, xs, dys):
    """Every rank's input gradient from the dense computation (autograd on every rank's input at
    once): the output each rank gets, and the total loss sum_r <out_r, dy_r> (a replicated
    output of reduce_fn counts once: rank 0's)."""
    p = len(xs)
    if kind == "copy_fn":  # one replicated input
        x = xs[0].clone().requires_grad_()
        leaves, outs = [x] * p, [x] * p
    else:
        leaves = [x.clone().requires_grad_() for x in xs]
        total = torch.stack(leaves).sum(0)
        outs = {"all_reduce_fn": [total] * p, "reduce_fn": [total] * p,
                "reduce_scatter_fn": list(total.chunk(p)),
                "all_gather_fn": [torch.cat(leaves)] * p}[kind]
    pairs = list(zip(outs, dys))[:1] if kind == "reduce_fn" else zip(outs, dys)
    sum((o * d).sum() for o, d in pairs).backward()
    return [leaf.grad.clone() for leaf in leaves]


def case_tp_functions_against_dense():
    """all_reduce_fn, reduce_fn, copy_fn, reduce_scatter_fn, all_gather_fn: outputs and input
    gradients against the dense computation, for every codec and backward mode; inputs and
    incoming gradients are never written to."""
    rank, p = world()
    shape = (2 * p, 3 * p + 1)  # rows split over the ranks; an uneven number of elements
    hop = roundtrip if p > 1 else (lambda c, t: t)  # one rank: nothing travels, nothing encoded
    for seed, c in enumerate(CODECS):
        for mode in MODES:
            for kind in ("all_reduce_fn", "reduce_fn", "copy_fn", "reduce_scatter_fn",
                         "all_gather_fn"):
                xs = [data(0 if kind == "copy_fn" else r, shape[0] * shape[1], seed=seed)
                      .view(shape) for r in range(p)]
                out_shape = {"reduce_scatter_fn": (2, shape[1]),
                             "all_gather_fn": (2 * p * p, shape[1])}.get(kind, shape)
                dys = [ints(0 if kind == "reduce_fn" else r, out_shape, seed) for r in range(p)]
                f = getattr(cc, kind)
                opts = {} if kind == "reduce_fn" else {"backward": mode}
                if kind in ("all_reduce_fn", "reduce_fn", "copy_fn"):
                    opts["algorithm"] = "compressed"
                x = xs[rank].clone().requires_grad_()
                dy = dys[rank].clone()
                with traffic() as fwd:
                    y = f(x, codec=c, **opts)
                what = (kind, repr(c), mode)
                # the codec runs where it should, and only there (this rank's sent wire bytes)
                assert (fwd.by_kind.get("compress.wire", 0) > 0) == (p > 1 and kind != "copy_fn"), what
                # forward
                total = torch.stack(xs).sum(0)
                m = shape[0] // p
                if kind in ("all_reduce_fn", "reduce_fn"):
                    within(y, total, sum_bound(c, xs, p), what)
                    same_on_every_rank(y, what)
                elif kind == "copy_fn":
                    assert torch.equal(y, xs[rank]), what
                elif kind == "reduce_scatter_fn":
                    mine = slice(rank * m, (rank + 1) * m)
                    bound = sum(c.bound(xs[r][mine]) for r in range(p) if r != rank)
                    within(y, total[mine], bound + 1e-5 * (total[mine].abs() + 1), what)
                else:
                    assert torch.equal(y, torch.cat([hop(c, t) for t in xs])), what
                # backward
                with traffic() as bwd:
                    y.backward(dy)
                compressed = p > 1 and mode == "compressed" and kind != "reduce_fn"
                assert (bwd.by_kind.get("compress.wire", 0) > 0) == compressed, what
                assert torch.equal(x.detach(), xs[rank]) and torch.equal(dy, dys[rank]), what
                want = dense_grads(kind, xs, dys)[rank]
                if mode == "exact" or kind == "reduce_fn":
                    assert torch.equal(x.grad, want), what
                elif kind in ("all_reduce_fn", "copy_fn"):
                    within(x.grad, want, sum_bound(c, dys, p), what)
                    same_on_every_rank(x.grad, what)
                elif kind == "reduce_scatter_fn":  # a compressed all-gather: each block round-tripped
                    assert torch.equal(x.grad, torch.cat([hop(c, d) for d in dys])), what
                else:  # a compressed reduce-scatter of the gradient
                    blk = slice(rank * 2 * p, (rank + 1) * 2 * p)
                    bound = sum(c.bound(dys[r][blk]) for r in range(p) if r != rank)
                    within(x.grad, want, bound + 1e-5, what)


def _mlp_partial(x, fc1, fc2, s: int, p: int):
    """Rank ``s``'s partial output of the tensor-parallel MLP, from the dense layers' values
    (differentiable in ``x`` only)."""
    f = fc1.out_features // p
    cols = slice(s * f, (s + 1) * f)
    w1, b1, w2 = fc1.weight.detach()[cols], fc1.bias.detach()[cols], fc2.weight.detach()[:, cols]
    return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2)


def case_mlp_against_dense():
    """Megatron's MLP from copy_fn and reduce_fn (compressed output all-reduce; input gradient
    all-reduce exact or compressed) against the dense MLP: the output, the input gradient and
    every parameter's gradient."""
    rank, p = world()
    hidden, ffn = 12, 8 * p
    c = cc.codec("int8")
    torch.manual_seed(3)
    fc1, fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
    x0 = torch.randn(2, 5, hidden)
    dy = ints(0, (2, 5, hidden), 9)  # the replicated output's gradient: the same on every rank
    xd = x0.clone().requires_grad_()
    yd = fc2(torch.nn.functional.gelu(fc1(xd)))
    yd.backward(dy)
    f = ffn // p
    cols = slice(rank * f, (rank + 1) * f)
    with torch.no_grad():
        parts = [_mlp_partial(x0, fc1, fc2, s, p) for s in range(p)]
    dxs = []  # every rank's partial input gradient, for the compressed backward's bound
    for s in range(p):
        xs_ = x0.clone().requires_grad_()
        _mlp_partial(xs_, fc1, fc2, s, p).backward(dy)
        dxs.append(xs_.grad)
    for mode in MODES:
        w1 = fc1.weight.detach()[cols].clone().requires_grad_()
        b1 = fc1.bias.detach()[cols].clone().requires_grad_()
        w2 = fc2.weight.detach()[:, cols].clone().requires_grad_()
        b2 = fc2.bias.detach().clone().requires_grad_()
        x = x0.clone().requires_grad_()
        h = torch.nn.functional.gelu(torch.nn.functional.linear(
            cc.copy_fn(x, codec=c, backward=mode, algorithm="compressed"), w1, b1))
        y = cc.reduce_fn(torch.nn.functional.linear(h, w2), codec=c, algorithm="compressed") + b2
        within(y, yd.detach(), sum_bound(c, parts, p) + 1e-5, ("mlp out", mode))
        y.backward(dy)
        for got, want in ((w1.grad, fc1.weight.grad[cols]), (b1.grad, fc1.bias.grad[cols]),
                          (w2.grad, fc2.weight.grad[:, cols]), (b2.grad, fc2.bias.grad)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if mode == "exact":
            torch.testing.assert_close(x.grad, xd.grad, rtol=1e-5, atol=1e-5)
        else:
            within(x.grad, xd.grad, sum_bound(c, dxs, p) + 1e-5, ("mlp dx", mode))
        same_on_every_rank(x.grad, ("mlp dx", mode))


def case_row_parallel_compress():
    """RowParallelLinear(compress=...): the output within the codec's bound of nn.Linear's, the
    input and parameter gradients nn.Linear's (the backward stays exact), with and without
    sequence parallelism; the codec really runs (compress.wire bytes)."""
    rank, p = world()
    c = cc.codec("int8")
    torch.manual_seed(5)
    dense = nn.Linear(4 * p, 6)
    for sp in (False, True):
        layer = RowParallelLinear.from_dense(dense, input_is_parallel=sp, sequence_parallel=sp,
                                             compress="int8", compress_algorithm="compressed")
        assert layer.compress == c and "compress=codec('int8'" in repr(layer)
        x0 = torch.randn(2 * p, 3, 4 * p)
        cols = slice(rank * 4, (rank + 1) * 4)
        ref = nn.Linear(4 * p, 6)
        ref.load_state_dict(dense.state_dict())
        xd = x0.clone().requires_grad_()
        yd = ref(xd)
        dy_full = ints(0, yd.shape, 11)
        yd.backward(dy_full)
        x = (x0[..., cols] if sp else x0).clone().requires_grad_()
        with traffic() as tr:
            y = layer(x)
        assert (tr.by_kind.get("compress.wire", 0) > 0) == (p > 1), tr.by_kind
        with torch.no_grad():
            parts = [torch.nn.functional.linear(x0[..., s * 4:(s + 1) * 4],
                                                dense.weight[:, s * 4:(s + 1) * 4]) for s in range(p)]
        if sp:
            rows = slice(rank * 2, (rank + 1) * 2)
            bound = sum(c.bound(parts[s][rows]) for s in range(p) if s != rank) + 1e-5
            within(y, yd.detach()[rows], bound, ("row sp out", rank))
            y.backward(dy_full[rows])
            torch.testing.assert_close(x.grad, xd.grad[..., cols], rtol=1e-5, atol=1e-5)
        else:
            within(y, yd.detach(), sum_bound(c, parts, p) + 1e-5, "row out")
            y.backward(dy_full)
            torch.testing.assert_close(x.grad, xd.grad, rtol=1e-5, atol=1e-5)
        back = layer.to_dense()
        torch.testing.assert_close(back.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(back.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


def case_parallel_mlp_compress():
    """ParallelMLP(compress=...), i.e. ColumnParallelLinear and RowParallelLinear with a codec,
    with and without sequence parallelism, compress_backward None (the layers' defaults), exact
    and compressed, against the dense MLP run on what the codec delivers: where a collective
    moves values rather than sums (a compressed all-gather), the dense run takes their round trip
    and must then agree to float rounding; where it sums, within the codec's bound. Outputs, the
    input gradient and every parameter's gradient (gathered by to_dense); the codec runs in a
    direction exactly where asked (compress.wire bytes)."""
    rank, p = world()
    c = cc.codec("int8")
    hidden, ffn, seq = 12, 8 * p, 2 * p
    torch.manual_seed(13)
    fc1, fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
    x0 = torch.randn(seq, 3, hidden)
    dy = ints(0, (seq, 3, hidden), 17)  # the total output gradient
    rows = slice(rank * 2, (rank + 1) * 2)  # this rank's sequence shard
    coded = p > 1  # one rank: no collective, no codec

    def gathered(t):  # what a compressed all-gather of every rank's sequence shard delivers
        return torch.cat([roundtrip(c, t[s * 2:(s + 1) * 2]) for s in range(p)]) if coded else t

    for sp in (False, True):
        for mode in (None, "exact", "compressed"):
            what = ("parallel mlp", sp, mode)
            back = mode or ("exact" if sp else "compressed")  # the layers' defaults
            mlp = ParallelMLP.from_dense(fc1, fc2, sequence_parallel=sp, compress="int8",
                                         compress_backward=mode, compress_algorithm="compressed")
            assert mlp.fc1.compress == c and mlp.fc2.compress == c, what
            x_in = gathered(x0) if sp else x0  # the input the GEMMs see
            dy_in = gathered(dy) if sp and back == "compressed" else dy  # fc2's gathered dy
            # the dense run on those
            ref1, ref2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
            ref1.load_state_dict(fc1.state_dict())
            ref2.load_state_dict(fc2.state_dict())
            ref2(torch.nn.functional.gelu(ref1(x_in))).backward(dy_in)
            with torch.no_grad():
                parts = [_mlp_partial(x_in, fc1, fc2, s, p) for s in range(p)]
            dxs = []  # every rank's partial input gradient
            for s in range(p):
                xs_ = x_in.clone().requires_grad_()
                _mlp_partial(xs_, fc1, fc2, s, p).backward(dy_in)
                dxs.append(xs_.grad)
            want_y = torch.stack(parts).sum(0) + fc2.bias.detach()
            want_dx = torch.stack(dxs).sum(0)
            x = (x0[rows] if sp else x0).clone().requires_grad_()
            with traffic() as fwd:
                y = mlp(x)
            with traffic() as bwd:
                y.backward(dy[rows] if sp else dy)
            assert (fwd.by_kind.get("compress.wire", 0) > 0) == coded, (what, fwd.by_kind)
            assert (bwd.by_kind.get("compress.wire", 0) > 0) == (coded and back == "compressed"), \
                (what, bwd.by_kind)
            if sp:  # reduce-scatters: the rank's own part exact, the others' encoded once
                within(y, want_y[rows], sum(c.bound(parts[s][rows]) for s in range(p)
                                            if s != rank) + 1e-5, what + ("out",))
                dx_bound = sum(c.bound(dxs[s][rows]) for s in range(p) if s != rank) \
                    if back == "compressed" else 0
                within(x.grad, want_dx[rows], dx_bound + 1e-5, what + ("dx",))
            else:  # all-reduces: every part encoded, then the owner's sum
                within(y, want_y, (sum_bound(c, parts, p) if coded else 0) + 1e-5,
                       what + ("out",))
                dx_bound = sum_bound(c, dxs, p) if coded and back == "compressed" else 0
                within(x.grad, want_dx, dx_bound + 1e-5, what + ("dx",))
                same_on_every_rank(x.grad, what + ("dx",))
            d1, d2 = mlp.to_dense()
            for got, want in ((d1.weight.grad, ref1.weight.grad), (d1.bias.grad, ref1.bias.grad),
                              (d2.weight.grad, ref2.weight.grad)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(what))
            # the replicated bias's gradient is summed exact from every rank's own dy
            torch.testing.assert_close(d2.bias.grad, dy.sum((0, 1)), rtol=1e-5, atol=1e-5,
                                       msg=str(what))
    expect_error(lambda: ParallelMLP(8, 4 * p, compress="int8", compress_backward="approx"),
                 "compress_backward", "Fix:")
    expect_error(lambda: ParallelMLP(8, 4 * p, compress="int8", compress_algorithm="ring"),
                 "compress_algorithm", "Fix:")


# ----- pipeline activations ---------------------------------------------------------------------
class _RoundTrip(torch.autograd.Function):
    """The dense stand-in of one hop: the codec's round trip forward, and backward too when the
    gradient travels compressed."""

    @staticmethod
    def forward(ctx, x, c, backward_too):
        ctx.c, ctx.backward_too = c, backward_too
        return roundtrip(c, x)

    @staticmethod
    def backward(ctx, g):
        return (roundtrip(ctx.c, g) if ctx.backward_too else g), None, None


def _stage_weight(r: int) -> torch.Tensor:
    return 1 + 0.5 * data(r, 10, seed=40)


def _chain(x, weights, target, hop):
    """The pipeline's whole computation: stage r is tanh(h * w_r), the hops between stages
    ``hop``, the loss <last output, target>."""
    h = x
    for r, w in enumerate(weights):
        h = torch.tanh((hop(h) if r else h) * w)
    return (h * target).sum()


def case_pipeline_activations():
    """A chain of one stage per rank (0 -> 1 -> ... -> p-1), activations sent compressed and
    gradients back exact or compressed: every stage's weight gradient and the first stage's
    input gradient equal the dense chain's with the codec's round trips at the same places, and
    stay near the uncompressed chain's."""
    rank, p = world()
    c = cc.codec("int8", block=16)
    x0 = data(0, 60, seed=41).view(6, 10)
    target = data(0, 60, seed=42).view(6, 10)
    for tag, mode in enumerate(MODES):
        opts = dict(codec=c, backward=mode, tag=tag)
        leaves = [_stage_weight(r).requires_grad_() for r in range(p)]
        x_ref = x0.clone().requires_grad_()
        both = mode == "compressed"
        _chain(x_ref, leaves, target, lambda h, both=both: _RoundTrip.apply(h, c, both)).backward()
        plain = [_stage_weight(r).requires_grad_() for r in range(p)]
        _chain(x0, plain, target, lambda h: h).backward()
        w = _stage_weight(rank).requires_grad_()
        x = x0.clone().requires_grad_()
        h = x if rank == 0 else cc.recv_activation(x0.shape, x0.dtype, rank - 1, **opts)
        y = torch.tanh(h * w)
        with traffic() as tr:
            if rank == p - 1:
                (y * target).sum().backward()
            else:
                token = cc.send_activation(y, rank + 1, **opts)
                assert token.dim() == 0 and token.requires_grad
                token.backward()
        # bytes this rank sent compressed: the activation (not from the last stage) and the
        # gradient back (not from the first), each one encode of 60 values
        hops = (rank < p - 1) + (rank > 0 and mode == "compressed")
        assert tr.by_kind.get("compress.wire", 0) == hops * c.nbytes(60), (tr.by_kind, hops)
        torch.testing.assert_close(w.grad, leaves[rank].grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(w.grad, plain[rank].grad, rtol=0.05, atol=0.05)
        if rank == 0:
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-7)
        else:
            assert h.requires_grad and x.grad is None


# ----- the DDP hook ---------------------------------------------------------------------------
class FakeBucket:
    """What the hook reads of a dist.GradBucket (index, flat buffer, parameters)."""

    def __init__(self, index: int, buf: torch.Tensor, params):
        self._index, self._buf, self._params = index, buf, params

    def index(self):
        return self._index

    def buffer(self):
        return self._buf

    def parameters(self):
        return self._params


def case_ddp_hook_buckets():
    """The hook averages the bucket in place (within the codec's bound, the same bits on every
    rank) and starts a fresh residual when a bucket index changes layout (DDP's rebuild after
    the first iteration) instead of raising."""
    rank, p = world()
    c = cc.codec("int8")
    state, hook = cc.ddp_hook(c, algorithm="compressed")
    params_a, params_b = [torch.zeros(100)], [torch.zeros(40), torch.zeros(20)]
    for step, (n, params) in enumerate([(100, params_a), (100, params_a), (60, params_b),
                                        (60, params_b)]):
        xs = [data(r, n, seed=50 + step) for r in range(p)]
        buf = xs[rank].clone()
        fut = hook(state, FakeBucket(0, buf, params))
        assert fut.done() and fut.value().data_ptr() == buf.data_ptr()
        if step == 0:  # no residual yet: the plain compressed average (the owner encodes it)
            mean = torch.stack(xs).mean(0)
            bound = sum(chunked_bound(c, x, p) for x in xs) / p + chunked_bound(c, mean, p)
            within(buf, mean, bound + 1e-5 * (mean.abs() + 1), "hook avg")
        same_on_every_rank(buf, ("hook", step))
    assert state.calls == 4 and state.resets == 1, (state.calls, state.resets)
    state, hook = cc.ddp_hook("int8", error_feedback=False, algorithm="compressed")
    assert state.feedback(FakeBucket(0, torch.zeros(3), [])) is None
    expect_error(lambda: cc.ddp_hook("int8", algorithm="ring"), "algorithm", "Fix:")
    expect_error(lambda: cc.ddp_hook("int8", error_feedback=1), "error_feedback",
                 kind=commlib.CommTypeError)


def case_ddp_hook_overlap():
    """The hook on its own thread (``overlap=True``) gives, bucket after bucket, the same bits as
    the hook run in the call, error feedback and the layout change included; its futures hold the
    bucket's buffer; ``"auto"`` overlaps only where a thread could (a core free on this host);
    ``overlap`` takes True, False or "auto" (default False); a failure on the thread reaches the
    future and the thread goes on."""
    from commlib.topology.affinity import host_cpu_count

    rank, p = world()
    in_call, hook = cc.ddp_hook("int8", algorithm="compressed", overlap=False)
    threaded, _ = cc.ddp_hook("int8", algorithm="compressed", overlap=True)
    assert not in_call.overlap and threaded.overlap
    params_a, params_b = [torch.zeros(100)], [torch.zeros(40), torch.zeros(20)]
    params_c = [torch.zeros(30)]  # bucket 1's layout stays
    steps = [(100, params_a), (100, params_a), (60, params_b), (60, params_b)]
    for step, (n, params) in enumerate(steps):
        x = data(rank, n, seed=70 + step)
        a, b = x.clone(), x.clone()
        hook(in_call, FakeBucket(0, a, params)).wait()
        futures = [hook(threaded, FakeBucket(0, b, params))]
        # a second bucket queued behind the first: the thread runs them in order
        c = data(rank, 30, seed=90 + step)
        futures.append(hook(threaded, FakeBucket(1, c.clone(), params_c)))
        got = [f.wait() for f in futures]  # before the next collective in this thread
        assert got[0].data_ptr() == b.data_ptr()
        assert torch.equal(a, b), (step, (a - b).abs().max())
        expect = c.clone()
        hook(in_call, FakeBucket(1, expect, params_c)).wait()
        assert torch.equal(got[1], expect), step
    assert threaded.calls == in_call.calls == 8 and threaded.resets == in_call.resets == 1
    auto, _ = cc.ddp_hook("int8", overlap="auto")
    assert auto.overlap == (p < host_cpu_count()), (auto.overlap, p, host_cpu_count())
    assert not cc.ddp_hook("int8")[0].overlap  # the default: in the call
    expect_error(lambda: cc.ddp_hook("int8", overlap=1), "overlap", "Fix:")
    # a failure on the thread reaches the future (under COMMLIB_TIMEOUT_MODE=raise; the default
    # ends the process, as the torch backend's futures do), and the thread serves the next one
    from commlib.runtime.group import state as runtime_state
    mode, runtime_state.timeout_mode = runtime_state.timeout_mode, "raise"
    try:
        ints = torch.ones(8, dtype=torch.int64)
        bad = hook(threaded, FakeBucket(2, ints, [ints]))
        expect_error(bad.wait, "tensor", "int64", kind=commlib.CommTypeError)
    finally:
        runtime_state.timeout_mode = mode
    x = data(rank, 30, seed=99)
    a, b = x.clone(), x.clone()
    hook(in_call, FakeBucket(1, a, params_c)).wait()
    assert torch.equal(hook(threaded, FakeBucket(1, b, params_c)).wait(), a)


STEPS, BATCH = 200, 32


def _train(hook) -> tuple[float, float]:
    """A small MLP regressing a fixed random teacher plus noise, trained ``STEPS`` steps under
    DDP (each rank its slice of the step's global batch; SGD with momentum), from the same seed
    whatever the hook; returns the loss on a fixed evaluation set before and after."""
    rank, p = world()
    gen = torch.Generator().manual_seed(123)
    teacher = torch.randn(16, 1, generator=gen)
    x_eval = torch.randn(1024, 16, generator=gen)
    y_eval = torch.tanh(x_eval @ teacher) + 0.1 * torch.randn(1024, 1, generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 1))
    # 10 kB buckets: 2 in the first iteration, then DDP's rebuild (its first bucket may hold
    # 1 MiB) makes them 1, so the hook meets a bucket index whose element count changed
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with torch.no_grad():
        before = float(nn.functional.mse_loss(model(x_eval), y_eval))
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10_000 + step)
        x = torch.randn(BATCH * p, 16, generator=g)
        y = torch.tanh(x @ teacher) + 0.1 * torch.randn(BATCH * p, 1, generator=g)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
    for prm in model.parameters():
        same_on_every_rank(prm, "parameters after training")
    with torch.no_grad():
        return before, float(nn.functional.mse_loss(model(x_eval), y_eval))


def case_ddp_int8_error_feedback():
    """The issue's acceptance test: DDP trained 200 steps with the int8 hook with error feedback
    (the codec forced: on one host "auto" would run the exact all-reduce) ends within 2% of the
    loss of DDP's own exact all-reduce, from the same seed and data; the hook ran every step."""
    rank, p = world()
    init_gloo()  # DDP's process group
    before, exact = _train(None)
    state, hook = cc.ddp_hook("int8", error_feedback=True, algorithm="compressed")
    with traffic() as tr:
        _, compressed = _train((state, hook))
    wire = tr.by_kind.get("compress.wire", 0)
    assert state.calls >= STEPS and wire > 0, (state.calls, tr.by_kind)
    # the same training with the hook's all-reduces on its own thread: the same bits
    threaded = cc.ddp_hook("int8", error_feedback=True, algorithm="compressed", overlap=True)
    _, overlapped = _train(threaded)
    assert overlapped == compressed, (overlapped, compressed)
    rel = abs(compressed - exact) / exact
    if rank == 0:
        print(f"ddp losses after {STEPS} steps ({p} ranks): start {before:.6f}, exact {exact:.6f}, "
              f"int8+ef {compressed:.6f}, relative difference {rel:.2e}; hook calls {state.calls}, "
              f"residual resets {state.resets}, compress.wire bytes {wire}", flush=True)
    assert exact < 0.5 * before, (before, exact)  # it trains
    assert rel <= 0.02, (exact, compressed, rel)


# ----- errors -----------------------------------------------------------------------------------
def case_errors():
    rank, p = world()
    x = torch.ones(2 * p, 3)
    expect_error(lambda: cc.all_reduce_fn(x, codec="int8", backward="approx"), "backward", "Fix:")
    expect_error(lambda: cc.reduce_fn(x, codec="int8", algorithm="ring"), "algorithm", "Fix:")
    expect_error(lambda: cc.copy_fn(x.double(), codec="int8"), "x", kind=commlib.CommTypeError)
    expect_error(lambda: cc.all_reduce_fn(x, codec="int9"), "int8")
    if p > 1:
        expect_error(lambda: cc.reduce_scatter_fn(torch.ones(2 * p + 1, 3), codec="int8"),
                     "dim 0", "multiple of the group size", "Fix:")
    expect_error(lambda: cc.send_activation(x, "1", codec="int8"), "dst", kind=commlib.CommTypeError)
    expect_error(lambda: cc.recv_activation((2, 3), torch.float64, 0, codec="int8"), "dtype",
                 kind=commlib.CommTypeError)
    expect_error(lambda: cc.recv_activation("2x3", torch.float32, 0, codec="int8"), "shape",
                 kind=commlib.CommTypeError)


if __name__ == "__main__":
    main(globals())
