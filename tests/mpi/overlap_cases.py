"""Collective matmuls (commlib.overlap) on real ranks, against the dense computation in one
process (here, on every rank, from the same seeded inputs, in float64).

Run under ``mpiexec -n N`` or as one plain process. Every rank builds every rank's inputs from
seeds, computes the whole problem densely with torch autograd (the reference) and compares its
own outputs and gradients with it; messages are counted by wrapping ``commlib.isend`` /
``commlib.irecv`` (the calls still run) and compared with the plan's count.
"""

from __future__ import annotations

import itertools
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _harness import expect_error, main  # noqa: E402

import commlib  # noqa: E402
import commlib.overlap as ov  # noqa: E402
from commlib.errors import (  # noqa: E402
    CommMismatchError,
    CommTypeError,
    CommUnsupportedError,
)

# max |got - want| <= RTOL * max |want|, want computed in float64
RTOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}


# chunks= of each run (None: the plan's choice), compared with each other; fewer in float32 to
# keep the job short (the cuts are dtype-independent code)
CHUNKS = {torch.float64: (None, 0, 1, 2, 3), torch.float32: (None, 1, 3)}


def world():
    return commlib.get_rank(), commlib.get_world_size()


def close(name, got, want, dtype):
    assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
    assert got.dtype == dtype, (name, got.dtype, dtype)
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    bound = RTOL[dtype] * (want.double().abs().max().item() if want.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (rank {commlib.get_rank()})"


def block(t, dim, r, n):
    """Rank r's block of t along dim (n equal blocks), by definition."""
    m = t.shape[dim] // n
    return t.narrow(dim, r * m, m)


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class Count:
    """Counts the point-to-point messages passing through commlib.isend / commlib.irecv."""

    def __enter__(self):
        self.sends = self.recvs = 0
        self._s, self._r = commlib.isend, commlib.irecv

        def isend(*args, **kwargs):
            self.sends += 1
            return self._s(*args, **kwargs)

        def irecv(*args, **kwargs):
            self.recvs += 1
            return self._r(*args, **kwargs)

        isend.__name__, irecv.__name__ = "isend", "irecv"
        commlib.isend, commlib.irecv = isend, irecv
        return self

    def __exit__(self, *exc):
        commlib.isend, commlib.irecv = self._s, self._r




# ----- all_gather_matmul ---------------------------------------------------------------------
def run_gather(shard_shape, n_cols, dim, dtype, chunks, seed):
    """Outputs, gradients (a_shard, b, and through the gathered a) and message counts of one
    all_gather_matmul against the dense float64 computation."""
    r, p = world()
    k = shard_shape[-1]
    d = dim % len(shard_shape)
    full_shape = list(shard_shape)
    full_shape[d] *= p
    A = randn(seed, *full_shape)
    Bs = [randn(seed + 1 + q, k, n_cols) for q in range(p)]  # every rank's own b
    dCs = [randn(seed + 100 + q, *full_shape[:-1], n_cols) for q in range(p)]
    dAGs = [randn(seed + 200 + q, *full_shape) for q in range(p)]
    # reference: every rank's loss <dC_q, A @ B_q> + <dAG_q, A>, summed, by autograd
    Ar = A.clone().requires_grad_()
    Br = [b.clone().requires_grad_() for b in Bs]
    loss = sum(((Ar @ Br[q]) * dCs[q]).sum() + (Ar * dAGs[q]).sum() for q in range(p))
    loss.backward()

    a = block(A, d, r, p).to(dtype).requires_grad_()
    b = Bs[r].to(dtype).requires_grad_()
    with Count() as fwd:
        ag, c = ov.all_gather_matmul(a, b, gather_dim=dim, chunks=chunks)
    with Count() as bwd:
        torch.autograd.backward([c, ag], [dCs[r].to(dtype), dAGs[r].to(dtype)])
    what = f"all_gather_matmul shard={shard_shape} dim={dim} {dtype} chunks={chunks}"
    close(f"a_gathered {what}", ag, A, dtype)
    close(f"out {what}", c, A @ Bs[r], dtype)
    close(f"d a_shard {what}", a.grad, block(Ar.grad, d, r, p), dtype)
    close(f"d b {what}", b.grad, Br[r].grad, dtype)
    # the messages are the plans': forward the gather's, backward the reduce-scatter's
    fplan = ov.plan_all_gather_matmul(shard_shape, (k, n_cols), dtype=dtype, gather_dim=dim,
                                      chunks=chunks)
    bplan = ov.plan_matmul_reduce_scatter(tuple(c.shape), (n_cols, k), dtype=dtype,
                                          scatter_dim=dim, chunks=chunks)
    assert (fwd.sends, fwd.recvs) == (fplan.sends, fplan.recvs), (what, vars(fwd), str(fplan))
    assert (bwd.sends, bwd.recvs) == (bplan.sends, bplan.recvs), (what, vars(bwd), str(bplan))
    assert fplan.sends == (p - 1) * fplan.chunks if a.numel() else fplan.sends == 0
    if chunks is not None:
        assert fplan.chunks == bplan.chunks == chunks
    return c.detach()


def case_all_gather_matmul():
    """gather_dim 0 of a 2-D shard and 0, 1 and -2 of a 3-D one; float64 and float32; chunks
    chosen or forced (CHUNKS: all the same result); gradients of a_shard, b and through the
    gathered a; messages as planned."""
    for seed, (dtype, (shape, dim)) in enumerate(itertools.product(
            (torch.float64, torch.float32),
            (((5, 7), 0), ((2, 3, 7), 1), ((2, 3, 7), 0), ((3, 2, 4), -2)))):
        results = [run_gather(shape, 6, dim, dtype, chunks, 10 * seed)
                   for chunks in CHUNKS[dtype]]
        for got in results[1:]:  # any cut gives the same numbers (up to the dtype's rounding)
            close("chunks agree", got, results[0].double(), dtype)


def case_gather_only_gathered_used():
    """Only the gathered a feeds the loss (no gradient reaches the product): d a_shard is the
    reduce-scatter of d a_gathered alone, d b is zero."""
    r, p = world()
    A = randn(7, 4 * p, 3)
    dAG = [randn(8 + q, 4 * p, 3) for q in range(p)]
    a = block(A, 0, r, p).clone().requires_grad_()
    b = randn(9 + r, 3, 2).requires_grad_()
    ag, _ = ov.all_gather_matmul(a, b)
    ag.backward(dAG[r])
    close("d a_shard (gathered only)", a.grad, block(sum(dAG), 0, r, p), torch.float64)
    assert b.grad is None or not b.grad.any()


# ----- matmul_reduce_scatter -----------------------------------------------------------------
def run_scatter(a_shape, n_cols, dim, op, dtype, chunks, seed):
    r, p = world()
    k = a_shape[-1]
    d = dim % len(a_shape)
    As = [randn(seed + q, *a_shape) for q in range(p)]
    Bs = [randn(seed + 50 + q, k, n_cols) for q in range(p)]
    out_shape = list(a_shape[:-1]) + [n_cols]
    out_shape[d] //= p
    dYs = [randn(seed + 100 + q, *out_shape) for q in range(p)]
    Ar = [t.clone().requires_grad_() for t in As]
    Br = [t.clone().requires_grad_() for t in Bs]
    C = sum(Ar[q] @ Br[q] for q in range(p))
    if op == "avg":
        C = C / p
    loss = sum((block(C, d, q, p) * dYs[q]).sum() for q in range(p))
    loss.backward()

    a = As[r].to(dtype).requires_grad_()
    b = Bs[r].to(dtype).requires_grad_()
    rop = commlib.ReduceOp.AVG if op == "avg" else commlib.ReduceOp.SUM
    with Count() as fwd:
        y = ov.matmul_reduce_scatter(a, b, scatter_dim=dim, op=rop, chunks=chunks)
    with Count() as bwd:
        y.backward(dYs[r].to(dtype))
    what = f"matmul_reduce_scatter a={a_shape} dim={dim} op={op} {dtype} chunks={chunks}"
    close(f"out {what}", y, block(C.detach(), d, r, p), dtype)
    close(f"d a {what}", a.grad, Ar[r].grad, dtype)
    close(f"d b {what}", b.grad, Br[r].grad, dtype)
    fplan = ov.plan_matmul_reduce_scatter(a_shape, (k, n_cols), dtype=dtype, scatter_dim=dim,
                                          chunks=chunks)
    bplan = ov.plan_all_gather_matmul(tuple(y.shape), (n_cols, k), dtype=dtype, gather_dim=dim,
                                      chunks=chunks)
    assert (fwd.sends, fwd.recvs) == (fplan.sends, fplan.recvs), (what, vars(fwd), str(fplan))
    assert (bwd.sends, bwd.recvs) == (bplan.sends, bplan.recvs), (what, vars(bwd), str(bplan))
    assert fplan.sends == (p - 1) * fplan.chunks
    return y.detach()


def case_matmul_reduce_scatter():
    """scatter_dim 0 of 2-D a and 1 (and -2) of 3-D a; SUM and AVG; float64 and float32; chunks
    chosen or forced (the same result); gradients of a and b; messages as planned."""
    _, p = world()
    for seed, (dtype, op, (shape, dim)) in enumerate(itertools.product(
            (torch.float64, torch.float32), ("sum", "avg"),
            (((3 * p, 7), 0), ((2, 2 * p, 5), 1), ((2, 3 * p, 4), -2)))):
        results = [run_scatter(shape, 6, dim, op, dtype, chunks, 1000 + 10 * seed)
                   for chunks in CHUNKS[dtype]]
        for got in results[1:]:
            close("chunks agree", got, results[0].double(), dtype)


def case_bfloat16():
    """bfloat16 in, bfloat16 out and gradients (accumulators travel in float32)."""
    run_scatter((4 * world()[1], 8), 4, 0, "sum", torch.bfloat16, None, 3000)
    run_gather((4, 8), 4, 0, torch.bfloat16, 2, 3100)


def case_empty_and_one_row():
    """A shard of no rows gathers nothing and sends nothing; a one-row shard takes 1 chunk."""
    r, p = world()
    a = torch.zeros(0, 3, dtype=torch.float64)
    with Count() as cnt:
        ag, c = ov.all_gather_matmul(a, torch.ones(3, 2, dtype=torch.float64))
    assert ag.shape == (0, 3) and c.shape == (0, 2) and cnt.sends == cnt.recvs == 0
    run_gather((1, 3), 2, 0, torch.float64, None, 4000)


# ----- the plan ----------------------------------------------------------------------------------
def case_plan_same_on_every_rank():
    """After a call has agreed the matmul rate, every rank's plan (chunk count and the whole
    printed table) is the same; explain() prints it; plans are cached."""
    r, p = world()
    shapes = [((64, 128), (128, 256)), ((8, 16, 32), (32, 8)), ((512, 512), (512, 512))]
    for dtype in (torch.float32, torch.float64):
        a = torch.zeros(2 * p, 4, dtype=dtype)
        ov.matmul_reduce_scatter(a, torch.zeros(4, 3, dtype=dtype))  # agrees the rate
        for a_shape, b_shape in shapes:
            for pl in (ov.plan_all_gather_matmul(a_shape, b_shape, dtype=dtype),
                       ov.plan_matmul_reduce_scatter((a_shape[0] * p, *a_shape[1:]), b_shape,
                                                     dtype=dtype)):
                text = str(pl)
                assert "<- chosen" in text, text
                if p > 1:  # ranks on one host: transfers are copies by the computing cores
                    assert pl.serial and pl.chunks == 0, text
                    assert "chosen: no decomposition" in text and "cannot hide" in text, text
                assert ("agreed" if p > 1 else "one rank") in pl.rate, pl.rate
                mine = torch.tensor([pl.chunks, zlib.crc32(text.encode()), pl.sends])
                table = torch.zeros(p, 3, dtype=torch.int64)
                commlib.all_gather_into_tensor(table, mine)
                assert bool((table == mine).all()), f"rank {r}: plans differ: {table.tolist()}"
                assert pl.sends == (p - 1) * pl.chunks
                again = ov.plan_all_gather_matmul(a_shape, b_shape, dtype=dtype) \
                    if pl.kind == "all_gather_matmul" else \
                    ov.plan_matmul_reduce_scatter((a_shape[0] * p, *a_shape[1:]), b_shape,
                                                  dtype=dtype)
                assert again is pl  # cached
            text = ov.explain("all_gather_matmul", a_shape, b_shape, dtype=dtype)
            assert text == str(ov.plan_all_gather_matmul(a_shape, b_shape, dtype=dtype))


# ----- errors ------------------------------------------------------------------------------------
def case_errors():
    """Typed errors naming the function, the argument, the value and a fix, on every rank."""
    r, p = world()
    f32, f64 = torch.float32, torch.float64
    a, b = torch.ones(4, 3), torch.ones(3, 2)
    if p > 1:  # a length that does not divide by the group size: every rank raises
        bad = torch.ones(2, 3 * p + 1, 3)
        expect_error(lambda: ov.matmul_reduce_scatter(bad, b, scatter_dim=1),
                     "overlap.matmul_reduce_scatter()", "argument 'a'",
                     f"shape=(2, {3 * p + 1}, 3)", f"length {3 * p + 1} along scatter_dim 1",
                     f"divide by the group size {p}", f"multiple of {p}",
                     f"e.g. {3 * p + 1 + (-(3 * p + 1)) % p}")
        expect_error(lambda: ov.plan_matmul_reduce_scatter((3 * p + 1, 3), (3, 2)),
                     "plan_matmul_reduce_scatter", f"divide by the group size {p}")
    expect_error(lambda: ov.all_gather_matmul(a, b.to(f64)), "all_gather_matmul()",
                 "argument 'b'", "float64", "dtype of 'a_shard' (float32)", kind=CommTypeError)
    expect_error(lambda: ov.all_gather_matmul(a.int(), b.int()), "'a_shard'", "floating point",
                 kind=CommTypeError)
    expect_error(lambda: ov.all_gather_matmul(a.numpy(), b), "'a_shard'", "torch.Tensor",
                 kind=CommTypeError)
    expect_error(lambda: ov.all_gather_matmul(a, torch.ones(2, 2)), "argument 'b'",
                 "last dim (3)", "transpose")
    expect_error(lambda: ov.all_gather_matmul(a, torch.ones(3)), "must be 2-D (k, n)")
    expect_error(lambda: ov.all_gather_matmul(torch.ones(3), torch.ones(3, 2)), "'a_shard'",
                 "at least 2 dims")
    for dim in (1, -1):
        expect_error(lambda dim=dim: ov.all_gather_matmul(a, b, gather_dim=dim), "'gather_dim'",
                     "last dim", "contracted")
    for dim in (2, -3, 0.0, True):
        expect_error(lambda dim=dim: ov.all_gather_matmul(a, b, gather_dim=dim), "'gather_dim'",
                     "other than the last")
    for chunks in (-1, 5, 2.0, True):  # 4 rows
        expect_error(lambda chunks=chunks: ov.all_gather_matmul(a, b, chunks=chunks),
                     "'chunks'", "from 0", "to 4", "None")
    a2 = torch.ones(2 * p, 3)
    expect_error(lambda: ov.matmul_reduce_scatter(a2, b, op=commlib.ReduceOp.MAX), "'op'",
                 "SUM", "AVG", kind=CommUnsupportedError)
    expect_error(lambda: ov.matmul_reduce_scatter(a2, b, op=3), "'op'",
                 "not a reduction operator", kind=CommTypeError)
    expect_error(lambda: ov.explain("all_reduce_matmul", (2, 3), (3, 2)), "overlap.explain",
                 "'kind'", "all_gather_matmul")
    expect_error(lambda: ov.plan_all_gather_matmul((2, 3), (3, 2), dtype=torch.int32),
                 "'dtype'", "floating", kind=CommTypeError)
    expect_error(lambda: ov.plan_all_gather_matmul("2x3", (3, 2)), "'a_shard_shape'",
                 kind=CommTypeError)
    commlib.barrier()  # every rank got here: nobody is left waiting in a ring
    assert f32 is torch.float32


def case_debug_mismatch():
    """Under COMMLIB_DEBUG=1: a rank whose shard has another shape makes every rank raise
    CommMismatchError (instead of a ring of mismatched messages); a rank whose own checks fail
    raises its error and the others name it."""
    r, p = world()
    a = torch.ones(3 + (r == 1), 4)
    expect_error(lambda: ov.all_gather_matmul(a, torch.ones(4, 2)), "all_gather_matmul",
                 "rank", "a_shard=(4, 4)", kind=CommMismatchError)
    if r == 0:
        expect_error(lambda: ov.all_gather_matmul(torch.ones(3, 4), torch.ones(4, 2), chunks=9),
                     "'chunks'")
    else:
        expect_error(lambda: ov.all_gather_matmul(torch.ones(3, 4), torch.ones(4, 2)),
                     "ranks [0] failed their argument checks", kind=CommMismatchError)
    run_gather((3, 4), 2, 0, torch.float64, None, 5000)  # and the group still works


if __name__ == "__main__":
    main(globals())
