"""The 2D tensor-parallel layers of commlib.nn (LayerNorm2D, Embedding2D,
cross_entropy_2d, TransformerBlock2D) on real ranks, against the dense torch modules computed in
one process (here, on every rank, from the same seeds).

Meshes come from the world size n: (1, n), (n, 1) and (2, n/2) when n is even and at least 4.
Every size is a multiple of 12 (heads: 12), so each case runs at 1, 2, 3, 4 and 6 ranks.

Each rank slices its expected block by the layout written out here (rows ``[i N/r, (i+1) N/r)``
of dim 0, features ``[j H/c, (j+1) H/c)`` of the last dim), never with the library's helpers.
The reference is the dense module in float64 on the same (rounded) values, so a bfloat16 or
float32 result is compared with the exact answer, within ``RTOL[dtype] * max |want|``. The dense
loss is ``sum(y * dy)`` and each rank backpropagates its block of ``dy`` (the layers' sum
convention); cross_entropy_2d's mean loss is backpropagated on every rank as is. Every parameter
gradient is checked through ``to_dense()``. Bytes are counted with
``commlib.nn.functional.traffic()`` and compared with closed forms computed here.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _harness import expect_error, main  # noqa: E402
from _tp2d import block, close, data, mesh_of, meshes, rows  # noqa: E402

import commlib  # noqa: E402
from commlib.errors import CommMismatchError, CommTypeError  # noqa: E402
from commlib.nn import (Embedding2D, LayerNorm2D, TransformerBlock,  # noqa: E402
                        TransformerBlock2D)
from commlib.nn.functional import cross_entropy_2d, traffic  # noqa: E402

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
RTOL = {F64: 1e-10, F32: 1e-5, BF16: 3e-2}  # max |got - want| <= RTOL * max |want|
N, S, H, HEADS, FFN, V = 12, 4, 48, 12, 96, 36  # batch rows, sequence, width, heads, MLP, vocab
def ids(shape, seed, high):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def same_module(name, got: nn.Module, dense: nn.Module, ref: nn.Module, rtol):
    """``got`` (from to_dense) has ``dense``'s parameters exactly, in its dtype, and the float64
    reference ``ref``'s gradients within ``rtol``."""
    mine, theirs, grads = (dict(m.named_parameters()) for m in (got, dense, ref))
    assert mine.keys() == theirs.keys(), (name, mine.keys(), theirs.keys())
    for key, p in mine.items():
        assert p.dtype == theirs[key].dtype and torch.equal(p, theirs[key]), f"{name}.{key}"
        assert p.requires_grad == theirs[key].requires_grad, f"{name}.{key} requires_grad"
        close(f"{name}.{key}.grad", p.grad, grads[key].grad, rtol)


def reference(module):
    """A float64 copy of ``module`` (the exact answer for its rounded parameters)."""
    return copy.deepcopy(module).to(F64)


def shape_of(mesh):
    return "x".join(map(str, mesh.shape))


# ----- LayerNorm2D -----------------------------------------------------------------------------
def run_layernorm(mesh, dtype, affine, bias, seed, count=False):
    dense = nn.LayerNorm(H, elementwise_affine=affine, bias=bias, dtype=dtype)
    with torch.no_grad():
        for k, p in enumerate(dense.parameters()):  # not ones and zeros: those hide bugs
            p.copy_(data(p.shape, seed + 10 + k, dtype))
    ref = reference(dense)
    x, dy = data((N, S, H), seed, dtype, 2.0, 0.5), data((N, S, H), seed + 1, dtype)
    xr = x.to(F64, copy=True).requires_grad_()
    want = ref(xr)
    want.backward(dy.double())

    layer = LayerNorm2D.from_dense(dense, mesh)
    xl = block(x, mesh).clone().requires_grad_()
    with traffic() as fwd:
        y = layer(xl)
    what = f"layernorm {shape_of(mesh)} {dtype} affine={affine} bias={bias}"
    assert y.dtype == dtype, (what, y.dtype)
    close(f"{what} out", y, block(want, mesh), RTOL[dtype])
    with traffic() as bwd:
        y.backward(block(dy, mesh))
    close(f"{what} x.grad", xl.grad, block(xr.grad, mesh), RTOL[dtype])
    same_module(what, layer.to_dense(), dense, ref, RTOL[dtype])
    return fwd, bwd


def case_layernorm_2d():
    """Output, input gradient and scale/shift gradients against nn.LayerNorm in float64,
    float32 and bfloat16, with and without the affine parameters; the bytes sent (forward: one
    all-gather of 3 float32 per token along the row; backward: one all-reduce of 2 float32 per
    token along the row, one of the two gradient blocks along the column); statistics stable
    where E[x^2] - E[x]^2 is not."""
    for m, mesh in enumerate(meshes()):
        (r, c) = mesh.shape
        tl = N * S // r  # this rank's tokens
        for k, dtype in enumerate((F64, F32, BF16)):
            fwd, bwd = run_layernorm(mesh, dtype, True, True, 100 * m + 10 * k)
            sf = 8 if dtype == F64 else 4  # statistics: float32 for float32 and bfloat16
            s = torch.finfo(dtype).bits // 8
            assert fwd.sent == (c - 1) * 3 * tl * sf, (mesh.shape, dtype, fwd.by_kind)
            assert fwd.by_kind == ({"all_gather": fwd.sent} if c > 1 else {}), fwd.by_kind
            row = 2 * (c - 1) * (2 * tl * sf) // c
            col = 2 * (r - 1) * (2 * (H // c) * s) // r
            assert bwd.sent == row + col, (mesh.shape, dtype, bwd.by_kind, row, col)
        run_layernorm(mesh, F64, True, False, 100 * m + 5)  # scale only
        _, bwd = run_layernorm(mesh, F32, False, False, 100 * m + 6)  # no parameters
        assert bwd.sent == 2 * (c - 1) * (2 * tl * 4) // c, bwd.by_kind  # no column all-reduce

    # mean 1e4, spread 1e-2 in float32: E[x^2] - E[x]^2 loses every digit (1e8 against 1e-4),
    # and even a float32 mean is off by up to half its 1e-3 spacing. The 2D statistics (two
    # passes, the mean with its correction, Chan's merge) give the exact LayerNorm of the
    # float32 inputs (torch's float64 one) within 1e-4.
    x = data((N, S, H), 7, F32, 1e-2, 1e4)
    naive = x.mean(-1, keepdim=True), (x * x).mean(-1, keepdim=True)
    var_naive = naive[1] - naive[0] ** 2
    var = x.double().var(-1, unbiased=False, keepdim=True)
    assert (var_naive.double() - var).abs().max().item() > 1.0, "the case must defeat E[x^2]-E[x]^2"
    want = nn.LayerNorm(H, dtype=F64)(x.double())
    for mesh in meshes():
        y = LayerNorm2D(H, mesh=mesh)(block(x, mesh))
        close(f"layernorm stability {shape_of(mesh)}", y, block(want, mesh), 1e-4 / 3)


# ----- Embedding2D -----------------------------------------------------------------------------
def case_embedding_2d():
    """Output and weight gradient against nn.Embedding (repeated ids, every vocabulary block),
    float64, float32 and bfloat16; bytes sent: forward an all-gather of the ids and a
    reduce-scatter of the looked-up rows along the column, backward an all-gather of the output
    gradient along the column."""
    for m, mesh in enumerate(meshes()):
        (r, c) = mesh.shape
        tl = N * S // r
        for k, dtype in enumerate((F64, F32, BF16)):
            seed = 1000 + 100 * m + 10 * k
            torch.manual_seed(seed)
            dense = nn.Embedding(V, H, dtype=dtype)
            ref = reference(dense)
            tokens, dy = ids((N, S), seed + 1, V), data((N, S, H), seed + 2, dtype)
            want = ref(tokens)
            want.backward(dy.double())
            layer = Embedding2D.from_dense(dense, mesh)
            i, j = mesh.coords
            v, h = V // r, H // c
            assert torch.equal(layer.weight, dense.weight[i * v:(i + 1) * v, j * h:(j + 1) * h])
            with traffic() as fwd:
                y = layer(rows(tokens, mesh))
            what = f"embedding {shape_of(mesh)} {dtype}"
            assert y.dtype == dtype and y.shape == (N // r, S, h), (what, y.shape)
            close(f"{what} out", y, block(want, mesh), RTOL[dtype])
            with traffic() as bwd:
                y.backward(block(dy, mesh))
            same_module(what, layer.to_dense(), dense, ref, RTOL[dtype])
            s = torch.finfo(dtype).bits // 8
            assert fwd.sent == (r - 1) * tl * 8 + (r - 1) * (r * tl * h * s) // r, fwd.by_kind
            assert bwd.sent == (r - 1) * tl * h * s, bwd.by_kind
        # int32 ids and a 1-D batch of ids
        torch.manual_seed(5)
        dense = nn.Embedding(V, H)
        tokens = ids((N,), 6, V)
        y = Embedding2D.from_dense(dense, mesh)(rows(tokens, mesh).to(torch.int32))
        close(f"embedding int32 {shape_of(mesh)}", y, block(dense(tokens), mesh), RTOL[F32])
    # built directly under a seed: the blocks of the nn.Embedding the seed gives
    for mesh in meshes():
        torch.manual_seed(3)
        got = Embedding2D(V, H, mesh=mesh).to_dense()
        torch.manual_seed(3)
        assert torch.equal(got.weight, nn.Embedding(V, H).weight)
        assert got.weight.grad is None


# ----- cross_entropy_2d ------------------------------------------------------------------------
def case_cross_entropy_2d():
    """The mean loss (the same on every rank) and each logits block's gradient against
    torch.nn.functional.cross_entropy on the global batch, with ignored tokens and a large
    logit offset; float64, float32, bfloat16; bytes: a MAX and a fused SUM all-reduce along the
    row, a three-float64 all-reduce along the column, nothing backward."""
    for m, mesh in enumerate(meshes()):
        (r, c) = mesh.shape
        tl = N * S // r
        for k, (dtype, shift) in enumerate(((F64, 0.0), (F32, 0.0), (F32, 1e3), (BF16, 0.0))):
            seed = 2000 + 100 * m + 10 * k
            logits = data((N, S, V), seed, dtype, 3.0, shift)
            target = ids((N, S), seed + 1, V)
            target[ids((N, S), seed + 2, 4) == 0] = -100  # about a quarter ignored
            zr = logits.to(F64, copy=True).requires_grad_()
            want = nn.functional.cross_entropy(zr.reshape(-1, V), target.reshape(-1))
            want.backward()
            zl = block(logits, mesh).clone().requires_grad_()
            with traffic() as fwd:
                loss = cross_entropy_2d(zl, rows(target, mesh), mesh)
            what = f"cross_entropy {shape_of(mesh)} {dtype} shift={shift}"
            assert loss.dim() == 0 and loss.dtype == dtype, (what, loss)
            close(f"{what} loss", loss, want, RTOL[dtype])
            every = torch.empty(commlib.get_world_size(), dtype=dtype)
            commlib.all_gather_into_tensor(every, loss.detach().reshape(1))
            assert bool((every == every[0]).all()), (what, every)  # one loss, on every rank
            with traffic() as bwd:
                loss.backward()
            close(f"{what} logits.grad", zl.grad, block(zr.grad, mesh), RTOL[dtype])
            sf = 8 if dtype == F64 else 4
            assert fwd.sent == (2 * (c - 1) * tl * sf // c + 2 * (c - 1) * 2 * tl * sf // c
                                + 2 * (r - 1) * 24 // r), (what, fwd.by_kind)
            assert bwd.sent == 0, bwd.by_kind
        # ignore_index of the caller's choice, and 2-D logits (tokens, vocabulary)
        logits, target = data((N, V), 7, F64), ids((N,), 8, V)
        target[::3] = 5
        zr = logits.clone().requires_grad_()
        want = nn.functional.cross_entropy(zr, target, ignore_index=5)
        want.backward()
        zl = block(logits, mesh).clone().requires_grad_()
        loss = cross_entropy_2d(zl, rows(target, mesh), mesh, ignore_index=5)
        loss.backward()
        close("cross_entropy ignore_index=5", loss, want, RTOL[F64])
        close("cross_entropy ignore_index=5 grad", zl.grad, block(zr.grad, mesh), RTOL[F64])


# ----- TransformerBlock2D ----------------------------------------------------------------------
def run_block(mesh, dtype, causal, overlap, seed):
    torch.manual_seed(seed)
    dense = TransformerBlock(H, HEADS, FFN, causal=causal, dtype=dtype)
    with torch.no_grad():
        for ln in (dense.ln1, dense.ln2):
            ln.weight.add_(data((H,), seed + 1, dtype, 0.3))
            ln.bias.add_(data((H,), seed + 2, dtype, 0.3))
    ref = reference(dense)
    x, dy = data((N, S, H), seed + 3, dtype), data((N, S, H), seed + 4, dtype)
    xr = x.to(F64, copy=True).requires_grad_()
    want = ref(xr)
    want.backward(dy.double())
    layer = TransformerBlock2D.from_dense(dense, mesh, overlap=overlap)
    xl = block(x, mesh).clone().requires_grad_()
    y = layer(xl)
    what = f"block {shape_of(mesh)} {dtype} causal={causal} overlap={overlap}"
    close(f"{what} out", y, block(want, mesh), RTOL[dtype])
    y.backward(block(dy, mesh))
    close(f"{what} x.grad", xl.grad, block(xr.grad, mesh), RTOL[dtype])
    same_module(what, layer.to_dense(), dense, ref, RTOL[dtype])


def case_block_2d():
    """TransformerBlock2D against the dense TransformerBlock: output, input gradient and every
    parameter's gradient (to_dense undoes the qkv reordering), float64 and float32, causal or
    not, SUMMA overlapped or blocking; built under a seed it holds the blocks of the dense block
    the seed gives; from_dense and to_dense draw no random numbers."""
    for m, mesh in enumerate(meshes()):
        run_block(mesh, F64, True, True, 3000 + 10 * m)
        run_block(mesh, F32, True, True, 3001 + 10 * m)
        run_block(mesh, F64, False, False, 3002 + 10 * m)
        torch.manual_seed(4)
        got = TransformerBlock2D(H, HEADS, FFN, mesh=mesh).to_dense()
        torch.manual_seed(4)
        dense = TransformerBlock(H, HEADS, FFN)
        for (name, p), q in zip(dense.named_parameters(), got.parameters()):
            assert torch.equal(p, q) and q.grad is None, name
        torch.manual_seed(9)
        before = torch.rand(3)
        torch.manual_seed(9)
        TransformerBlock2D.from_dense(dense, mesh).to_dense()
        assert torch.equal(torch.rand(3), before)


# ----- errors ----------------------------------------------------------------------------------
def case_layers_2d_errors():
    """Sizes that do not divide raise CommArgumentError on every rank, naming the dimension, the
    size and the multiple; wrong types and shapes raise typed errors naming the argument; bad
    token ids and targets raise on every rank (also ranks whose own rows are fine)."""
    n = commlib.get_world_size()
    wide, tall = mesh_of((1, n)), mesh_of((n, 1))
    if n > 1:
        bad = 4 * n + 1  # never a multiple of n > 1
        expect_error(lambda: LayerNorm2D(bad, mesh=wide), "nn.LayerNorm2D", "'normalized_shape'",
                     f"normalized_shape has size {bad}", f"not a multiple of {n}",
                     f"e.g. {5 * n}")
        expect_error(lambda: LayerNorm2D.from_dense(nn.LayerNorm(bad), wide),
                     "normalized_shape", f"size {bad}", f"multiple of {n}")
        expect_error(lambda: Embedding2D(bad, H, mesh=tall), "nn.Embedding2D", "'num_embeddings'",
                     f"num_embeddings has size {bad}", f"not a multiple of {n}")
        expect_error(lambda: Embedding2D(V, bad, mesh=wide), "'embedding_dim'",
                     f"embedding_dim has size {bad}", f"not a multiple of {n}")
        expect_error(lambda: TransformerBlock2D(12 * (n + 1), n + 1, FFN, mesh=wide),
                     "nn.TransformerBlock2D", "'num_heads'", f"num_heads has size {n + 1}",
                     f"not a multiple of {n}")
        expect_error(lambda: TransformerBlock2D(H, HEADS, bad, mesh=tall), "'ffn_dim'",
                     f"ffn_dim has size {bad}", f"not a multiple of {n}")
        expect_error(lambda: TransformerBlock2D(bad, 1, FFN, mesh=tall), "'embed_dim'",
                     f"embed_dim has size {bad}", f"not a multiple of {n}")
        ln = LayerNorm2D(H, mesh=wide)
        expect_error(lambda: ln(torch.randn(N, H)), "nn.LayerNorm2D", "'x'",
                     f"last dim {H // n}")
        # to_dense with gradients on some ranks only: every rank raises, none hangs
        if commlib.get_rank() == 0:
            ln.weight.grad = torch.ones_like(ln.weight)
        expect_error(ln.to_dense, "to_dense", "ranks disagree", kind=CommMismatchError)
    expect_error(lambda: TransformerBlock(H, 5, FFN), "'embed_dim'", "multiple of 5")
    mesh = wide
    expect_error(lambda: LayerNorm2D(H, mesh=None), "'mesh'", "commlib.Mesh", kind=CommTypeError)
    expect_error(lambda: LayerNorm2D((H, 2), mesh=mesh), "'normalized_shape'", "one positive int",
                 kind=CommTypeError)
    expect_error(lambda: LayerNorm2D(H, mesh=mesh, elementwise_affine="yes"),
                 "'elementwise_affine'", kind=CommTypeError)
    ln = LayerNorm2D(H, mesh=mesh)
    expect_error(lambda: ln(torch.randn(N, H // n, dtype=F64)), "'x'", "dtype",
                 kind=CommTypeError)
    expect_error(lambda: LayerNorm2D.from_dense(nn.Linear(H, H), mesh), "'module'",
                 "torch.nn.LayerNorm", kind=CommTypeError)
    expect_error(lambda: LayerNorm2D.from_dense(nn.LayerNorm(H), mesh, overlap=True), "'overlap'",
                 "not an option of from_dense")
    emb = Embedding2D(V, H, mesh=tall)
    expect_error(lambda: emb(torch.zeros(N // n, S)), "nn.Embedding2D", "'ids'", "int64",
                 kind=CommTypeError)
    expect_error(lambda: Embedding2D.from_dense(nn.Embedding(V, H, padding_idx=0), tall),
                 "padding_idx", "not support")
    # an id out of range on mesh row 0 only: every rank raises, naming it and the range
    bad_ids = torch.zeros(N, S, dtype=torch.int64)
    bad_ids[0, 1] = V + 7
    expect_error(lambda: emb(rows(bad_ids, tall)), "'ids'", f"= {V + 7}", f"outside [0, {V})",
                 "num_embeddings")
    logits = torch.randn(N, S, V // n)
    expect_error(lambda: cross_entropy_2d(logits, torch.zeros(N, S + 1, dtype=torch.int64), wide),
                 "nn.functional.cross_entropy_2d", "'target_local'", f"{(N, S)}")
    expect_error(lambda: cross_entropy_2d(logits, torch.zeros(N, S), wide), "'target_local'",
                 "int64", kind=CommTypeError)
    expect_error(lambda: cross_entropy_2d(torch.zeros(N, S, 2, dtype=torch.int64),
                                          torch.zeros(N, S, dtype=torch.int64), wide),
                 "'logits_local'", "floating-point", kind=CommTypeError)
    target = torch.zeros(N, S, dtype=torch.int64)
    target[-1, -1] = V  # on the last mesh row only
    expect_error(lambda: cross_entropy_2d(torch.randn(N // n, S, V), rows(target, tall), tall),
                 "'target_local'", f"outside [0, {V})", "ignore_index")
    expect_error(lambda: TransformerBlock2D(H, HEADS, FFN, mesh=mesh, overlap=1), "'overlap'",
                 kind=CommTypeError)
    blk = TransformerBlock2D(H, HEADS, FFN, mesh=mesh)
    expect_error(lambda: blk(torch.randn(N, H // n)), "nn.TransformerBlock2D", "'x'", "3-D")
    expect_error(lambda: TransformerBlock2D.from_dense(nn.Linear(H, H), mesh), "'module'",
                 "TransformerBlock", kind=CommTypeError)
    expect_error(lambda: TransformerBlock2D.from_dense(TransformerBlock(H, HEADS, FFN), mesh,
                                                       causal=False), "'causal'",
                 "not an option of from_dense", "'overlap'")


if __name__ == "__main__":
    import tp2d_cases  # Linear2D's cases too: tests/test_tensor_parallel_2d.py runs both in one job

    main(globals(), tp2d_cases)
