"""A small transformer language model trained with 2D (Optimus) tensor parallelism on CPU ranks,
checked step by step against the same dense model in one process.

On an (r, c) mesh every activation is split in both directions: rank (i, j) holds batch rows
block i and features block j. The model is Embedding2D (tokens, and positions) -> 2 x
TransformerBlock2D -> LayerNorm2D -> Linear2D to the vocabulary (logits block j of the
vocabulary) -> cross_entropy_2d, the mean loss of the global batch on every rank. Every rank
calls ``loss.backward()`` and takes its SGD step on its parameter blocks: no gradient is
reduced by hand, the layers' backward already gives each block its full gradient.

Rank 0 also trains the dense model (``commlib.nn.TransformerBlock`` and torch's
layers, drawn from the same seed) on the same batches and prints both losses side by side:

    mpiexec -n 4 .venv/bin/python examples/tp2d_lm.py                 # mesh 2x2, float32
    mpiexec -n 4 .venv/bin/python examples/tp2d_lm.py --mesh 1x4 --dtype float64

It exits non-zero if a step's losses differ by more than ``--rtol`` (default 1e-5 for float32,
1e-10 for float64) relative to the dense loss.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import commlib
from commlib.nn import Embedding2D, LayerNorm2D, Linear2D, TransformerBlock, TransformerBlock2D
from commlib.nn.functional import cross_entropy_2d


class DenseLM(nn.Module):
    """The one-process model: token + position embeddings, pre-norm blocks, final norm, head."""

    def __init__(self, args, dtype):
        super().__init__()
        kw = dict(dtype=dtype)
        self.tok, self.pos = nn.Embedding(args.vocab, args.dim, **kw), \
            nn.Embedding(args.seq_len, args.dim, **kw)
        self.blocks = nn.ModuleList(TransformerBlock(args.dim, args.heads, 4 * args.dim, **kw)
                                    for _ in range(args.layers))
        self.ln, self.head = nn.LayerNorm(args.dim, **kw), nn.Linear(args.dim, args.vocab, **kw)

    def forward(self, tokens, targets):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LM2D(nn.Module):
    """The same model on the mesh: each layer holds its blocks of the dense one's parameters."""

    def __init__(self, dense: DenseLM, mesh):
        super().__init__()
        self.mesh = mesh
        self.tok, self.pos = Embedding2D.from_dense(dense.tok, mesh), \
            Embedding2D.from_dense(dense.pos, mesh)
        self.blocks = nn.ModuleList(TransformerBlock2D.from_dense(b, mesh) for b in dense.blocks)
        self.ln, self.head = LayerNorm2D.from_dense(dense.ln, mesh), \
            Linear2D.from_dense(dense.head, mesh)

    def forward(self, tokens, targets):
        """``tokens``, ``targets``: this mesh row's batch rows (B/r, S), the same on every rank
        of the row. Returns the mean loss of the global batch (the same on every rank)."""
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]).expand_as(tokens))
        for blk in self.blocks:
            x = blk(x)
        return cross_entropy_2d(self.head(self.ln(x)), targets, self.mesh)

    def to_dense(self, args, dtype) -> DenseLM:
        """The dense model (collective over the mesh)."""
        dense = DenseLM(args, dtype)
        for name in ("tok", "pos", "ln", "head"):
            setattr(dense, name, getattr(self, name).to_dense())
        dense.blocks = nn.ModuleList(b.to_dense() for b in self.blocks)
        return dense


def batch(step, args):
    """A learnable toy language: each token is the previous one plus a per-sequence stride."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 5, (args.batch, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq_len + 1)) % args.vocab
    return seq[:, :-1], seq[:, 1:]


def mesh_shape(text, n):
    if text is None:
        return (2, n // 2) if n % 2 == 0 and n >= 4 else (1, n)
    r, c = (int(v) for v in text.lower().split("x"))
    return r, c


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mesh", help="r x c, e.g. 2x2 (default: 2 x n/2 for even n >= 4, else 1 x n)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=48)
    p.add_argument("--dim", type=int, default=48)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--rtol", type=float, help="allowed |loss 2d - loss dense| / |loss dense|")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rtol = args.rtol if args.rtol is not None else (1e-5 if dtype == torch.float32 else 1e-10)
    torch.set_num_threads(1)
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    mesh = commlib.Mesh(mesh_shape(args.mesh, n))
    r, i = mesh.shape[0], mesh.coords[0]
    rows = args.batch // r  # this mesh row's batch rows (the layers check the other sizes)

    torch.manual_seed(0)
    dense = DenseLM(args, dtype)  # the same on every rank: each keeps its blocks
    model = LM2D(dense, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ref_opt = torch.optim.SGD(dense.parameters(), lr=args.lr, momentum=0.9) if rank == 0 else None
    if rank == 0:
        print(f"mesh {mesh.shape[0]}x{mesh.shape[1]}, {args.dtype}, "
              f"{sum(p.numel() for p in dense.parameters())} parameters "
              f"({sum(p.numel() for p in model.parameters())} on this rank)", flush=True)
    worst = 0.0
    for step in range(args.steps):
        tokens, targets = batch(step, args)
        loss = model(tokens[i * rows:(i + 1) * rows], targets[i * rows:(i + 1) * rows])
        opt.zero_grad()
        loss.backward()  # every rank: the loss is one, present everywhere (cross_entropy_2d)
        opt.step()
        if rank == 0:
            want = dense(tokens, targets)
            ref_opt.zero_grad()
            want.backward()
            ref_opt.step()
            diff = abs(loss.item() - want.item()) / abs(want.item())
            worst = max(worst, diff)
            print(f"step {step:2d}  loss 2d {loss.item():.8f}  dense {want.item():.8f}  "
                  f"rel diff {diff:.2e}", flush=True)
    trained = model.to_dense(args, dtype)  # collective
    ok = torch.tensor([1 if worst <= rtol else 0])
    if rank == 0:
        params = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                     for a, b in zip(trained.parameters(), dense.parameters()))
        print(f"max rel loss diff {worst:.2e} (allowed {rtol:.0e}); parameters after training: "
              f"max rel diff {params:.2e}", flush=True)
        if not ok.item():
            print("FAILED: the 2D model's losses differ from the dense model's", flush=True)
    commlib.broadcast(ok, group_src=0)
    commlib.barrier()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
