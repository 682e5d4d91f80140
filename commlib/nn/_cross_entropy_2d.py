"""``cross_entropy_2d``: the vocabulary-parallel loss of the 2D layers, straight from the logits'
(N/r, ..., V/c) blocks (see ``layers_2d.py`` for the layout, the convention and the bytes). Its
own module so that ``commlib.nn.functional`` exports it without importing the layers."""

from __future__ import annotations

import torch

import commlib
from commlib.api.entry import checked_call
from commlib.errors import CommTypeError, arg_error

from . import _traffic
from ._grid import grid_of

__all__ = ["cross_entropy_2d"]


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and reductions run in float32, or float64 for float64 data."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----- cross_entropy_2d -------------------------------------------------------------------------
class _CrossEntropy2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, grid, ignore_index, fn):
        v = logits.shape[-1]
        vocab = v * grid.c
        sd = _stat_dtype(logits.dtype)
        z = logits.detach().reshape(-1, v).to(sd)
        t = target.reshape(-1).to(torch.int64)
        m = z.max(-1).values
        _traffic.all_reduce(m, grid.row, op=commlib.ReduceOp.MAX)
        zs = z - m[:, None]
        valid = t != ignore_index
        local = t - grid.j * v
        mine = valid & (local >= 0) & (local < v)  # my block holds the target's logit
        picked = zs.gather(1, local.clamp(0, v - 1)[:, None]).squeeze(1)
        stats = torch.stack((zs.exp().sum(-1), torch.where(mine, picked, 0)), -1)
        _traffic.all_reduce(stats, grid.row)  # sum of exp and target logit, over the vocabulary
        lse = stats[:, 0].log()
        per_token = torch.where(valid, lse - stats[:, 1], 0)
        bad = valid & ((t < 0) | (t >= vocab))
        # one column all-reduce: the loss, the tokens counted and the bad targets, summed over
        # the mesh rows (a row's ranks hold the same targets: every rank sees every row once)
        total = torch.stack((per_token.sum().to(torch.float64), valid.sum().to(torch.float64),
                             bad.sum().to(torch.float64)))
        _traffic.all_reduce(total, grid.col)
        if total[2].item():
            raise arg_error(fn, "target_local", f"<{int(total[2].item())} bad ids>",
                            f"holds target ids outside [0, {vocab}) (the vocabulary: {v} logits "
                            f"per rank x {grid.c} columns) that are not ignore_index "
                            f"({ignore_index})",
                            f"pass class ids in [0, {vocab}) or ignore_index for tokens without "
                            "a target")
        # m and lse apart: far from zero their sum would round (at 1e3, float32 keeps 6e-5)
        ctx.save_for_backward(logits, m, lse, local, mine, valid, total[1:2])
        return (total[0] / total[1]).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, m, lse, local, mine, valid, count = ctx.saved_tensors
        v = logits.shape[-1]
        sd = m.dtype
        z = logits.detach().reshape(-1, v).to(sd)
        p = ((z - m[:, None]) - lse[:, None]).exp()  # the softmax block
        rows = torch.nonzero(mine).squeeze(1)
        p[rows, local[rows]] -= 1
        p *= valid[:, None]
        dz = p * (grad.to(sd) / count.to(sd))
        return dz.to(logits.dtype).view(logits.shape), None, None, None, None


def cross_entropy_2d(logits_local: torch.Tensor, target_local: torch.Tensor, mesh, *,
                     ignore_index: int = -100) -> torch.Tensor:
    """The mean cross-entropy of the global batch, vocabulary-parallel on an (r, c) mesh.

    ``logits_local`` ``(N/r, ..., V/c)`` is rank (i, j)'s block (rows block i, vocabulary block
    j: what ``Linear2D(H, V)`` returns); ``target_local`` ``(N/r, ...)`` the global class ids of
    rows block i (the same on every rank of row i). The classes are the *last* dim (torch's
    ``cross_entropy`` takes them in dim 1). Returns the mean over all the global batch's tokens
    whose target is not ``ignore_index`` (as ``cross_entropy(..., reduction="mean")``): the same
    scalar on every rank.

    Gradient: unlike the 2D layers' sum-of-local-losses convention, this loss is *one* loss
    present on every rank; its backward gives every rank its block of the gradient of that one
    loss, which is exactly what the layers before it expect. Call ``loss.backward()`` on every
    rank (with the same output gradient): the model is trained once, not r*c times.

    Numerically stable (the row's max is subtracted) and in float32 for bfloat16 and float16
    logits. Communication: an all-reduce MAX and one fused all-reduce SUM along the row, one
    three-scalar all-reduce along the column; none in backward. A target outside [0, V) that is
    not ``ignore_index`` raises on every rank.

    Example, 4 ranks, mesh (2, 2), global logits (2, 4) and targets (2,): rank (i, j) passes
    ``logits[i:i+1, 2j:2j+2]`` and ``target[i:i+1]``; every rank gets
    ``torch.nn.functional.cross_entropy(logits, target)``.
    """
    fn = "nn.functional.cross_entropy_2d"
    grid = grid_of(fn, mesh)
    with checked_call(fn, grid.whole) as (_, call):
        if not isinstance(logits_local, torch.Tensor) or not logits_local.is_floating_point():
            what = f"<tensor dtype={logits_local.dtype}>" \
                if isinstance(logits_local, torch.Tensor) else type(logits_local).__name__
            raise arg_error(fn, "logits_local", what, "must be a floating-point torch.Tensor",
                            f"pass this rank's (N/{grid.r}, ..., V/{grid.c}) logits block",
                            CommTypeError)
        if logits_local.dim() < 2 or logits_local.numel() == 0:
            raise arg_error(fn, "logits_local", f"<tensor shape={tuple(logits_local.shape)}>",
                            "must be a non-empty block (N/r, ..., V/c): tokens first, this "
                            "rank's vocabulary block last",
                            "pass e.g. the output of Linear2D(H, V) on this rank")
        if not isinstance(target_local, torch.Tensor) or target_local.dtype not in (
                torch.int64, torch.int32):
            what = f"<tensor dtype={target_local.dtype}>" \
                if isinstance(target_local, torch.Tensor) else type(target_local).__name__
            raise arg_error(fn, "target_local", what, "must be a torch.Tensor of int64 class ids",
                            f"pass this rank's (N/{grid.r}, ...) targets as torch.int64",
                            CommTypeError)
        if tuple(target_local.shape) != tuple(logits_local.shape[:-1]):
            raise arg_error(fn, "target_local", f"<tensor shape={tuple(target_local.shape)}>",
                            f"must have the logits' shape without the vocabulary dim, "
                            f"{tuple(logits_local.shape[:-1])}",
                            "pass the targets of the same rows block as the logits")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise arg_error(fn, "ignore_index", ignore_index, "must be an int",
                            "pass e.g. ignore_index=-100", CommTypeError)
        call.update(shape=tuple(logits_local.shape), dtype=str(logits_local.dtype))
    return _CrossEntropy2D.apply(logits_local, target_local, grid, ignore_index, fn)
