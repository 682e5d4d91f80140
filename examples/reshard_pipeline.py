"""Two pipeline stages on meshes of different shapes, joined by ``commlib.reshard``, trained on
CPU ranks and checked step by step against the same dense model in one process.

Stage 0 runs on the first ``--stage0`` ranks (default 2) and is tensor-parallel: a
column-parallel ``Linear(D, H)`` + GELU whose output features are split over its ranks, so the
activation of a micro-batch leaves stage 0 as ``Shard(1)`` on mesh ``(2,)``. Stage 1 runs on the
remaining ranks (1-3 at 3-5 ranks) and wants the activation as ``Shard(0)`` (its ranks split the
micro-batch's rows, data parallel, and all-reduce their weight gradients once per step) or, with
``--stage1 replicate``, as ``Replicate()`` (every rank of it runs the whole micro-batch):
``Linear(H, F)`` + GELU + ``Linear(F, C)`` and a mean squared error against the targets.

Every transfer is ``reshard(..., async_op=True)``: forward, the activation of micro-batch k
travels from stage 0's layout to stage 1's while stage 0 computes micro-batch k + 1 and stage 1
computes micro-batch k - 1; backward, the activation's gradient travels back (stage 1's layout to
stage 0's) while stage 1 computes the next micro-batch and stage 0 runs the backward of the
previous one (GPipe's order, with the transfers overlapped: the paper's overlapping-friendly
idea). ``reshard`` is collective over the world, so every rank issues the transfers in one order:
the forward ones of micro-batches 0..M-1, then the backward ones.

Rank 0 also trains the dense model (the same layers, drawn from the same seed) on the same
batches with the same micro-batches and prints both losses side by side::

    mpiexec -n 3 .venv/bin/python examples/reshard_pipeline.py              # stages of 2 and 1
    mpiexec -n 4 .venv/bin/python examples/reshard_pipeline.py --stage1 replicate

It exits non-zero if a step's losses differ by more than ``--rtol`` (default 1e-5 for float32,
1e-10 for float64) relative to the dense loss.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import commlib
from commlib.reshard import Layout, Replicate, Shard, plan, reshard


class Dense(nn.Module):
    """The one-process model: stage 0's layer, then stage 1's two."""

    def __init__(self, args, dtype):
        super().__init__()
        kw = dict(dtype=dtype)
        self.fc0 = nn.Linear(args.dim, args.hidden, **kw)
        self.fc1 = nn.Linear(args.hidden, args.ffn, **kw)
        self.fc2 = nn.Linear(args.ffn, args.classes, **kw)

    def stage0(self, x):
        return nn.functional.gelu(self.fc0(x))

    def stage1(self, h):
        return self.fc2(nn.functional.gelu(self.fc1(h)))


def batch(step, args, dtype):
    """Inputs and the targets of a fixed random teacher (learnable, so the loss falls)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(args.batch, args.dim, generator=g, dtype=dtype)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(args.classes, args.dim, generator=teacher, dtype=dtype) / args.dim ** 0.5
    return x, torch.tanh(x @ w.t())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--stage0", type=int, default=2, help="ranks of stage 0 (default 2)")
    p.add_argument("--stage1", choices=("shard0", "replicate"), default="shard0",
                   help="stage 1's layout of the activation: Shard(0) (default) or Replicate()")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch", type=int, default=28,
                   help="rows per step, all micro-batches (default 28: micro-batches of 7 rows, split\n"
                        "unevenly by stage 1: 4 + 3 at 2 ranks, 3 + 3 + 1 at 3)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=35,
                   help="H, split over stage 0 (default 35: 18 + 17 at 2 ranks)")
    p.add_argument("--ffn", type=int, default=32)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--rtol", type=float, help="allowed |loss pipeline - loss dense| / |loss dense|")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rtol = args.rtol if args.rtol is not None else (1e-5 if dtype == torch.float32 else 1e-10)
    torch.set_num_threads(1)
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    if not 1 <= args.stage0 < n or args.batch % args.micro_batches:
        if rank == 0:
            print(f"need 1 <= --stage0 < {n} ranks and --batch a multiple of --micro-batches",
                  file=sys.stderr)
        return 2
    ranks0, ranks1 = list(range(args.stage0)), list(range(args.stage0, n))
    mb = args.batch // args.micro_batches
    act_shape = (mb, args.hidden)  # one micro-batch's activation between the stages
    # the two layouts of that activation: stage 0 splits the features, stage 1 the rows (or not)
    out0 = Layout(ranks0, [Shard(1)])
    in1 = Layout(ranks1, [Shard(0) if args.stage1 == "shard0" else Replicate()])
    stage1_group = commlib.new_group(ranks1)  # collective over the world: every rank creates it

    torch.manual_seed(0)
    dense = Dense(args, dtype)  # the same on every rank: each keeps its part
    if rank in ranks0:  # fc0's output features of this rank (its Shard(1) columns)
        (lo, hi), = out0.box(rank, act_shape)[1:]
        w0 = dense.fc0.weight.detach()[lo:hi].clone().requires_grad_()
        b0 = dense.fc0.bias.detach()[lo:hi].clone().requires_grad_()
        params = [w0, b0]
    else:  # stage 1's layers, whole (data parallel over the rows under Shard(0))
        (rlo, rhi), _ = in1.box(rank, act_shape)
        stage1 = Dense(args, dtype)
        stage1.load_state_dict(dense.state_dict())
        stage1.fc0 = None
        params = list(stage1.parameters())
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    ref_opt = torch.optim.SGD(dense.parameters(), lr=args.lr, momentum=0.9) if rank == 0 else None
    if rank == 0:
        print(f"stage 0: ranks {ranks0}, activation {list(act_shape)} as {out0.placements}; "
              f"stage 1: ranks {ranks1} as {in1.placements}; {args.micro_batches} micro-batches "
              f"of {mb}, {args.dtype}", flush=True)
        print(plan(act_shape, dtype, out0, in1), flush=True)  # forward; backward: in1 -> out0
    kw = dict(global_shape=act_shape, dtype=dtype, async_op=True)
    worst = 0.0
    for step in range(args.steps):
        x, y = batch(step, args, dtype)
        xs, ys = x.split(mb), y.split(mb)
        opt.zero_grad()
        loss_sum = torch.zeros((), dtype=torch.float64)
        if rank in ranks0:
            # forward: micro-batch k's activation leaves while micro-batch k + 1 is computed
            acts, sent = [], []
            for k in range(args.micro_batches):
                a = nn.functional.gelu(xs[k] @ w0.t() + b0)
                acts.append(a)
                sent.append(reshard(a.detach(), out0, in1, **kw))
            # backward: all gradients requested; micro-batch k's backward runs while k + 1's
            # gradient travels
            grads = [reshard(None, in1, out0, **kw) for _ in range(args.micro_batches)]
            for k in range(args.micro_batches):
                sent[k].wait()
                acts[k].backward(grads[k].wait())
        else:
            fwd = [reshard(None, out0, in1, **kw) for _ in range(args.micro_batches)]
            grads = []
            for k in range(args.micro_batches):
                h = fwd[k].wait().requires_grad_()  # micro-batch k + 1 is still travelling
                out = stage1.stage1(h)
                # this rank's rows' share of the step's mean squared error
                part = ((out - ys[k][rlo:rhi]) ** 2).sum() / (args.batch * args.classes)
                part.backward()
                if args.stage1 == "shard0" or rank == ranks1[0]:
                    loss_sum += part.detach().to(torch.float64)
                # the gradient goes back while the next micro-batch is computed
                grads.append(reshard(h.grad, in1, out0, **kw))
            for w in grads:
                w.wait()
            if args.stage1 == "shard0":  # the rows were split: sum the weight gradients
                for q in params:
                    commlib.all_reduce(q.grad, group=stage1_group)
        opt.step()
        commlib.all_reduce(loss_sum)  # stage 1's loss, on every rank
        if rank == 0:
            ref_opt.zero_grad()
            want = 0.0
            for k in range(args.micro_batches):  # the same micro-batches, one process
                out = dense.stage1(dense.stage0(xs[k]))
                part = ((out - ys[k]) ** 2).sum() / (args.batch * args.classes)
                part.backward()
                want += part.item()
            ref_opt.step()
            got = loss_sum.item()
            diff = abs(got - want) / abs(want)
            worst = max(worst, diff)
            print(f"step {step:2d}  loss pipeline {got:.8f}  dense {want:.8f}  "
                  f"rel diff {diff:.2e}", flush=True)
    ok = torch.tensor([1 if worst <= rtol else 0])
    if rank == 0:
        print(f"max rel loss diff {worst:.2e} (allowed {rtol:.0e})", flush=True)
        if not ok.item():
            print("FAILED: the pipeline's losses differ from the dense model's", flush=True)
    commlib.broadcast(ok, group_src=0)
    commlib.barrier()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
