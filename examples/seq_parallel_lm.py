"""A small transformer language model trained with sequence parallelism on CPU ranks.

Every rank holds a zigzag shard of each training sequence (``shard_sequence``); attention runs
through ``commlib.nn.SequenceParallelAttention`` (ring attention: K/V travel around the ranks);
everything else (embeddings, MLP, layer norms, the loss) is per token and needs no communication.
After backward the weight gradients are summed over the ranks (``commlib.all_reduce``), as in data
parallelism, so every rank takes the same optimizer step as one process on the full sequence.

    mpiexec -n 2 .venv/bin/python examples/seq_parallel_lm.py --steps 10
    .venv/bin/python examples/seq_parallel_lm.py --steps 10 --reference   # one process, plain SDPA

Both print ``step <i> loss <value>`` lines that agree step for step (float32 rounding apart).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import commlib
from commlib.nn import SequenceParallelAttention
from commlib.nn.functional import shard_sequence


class ReferenceAttention(nn.Module):
    """One-process attention with the same parameters (names, shapes, creation order) as
    SequenceParallelAttention, computed with torch's scaled_dot_product_attention."""

    def __init__(self, embed_dim, num_heads, num_kv_heads):
        super().__init__()
        self.h, self.hk, self.hd = num_heads, num_kv_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.hd)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.hd)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        b, s, e = x.shape
        q = self.q_proj(x).view(b, s, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.hk, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.hk, self.hd).transpose(1, 2)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                       enable_gqa=self.h != self.hk)
        return self.out_proj(a.transpose(1, 2).reshape(b, s, e))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, reference):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ReferenceAttention(dim, heads, kv_heads) if reference else \
            SequenceParallelAttention(dim, heads, kv_heads, causal=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, heads, kv_heads, layers, max_len, reference=False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, reference) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens, positions):
        x = self.tok(tokens) + self.pos(positions)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def batch(step, args):
    """A learnable toy language: each token is the previous one plus a per-sequence stride."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 5, (args.batch, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq_len + 1)) % args.vocab
    return seq[:, :-1], seq[:, 1:]


def train(args) -> list[float]:
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.heads, args.kv_heads, args.layers, args.seq_len,
                   reference=args.reference)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    n = 1 if args.reference else commlib.get_world_size()
    shard = (lambda t: t) if args.reference else (lambda t: shard_sequence(t, dim=1))
    positions = shard(torch.arange(args.seq_len).expand(args.batch, -1))
    losses = []
    for step in range(args.steps):
        inputs, targets = batch(step, args)
        logits = model(shard(inputs), positions)
        # mean over all tokens of the full batch: local sum / global token count
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), shard(targets).flatten(),
                                           reduction="sum") / targets.numel()
        opt.zero_grad()
        loss.backward()
        total = loss.detach().clone()
        if n > 1:
            for p in model.parameters():
                commlib.all_reduce(p.grad)
            commlib.all_reduce(total)
        opt.step()
        losses.append(total.item())
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=96)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--reference", action="store_true", help="one process, plain SDPA attention")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not args.reference:
        commlib.init()
    losses = train(args)
    if args.reference or commlib.get_rank() == 0:
        for i, loss in enumerate(losses):
            print(f"step {i} loss {loss:.8f}", flush=True)


if __name__ == "__main__":
    main()
