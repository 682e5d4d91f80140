"""2D tensor parallelism (commlib.nn.Linear2D, split_2d, gather_2d) on real ranks against the dense
torch.nn.Linear computed in one process (here, on every rank, from the same seeded weights).

The expected blocks are sliced here by the layout's definition (rank (i, j) of an (r, c) mesh:
rows block i of dim 0, block j of the last dim; the weight's rows block j and columns block i),
never with the library's helpers. The dense loss is ``sum(y * dy)``; each rank backpropagates its
block of ``dy`` (the 2D layers' convention: per-rank losses summed). The bytes each rank sends
are counted by commlib.nn.functional.traffic() and compared with SUMMA's closed form written out
here. Meshes come from the world size n: (1, n), (n, 1), and (2, n/2) when n is even and >= 4;
every size is a multiple of 12 (of 24 for in_features), so n = 1, 2, 3, 4, 6 all run.
"""

from __future__ import annotations

import itertools
import math
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _harness import expect_error, main  # noqa: E402
from _tp2d import block, close, data, meshes  # noqa: E402

import commlib  # noqa: E402
from commlib.errors import CommTypeError  # noqa: E402
from commlib.nn import Linear2D  # noqa: E402
from commlib.nn import functional as F  # noqa: E402

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
N, M, IN, OUT = 12, 2, 24, 36  # rows (dim 0), a middle dim, in and out features


def summa_bytes(r, c, tokens, fin, fout, s, bias):
    """Bytes one rank sends for one Linear2D (forward, backward): every rank roots its share of
    the broadcasts of x's panels along its row ((c-1) copies of its x block) and of W's panels
    along its column ((r-1) copies of its W block), in forward and again in backward, where the
    reductions of dx's and dW's partials send each non-owned partial once (the same volumes
    again); a bias adds one ring all-reduce of out/c elements over the column in backward."""
    x_block, w_block = tokens * fin // (r * c), fin * fout // (r * c)
    forward = s * ((c - 1) * x_block + (r - 1) * w_block)
    return forward, 2 * forward + (2 * (r - 1) * (fout // c) * s // r if bias else 0)


def case_linear_2d():
    for mesh, dtype, overlap, bias in itertools.product(
            meshes(), (torch.float64, torch.float32, torch.bfloat16, torch.float16), (True, False),
            (True, False)):
        shape = r, c = mesh.shape
        i, j = mesh.coords
        torch.manual_seed(7)
        dense = nn.Linear(IN, OUT, bias=bias, dtype=dtype)
        x = data((N, M, IN), 1, dtype).requires_grad_()
        dy = data((N, M, OUT), 2, dtype)
        y = dense(x)
        (y * dy).sum().backward()
        for panels in (None, math.lcm(r, c)):
            layer = Linear2D.from_dense(dense, mesh, overlap=overlap, panels=panels)
            wb = dense.weight.detach()[j * OUT // c:(j + 1) * OUT // c, i * IN // r:(i + 1) * IN // r]
            assert torch.equal(layer.weight.detach(), wb), "weight block layout"
            xl = block(x.detach(), mesh).clone().requires_grad_()
            with F.traffic() as fwd:
                yl = layer(xl)
            with F.traffic() as bwd:
                (yl * block(dy, mesh)).sum().backward()
            tol = TOL[dtype]
            what = f"{shape} {dtype} overlap={overlap} bias={bias} panels={panels}"
            close(f"y {what}", yl.detach(), block(y.detach(), mesh), tol)
            close(f"dx {what}", xl.grad, block(x.grad, mesh), tol)
            d = layer.to_dense()
            assert torch.equal(d.weight.detach(), dense.weight.detach()), what
            close(f"dW {what}", d.weight.grad, dense.weight.grad, tol)
            if bias:
                close(f"db {what}", d.bias.grad, dense.bias.grad, tol)
            want = summa_bytes(r, c, N * M, IN, OUT, x.element_size(), bias)
            got = (fwd.sent, bwd.sent)
            assert got == want, (what, got, want, fwd.by_kind, bwd.by_kind)
    print("linear_2d ok", flush=True)


def case_mlp_2d_composes():
    """Two Linear2D layers with GELU between them: the output layout of one is the input layout
    of the next (no re-layout), float32 against the dense MLP."""
    for mesh in meshes():
        shape = r, c = mesh.shape
        torch.manual_seed(3)
        fc1, fc2 = nn.Linear(IN, 2 * IN), nn.Linear(2 * IN, IN)
        x = data((N, M, IN), 4, torch.float32).requires_grad_()
        y = fc2(torch.nn.functional.gelu(fc1(x)))
        y.square().sum().backward()
        l1, l2 = Linear2D.from_dense(fc1, mesh), Linear2D.from_dense(fc2, mesh)
        xl = block(x.detach(), mesh).clone().requires_grad_()
        yl = l2(torch.nn.functional.gelu(l1(xl)))
        yl.square().sum().backward()
        close(f"mlp y {shape}", yl.detach(), block(y.detach(), mesh), 1e-5)
        close(f"mlp dx {shape}", xl.grad, block(x.grad, mesh), 1e-5)
        for layer, ref in ((l1, fc1), (l2, fc2)):
            d = layer.to_dense()
            close(f"mlp dW {shape}", d.weight.grad, ref.weight.grad, 1e-5)
            close(f"mlp db {shape}", d.bias.grad, ref.bias.grad, 1e-5)


def case_split_gather_2d():
    for mesh in meshes():
        shape = r, c = mesh.shape
        x = data((N, 3, IN), 5, torch.float64).requires_grad_()
        part = F.split_2d(x, mesh)
        assert torch.equal(part, block(x, mesh))
        full = F.gather_2d(part.detach().clone().requires_grad_(), mesh)
        assert torch.equal(full, x.detach()), shape
        # gather_2d's backward: each rank's loss counts, so a block's gradient is the sum over
        # the r*c ranks of that block of their gradients (here all alike: r*c times it)
        xl = block(x.detach(), mesh).clone().requires_grad_()
        w = data((N, 3, IN), 6, torch.float64)
        (F.gather_2d(xl, mesh) * w).sum().backward()
        assert torch.allclose(xl.grad, r * c * block(w, mesh)), shape
        # split_2d is a differentiable slice
        (part * 2).sum().backward()
        want = torch.zeros_like(x)
        block(want, mesh).fill_(2)
        assert torch.equal(x.grad, want)


def case_errors_2d():
    n = commlib.get_world_size()
    if n == 1:
        return
    mesh = commlib.Mesh((1, n))
    flat = commlib.Mesh((n,))
    expect_error(lambda: Linear2D(IN + 1, OUT, mesh=mesh), "in_features", str(IN + 1),
                 f"multiple of {n}")
    expect_error(lambda: Linear2D(IN, OUT + 1, mesh=mesh), "out_features", str(OUT + 1),
                 f"multiple of {n}")
    expect_error(lambda: Linear2D(IN, OUT, mesh=flat), "mesh", "2-dimensional", "(r, c)")
    expect_error(lambda: Linear2D(IN, OUT, mesh="2x2"), "mesh", "commlib.Mesh", kind=CommTypeError)
    expect_error(lambda: Linear2D(IN, OUT, mesh=mesh, panels=IN * 2), "panels", "divides")
    layer = Linear2D(IN, OUT, mesh=mesh)
    expect_error(lambda: layer(torch.randn(4, IN)), "x", f"last dim {IN // n}", "split_2d")
    expect_error(lambda: layer(torch.randn(4, IN // n, dtype=torch.float64)), "dtype",
                 kind=CommTypeError)
    expect_error(lambda: F.split_2d(torch.randn(N + 1, IN), mesh.__class__((n, 1))),
                 "dimension 0", str(N + 1), f"multiple of {n}")
    expect_error(lambda: F.split_2d(torch.randn(N, IN + 1), mesh), "last dimension",
                 str(IN + 1), f"multiple of {n}")
    expect_error(lambda: Linear2D.from_dense(nn.Linear(IN, OUT), mesh, bias=False), "bias",
                 "from_dense")


if __name__ == "__main__":
    main(globals())
