"""Tensor-parallel layers (commlib.nn.ColumnParallelLinear, RowParallelLinear, ParallelMLP) on
real ranks, against the dense torch.nn.Linear / MLP computed in one process (here, on every rank,
from the same seeded weights and inputs).

Each rank slices its expected part of the dense results by the layers' definitions written here
(weight rows or columns ``[r * n/N, (r + 1) * n/N)``, sequence rows ``[r * s/N, ...)``), never
with the library's helpers. The dense loss is ``sum(y * dy)``; each rank backpropagates its part
of ``dy`` (all of it for a replicated output), which is the layers' gradient convention: a
replicated output's loss counts once, a sharded output's losses are summed. Collectives are
counted by wrapping commlib's public functions (the calls still run). Every size is a multiple of
12, so every case runs at 1, 2, 3 and 4 ranks.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _harness import expect_error, main  # noqa: E402

import commlib  # noqa: E402
import commlib.overlap  # noqa: E402
from commlib.errors import CommMismatchError, CommTypeError  # noqa: E402
from commlib.nn import ColumnParallelLinear, ParallelMLP, RowParallelLinear  # noqa: E402
from commlib.nn import functional as F  # noqa: E402

RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}  # max |got - want| <= RTOL * max |want|
S, B, H, FFN = 12, 2, 12, 48  # sequence, batch, model width, inner width
FLAGS = (False, True)


def world():
    return commlib.get_rank(), commlib.get_world_size()


def rows(t, r, n):
    """Rows ``[r s/n, (r+1) s/n)`` of dim 0 (a sequence shard, or a weight's row shard)."""
    s = t.shape[0] // n
    return t[r * s:(r + 1) * s]


def cols(t, r, n):
    """Columns ``[r c/n, (r+1) c/n)`` of the last dim."""
    c = t.shape[-1] // n
    return t[..., r * c:(r + 1) * c]


def data(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def dense_linear(i, o, bias, dtype, seed):
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=bias, dtype=dtype)


def close(name, got, want, rtol):
    assert got is not None, f"{name}: no gradient"
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    err = (got.detach().double() - want.detach().double()).abs().max().item()
    bound = rtol * max(want.detach().double().abs().max().item(), 1e-30)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (rank {commlib.get_rank()})"


def same_linear(name, got: nn.Linear, want: nn.Linear, rtol):
    """Equal weights and biases (exactly: gathered copies), gradients within ``rtol``."""
    assert isinstance(got, nn.Linear) and (got.in_features, got.out_features) == \
        (want.in_features, want.out_features), (name, got)
    assert torch.equal(got.weight, want.weight), f"{name}: weight"
    assert (got.bias is None) == (want.bias is None), f"{name}: bias presence"
    close(f"{name} weight.grad", got.weight.grad, want.weight.grad, rtol)
    if want.bias is not None:
        assert torch.equal(got.bias, want.bias), f"{name}: bias"
        close(f"{name} bias.grad", got.bias.grad, want.bias.grad, rtol)


class Count:
    """Records the collectives issued through commlib's public API and commlib.overlap, with
    whether they were asynchronous: ``calls`` is a list of (name, async_op)."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    OVERLAP = ("all_gather_matmul", "matmul_reduce_scatter")

    def __enter__(self):
        self.calls = []
        self._saved = {}
        for mod, names in ((commlib, self.NAMES), (commlib.overlap, self.OVERLAP)):
            for name in names:
                real = getattr(mod, name)
                self._saved[(mod, name)] = real

                def wrap(*args, _real=real, _name=name, **kwargs):
                    self.calls.append((_name, bool(kwargs.get("async_op", False))))
                    return _real(*args, **kwargs)

                setattr(mod, name, wrap)
        return self

    def __exit__(self, *exc):
        for (mod, name), real in self._saved.items():
            setattr(mod, name, real)


# ----- the layers against the dense ones -----------------------------------------------------------
def run_column(dtype, sp, overlap, gather, bias, seed, group=None, count=False):
    """ColumnParallelLinear vs nn.Linear(H, FFN): output, input gradient, to_dense() gradients.
    Returns the forward and backward collectives when ``count``."""
    r, n = commlib.get_rank(group), commlib.get_world_size(group)
    rtol = RTOL[dtype]
    dense = dense_linear(H, FFN, bias, dtype, seed)
    x, dy = data((S, B, H), seed + 1000, dtype), data((S, B, FFN), seed + 2000, dtype)
    xr = x.clone().requires_grad_()
    ref = dense(xr)
    ref.backward(dy)

    layer = ColumnParallelLinear.from_dense(dense, group=group, gather_output=gather,
                                            sequence_parallel=sp, overlap=overlap)
    assert torch.equal(layer.weight, rows(dense.weight, r, n))
    xl = (rows(x, r, n) if sp else x).clone().requires_grad_()
    with Count() as fwd:
        y = layer(xl)
    what = f"column {dtype} sp={sp} overlap={overlap} gather={gather} bias={bias}"
    close(f"{what} out", y, ref if gather else cols(ref, r, n), rtol)
    with Count() as bwd:
        y.backward(dy if gather else cols(dy, r, n))
    close(f"{what} x.grad", xl.grad, rows(xr.grad, r, n) if sp else xr.grad, rtol)
    same_linear(what, layer.to_dense(), dense, rtol)
    return fwd.calls, bwd.calls


def run_row(dtype, sp, overlap, parallel_in, bias, seed, group=None, chunks=None):
    r, n = commlib.get_rank(group), commlib.get_world_size(group)
    rtol = RTOL[dtype]
    dense = dense_linear(FFN, H, bias, dtype, seed)
    x, dy = data((S, B, FFN), seed + 1000, dtype), data((S, B, H), seed + 2000, dtype)
    xr = x.clone().requires_grad_()
    ref = dense(xr)
    ref.backward(dy)

    layer = RowParallelLinear.from_dense(dense, group=group, input_is_parallel=parallel_in,
                                         sequence_parallel=sp, overlap=overlap,
                                         overlap_chunks=chunks)
    assert torch.equal(layer.weight, cols(dense.weight, r, n))
    xl = (cols(x, r, n) if parallel_in else x).clone().requires_grad_()
    with Count() as fwd:
        y = layer(xl)
    what = f"row {dtype} sp={sp} overlap={overlap} input_is_parallel={parallel_in} bias={bias}"
    close(f"{what} out", y, rows(ref, r, n) if sp else ref, rtol)
    with Count() as bwd:
        y.backward(rows(dy, r, n) if sp else dy)
    close(f"{what} x.grad", xl.grad, cols(xr.grad, r, n) if parallel_in else xr.grad, rtol)
    same_linear(what, layer.to_dense(), dense, rtol)
    return fwd.calls, bwd.calls


def dense_mlp(bias, dtype, seed):
    torch.manual_seed(seed)
    return nn.Linear(H, FFN, bias=bias, dtype=dtype), nn.Linear(FFN, H, bias=bias, dtype=dtype)


def run_mlp(dtype, sp, overlap, bias, seed, group=None, sequential=False):
    """ParallelMLP vs fc2(act(fc1(x))); returns the output and the gradients (for comparing the
    overlap modes with each other)."""
    r, n = commlib.get_rank(group), commlib.get_world_size(group)
    rtol = RTOL[dtype]
    fc1, fc2 = dense_mlp(bias, dtype, seed)
    act = nn.Tanh() if sequential else torch.nn.functional.gelu
    x, dy = data((S, B, H), seed + 1000, dtype), data((S, B, H), seed + 2000, dtype)
    xr = x.clone().requires_grad_()
    ref = fc2(act(fc1(xr)))
    ref.backward(dy)

    if sequential:  # the activation comes from the Sequential's middle module
        mlp = ParallelMLP.from_dense(nn.Sequential(fc1, act, fc2), group=group,
                                     sequence_parallel=sp, overlap=overlap)
        assert mlp.activation is act
    else:
        mlp = ParallelMLP.from_dense(fc1, fc2, group=group, sequence_parallel=sp, overlap=overlap)
    xl = (rows(x, r, n) if sp else x).clone().requires_grad_()
    y = mlp(xl)
    what = f"mlp {dtype} sp={sp} overlap={overlap} bias={bias} sequential={sequential}"
    close(f"{what} out", y, rows(ref, r, n) if sp else ref, rtol)
    y.backward(rows(dy, r, n) if sp else dy)
    close(f"{what} x.grad", xl.grad, rows(xr.grad, r, n) if sp else xr.grad, rtol)
    d1, d2 = mlp.to_dense()
    same_linear(f"{what} fc1", d1, fc1, rtol)
    same_linear(f"{what} fc2", d2, fc2, rtol)
    return [y.detach(), xl.grad] + [p.grad for p in mlp.parameters()]


# ----- cases -----------------------------------------------------------------------------------------
def case_column():
    """Every combination of dtype x sequence_parallel x overlap x gather_output x bias."""
    for seed, (dtype, sp, overlap, gather, bias) in enumerate(itertools.product(
            (torch.float64, torch.float32), FLAGS, FLAGS, FLAGS, FLAGS)):
        run_column(dtype, sp, overlap, gather, bias, seed)


def case_row():
    """Every combination of dtype x sequence_parallel x overlap x input_is_parallel x bias."""
    for seed, (dtype, sp, overlap, parallel_in, bias) in enumerate(itertools.product(
            (torch.float64, torch.float32), FLAGS, FLAGS, FLAGS, FLAGS)):
        run_row(dtype, sp, overlap, parallel_in, bias, 100 + seed)


def case_mlp():
    """ParallelMLP: every dtype x sequence_parallel x overlap x bias against the dense MLP; the
    overlapped and blocking runs agree with each other within rounding; from_dense of an
    nn.Sequential takes its activation."""
    for seed, (dtype, sp, bias) in enumerate(itertools.product(
            (torch.float64, torch.float32), FLAGS, FLAGS)):
        blocking = run_mlp(dtype, sp, False, bias, 200 + seed)
        overlapped = run_mlp(dtype, sp, True, bias, 200 + seed)
        for i, (a, b) in enumerate(zip(overlapped, blocking)):
            close(f"mlp overlap vs blocking {dtype} sp={sp} bias={bias} [{i}]", a, b, RTOL[dtype])
    for sp in FLAGS:
        run_mlp(torch.float64, sp, True, True, 300, sequential=True)


def case_row_chunks():
    """The chunked all-reduce pipeline (sequence_parallel=False, overlap=True): any chunk count,
    including more chunks than rows (capped) and 1, gives the dense result; one asynchronous
    all-reduce per chunk forward and no collective backward (Megatron's g)."""
    _, n = world()
    for chunks in (1, 3, 5, 24, 100):
        fwd, bwd = run_row(torch.float64, False, True, True, True, 400 + chunks, chunks=chunks)
        want = [("all_reduce", True)] * min(chunks, S * B) if chunks > 1 else [("all_reduce", False)]
        assert fwd == (want if n > 1 else []), (chunks, fwd)
        assert bwd == [], (chunks, bwd)


def case_comm_pattern():
    """The collectives each mode issues (none on one rank): overlap=True posts asynchronous ones
    (or goes through commlib.overlap), overlap=False blocking ones."""
    _, n = world()
    ar, ag, rs = "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"
    f64 = torch.float64
    for overlap in FLAGS:
        # column, replicated input: nothing forward, the input gradient's all-reduce backward,
        # asynchronous with overlap (the weight gradient is computed meanwhile)
        fwd, bwd = run_column(f64, False, overlap, False, True, 500)
        assert (fwd, bwd) == (([], [(ar, overlap)]) if n > 1 else ([], [])), (overlap, fwd, bwd)
        fwd, bwd = run_column(f64, False, overlap, True, True, 501)  # + gather_output
        assert (fwd, bwd) == (([(ag, False)], [(ar, overlap)]) if n > 1 else ([], [])), (fwd, bwd)
        # row, parallel input, all-reduce forward (chunked and asynchronous with overlap)
        fwd, bwd = run_row(f64, False, overlap, True, True, 502)
        want = [(ar, True)] * F.DEFAULT_OVERLAP_CHUNKS if overlap else [(ar, False)]
        assert (fwd, bwd) == ((want, []) if n > 1 else ([], [])), (overlap, fwd, bwd)
        fwd, bwd = run_row(f64, False, overlap, False, True, 503)  # + the split's gather back
        assert (fwd, bwd) == ((want, [(ag, False)]) if n > 1 else ([], [])), (fwd, bwd)
    # sequence parallel, blocking: all-gather and reduce-scatter of dim 0
    fwd, bwd = run_column(f64, True, False, False, True, 504)
    assert (fwd, bwd) == (([(ag, False)], [(ag, False), (rs, False)]) if n > 1 else ([], []))
    fwd, bwd = run_row(f64, True, False, True, True, 505)
    assert (fwd, bwd) == (([(rs, False)], [(ag, False)]) if n > 1 else ([], [])), (fwd, bwd)
    # sequence parallel, overlapped: the collective matmuls of commlib.overlap, called first
    fwd, _ = run_column(f64, True, True, False, True, 506)
    assert (fwd[:1] if n > 1 else fwd) == ([("all_gather_matmul", False)] if n > 1 else []), fwd
    fwd, bwd = run_row(f64, True, True, True, True, 507)
    assert (fwd[:1] if n > 1 else fwd) == ([("matmul_reduce_scatter", False)] if n > 1 else []), fwd
    if n > 1:  # the replicated bias's gradient, summed over the group (the collective matmul
        # itself may call the plain collectives: on one host its plan does not decompose)
        assert (ar, False) in bwd, bwd


def case_subgroup():
    """group=: at 4 ranks two groups of 2 ([0, 1] and [2, 3]); otherwise the world in reversed
    rank order (a rank's shard follows its rank in the group, not in the world)."""
    r, n = world()
    if n == 4:
        pairs = [commlib.new_group([0, 1]), commlib.new_group([2, 3])]
        group = pairs[r // 2]
    else:
        group = commlib.new_group(list(reversed(range(n))))
        assert group.rank == n - 1 - r
    for seed, (sp, overlap) in enumerate(itertools.product(FLAGS, FLAGS)):
        run_column(torch.float64, sp, overlap, False, True, 600 + seed, group=group)
        run_row(torch.float64, sp, overlap, True, True, 610 + seed, group=group)
        run_mlp(torch.float64, sp, overlap, True, 620 + seed, group=group)


def case_init_matches_dense():
    """Built directly under a seed, the layers hold the shards of the nn.Linear (and MLP) the
    same seed gives; to_dense() returns it exactly, with no gradients before a backward;
    from_dense and to_dense draw no random numbers."""
    r, n = world()
    torch.manual_seed(5)
    col, row = ColumnParallelLinear(H, FFN), RowParallelLinear(FFN, H)
    mlp = ParallelMLP(H, FFN)
    torch.manual_seed(5)
    dcol, drow = nn.Linear(H, FFN), nn.Linear(FFN, H)
    d1, d2 = nn.Linear(H, FFN), nn.Linear(FFN, H)
    assert torch.equal(col.weight, rows(dcol.weight, r, n))
    assert torch.equal(col.bias, rows(dcol.bias, r, n))
    assert torch.equal(row.weight, cols(drow.weight, r, n)) and torch.equal(row.bias, drow.bias)
    assert torch.equal(mlp.fc1.weight, rows(d1.weight, r, n))
    assert torch.equal(mlp.fc2.weight, cols(d2.weight, r, n))
    for got, want in ((col.to_dense(), dcol), (row.to_dense(), drow), *zip(mlp.to_dense(), (d1, d2))):
        assert torch.equal(got.weight, want.weight) and torch.equal(got.bias, want.bias)
        assert got.weight.grad is None and got.bias.grad is None
    torch.manual_seed(9)
    before = torch.rand(3)
    torch.manual_seed(9)
    ColumnParallelLinear.from_dense(dcol).to_dense()
    ParallelMLP.from_dense(d1, d2).to_dense()
    assert torch.equal(torch.rand(3), before)


def case_from_dense_roundtrip():
    """from_dense copies this rank's shard without communicating (no aliasing of the dense
    module), keeps requires_grad and dtype; to_dense gives the module back exactly."""
    r, n = world()
    dense = dense_linear(H, FFN, True, torch.float64, 700)
    dense.bias.requires_grad_(False)
    with Count() as c:
        col = ColumnParallelLinear.from_dense(dense)
        row = RowParallelLinear.from_dense(dense_linear(FFN, H, False, torch.float32, 701))
        mlp = ParallelMLP.from_dense(*dense_mlp(True, torch.float32, 702))
    assert c.calls == [], c.calls
    assert col.weight.dtype == torch.float64 and row.bias is None
    assert not col.bias.requires_grad and col.weight.requires_grad
    assert col.weight.untyped_storage().data_ptr() != dense.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        col.weight.add_(1.0)  # the layer's copy: the dense module is untouched
    assert not torch.equal(rows(dense.weight, r, n), col.weight)
    col = ColumnParallelLinear.from_dense(dense)
    back = col.to_dense()
    assert torch.equal(back.weight, dense.weight) and torch.equal(back.bias, dense.bias)
    assert back.weight.requires_grad and not back.bias.requires_grad
    assert back.weight.dtype == torch.float64
    assert row.to_dense().bias is None and row.to_dense().weight.dtype == torch.float32
    assert mlp.fc1.weight.shape == (FFN // n, H) and mlp.fc2.weight.shape == (H, FFN // n)




def case_errors():
    """Bad sizes and arguments raise typed errors on every rank, naming the layer, the argument,
    the value, the multiple needed and a fix."""
    r, n = world()
    bad = 4 * n + 1  # never a multiple of n > 1
    if n > 1:
        expect_error(lambda: ColumnParallelLinear(H, bad), "nn.ColumnParallelLinear",
                     "'out_features'", f"= {bad}", f"multiple of the group size {n}", "Fix",
                     f"e.g. {4 * n + n}")
        expect_error(lambda: RowParallelLinear(bad, H), "nn.RowParallelLinear", "'in_features'",
                     f"= {bad}", f"multiple of the group size {n}", f"e.g. {4 * n + n}")
        expect_error(lambda: ParallelMLP(H, bad), "nn.ParallelMLP", "'ffn_hidden_size'",
                     f"= {bad}", f"multiple of the group size {n}")
        expect_error(lambda: ColumnParallelLinear.from_dense(nn.Linear(H, bad)),
                     "nn.ColumnParallelLinear", "'out_features'", f"multiple of the group size {n}")
        row = RowParallelLinear(FFN, H, sequence_parallel=True)
        x = torch.randn(2 * n + 1, B, FFN // n)
        expect_error(lambda: row(x), "nn.RowParallelLinear.forward", "'x'",
                     f"sequence length {2 * n + 1}", f"multiple of the group size {n}",
                     "pad the sequence", f"e.g. {3 * n}")
        expect_error(lambda: F.row_parallel_linear(x, row.weight, sequence_parallel=True),
                     "nn.functional.row_parallel_linear", f"sequence length {2 * n + 1}")
        # to_dense with gradients on some ranks only: every rank raises, none hangs
        col = ColumnParallelLinear(H, FFN)
        if r == 0:
            col.weight.grad, col.bias.grad = torch.ones_like(col.weight), torch.ones_like(col.bias)
        expect_error(col.to_dense, "to_dense", "ranks disagree", "rank 0: [True, True]",
                     "rank 1: [False, False]", kind=CommMismatchError)
    col = ColumnParallelLinear(H, FFN)
    expect_error(lambda: col(torch.randn(3, H + 1)), "nn.ColumnParallelLinear.forward", "'x'",
                 "last dim must be 12 (in_features)")
    expect_error(lambda: col(torch.randn(3, H, dtype=torch.float64)), "must have the weight's dtype",
                 "torch.float32", kind=CommTypeError)
    expect_error(lambda: col([1.0] * H), "must be a torch.Tensor", kind=CommTypeError)
    sp_col = ColumnParallelLinear(H, FFN, sequence_parallel=True)
    expect_error(lambda: sp_col(torch.randn(H)), "at least 2-D", "[s, b, h]")
    row = RowParallelLinear(FFN, H)
    expect_error(lambda: row(torch.randn(3, FFN // n + 1)), "nn.RowParallelLinear.forward",
                 f"last dim must be {FFN // n}", "input_is_parallel=True")
    row_full = RowParallelLinear(FFN, H, input_is_parallel=False)
    expect_error(lambda: row_full(torch.randn(3, FFN + 1)), f"last dim must be {FFN}",
                 "input_is_parallel=False")
    for value in (0, -12, 2.5, True):
        expect_error(lambda v=value: ColumnParallelLinear(v, FFN), "'in_features'", repr(value),
                     "positive int", kind=CommTypeError)
    expect_error(lambda: ColumnParallelLinear(H, FFN, gather_output="yes"), "'gather_output'",
                 "True or False", kind=CommTypeError)
    expect_error(lambda: RowParallelLinear(FFN, H, overlap=None), "'overlap'", kind=CommTypeError)
    for value in (0, 1.5, False):
        expect_error(lambda v=value: RowParallelLinear(FFN, H, overlap_chunks=v),
                     "'overlap_chunks'", "positive int or None")
    expect_error(lambda: ParallelMLP(H, FFN, activation="gelu"), "'activation'", "callable",
                 kind=CommTypeError)
    expect_error(lambda: ColumnParallelLinear.from_dense(nn.Conv1d(2, 2, 1)), "from_dense",
                 "'module'", "Conv1d", "torch.nn.Linear", kind=CommTypeError)
    expect_error(lambda: ColumnParallelLinear.from_dense(nn.Linear(H, FFN), bias=False),
                 "'bias'", "not an option of from_dense", "'gather_output'")
    expect_error(lambda: RowParallelLinear.from_dense(nn.Linear(FFN, H), gather_output=True),
                 "'gather_output'", "'input_is_parallel'")
    expect_error(lambda: ParallelMLP.from_dense(nn.Linear(H, FFN), nn.Linear(FFN, H + 12)),
                 "nn.ParallelMLP.from_dense", "'fc2'", "map fc1's 48 features back to 12")
    expect_error(lambda: ParallelMLP.from_dense(nn.Sequential(nn.Linear(H, FFN))), "'fc1'",
                 "nn.Sequential(nn.Linear, activation, nn.Linear)", kind=CommTypeError)
    expect_error(lambda: F.column_parallel_linear(torch.randn(3, H), torch.randn(FFN)),
                 "nn.functional.column_parallel_linear", "'weight'", "2-D", kind=CommTypeError)
    expect_error(lambda: F.column_parallel_linear(torch.randn(3, H), torch.randn(4, H),
                                                  torch.randn(5)), "'bias'", "4 elements")


if __name__ == "__main__":
    main(globals())
