"""The collective matmuls: public entries, their checks and their autograd functions.

``all_gather_matmul(a_shard, b)`` is ``all_gather(a_shard) @ b`` and ``matmul_reduce_scatter(a,
b)`` is ``reduce_scatter(a @ b)``, with the communication hidden behind the matmul: a ring of
point-to-point messages in which each rank multiplies the block it holds while the next one
travels (:mod:`commlib.overlap.ring`), cut into pieces as the plan says
(:mod:`commlib.overlap.plan`). Each is the other's backward, so the backward passes overlap the
same way. See ``docs/overlap.md``.
"""

from __future__ import annotations


import torch
from torch.autograd.function import once_differentiable

from ..api.entry import checked_call
from ..api.groups import resolve_group
from ..errors import CommTypeError, CommUnsupportedError, arg_error
from ..ops import ReduceOp, accumulation_dtype, dtype_name, to_reduce_op
from ..tuning import memo_key
from . import ring
from .costs import agreed_rate, known_rate, p2p_link, plain_seconds, shares_cores
from .plan import KINDS, MAX_CHUNKS, OverlapPlan, plan

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "plan_all_gather_matmul",
           "plan_matmul_reduce_scatter", "explain", "OPS"]

# op= of matmul_reduce_scatter -> what the rank's summed block is divided by (group size p).
# MIN/MAX/PRODUCT of partial products are not what a sharded matmul needs, and their gradients
# are not a gather of the output's; bitwise ops need integers (matmul here is floating).
OPS = {ReduceOp.SUM: lambda p: 1, ReduceOp.AVG: lambda p: p}


# ----- checks ------------------------------------------------------------------------------------


def _tensor(fn: str, arg: str, t, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise arg_error(fn, arg, type(t).__name__, "must be a torch.Tensor", f"pass {what}",
                        CommTypeError)
    if not t.is_floating_point():
        raise arg_error(fn, arg, f"<tensor dtype={dtype_name(t.dtype)}>", "must be floating point",
                        "convert to float32, float64, bfloat16 or float16", CommTypeError)
    return t


def _pair(fn: str, a_arg: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if b.dtype != a.dtype:
        raise arg_error(fn, "b", f"<tensor dtype={dtype_name(b.dtype)}>",
                        f"must have the dtype of '{a_arg}' ({dtype_name(a.dtype)})",
                        f"convert b with b.to({a_arg}.dtype)", CommTypeError)
    if b.device != a.device:
        raise arg_error(fn, "b", f"<tensor device={b.device}>",
                        f"must be on the device of '{a_arg}' ({a.device})",
                        f"move b with b.to({a_arg}.device)")


def _shape(value) -> tuple[int, ...] | None:
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (tuple, list)) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        return tuple(value)
    return None


def _dims(fn: str, kind: str, a_arg: str, a_shape, a_text, b_shape, b_text, dim_arg: str, dim,
          size: int) -> int:
    """Check the shapes of ``a`` (``a_text``: how to name its value) and ``b`` and the gather or
    scatter dim; returns the dim, non-negative."""
    if len(a_shape) < 2:
        raise arg_error(fn, a_arg, a_text, "must have at least 2 dims (..., k)",
                        f"give {a_arg} a dim to {'gather' if kind == KINDS[0] else 'scatter'} "
                        "along besides the last (k), e.g. a.unsqueeze(0)")
    if len(b_shape) != 2:
        raise arg_error(fn, "b", b_text, "must be 2-D (k, n)", "pass this rank's (k, n) matrix")
    if a_shape[-1] != b_shape[0]:
        raise arg_error(fn, "b", b_text,
                        f"must have {a_arg}'s last dim ({a_shape[-1]}) as its first (k)",
                        f"pass b shaped ({a_shape[-1]}, n), or transpose it")
    nd = len(a_shape)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -nd <= dim < nd:
        raise arg_error(fn, dim_arg, dim,
                        f"must be a dim of {a_arg} ({nd} dims) other than the last (k): one of "
                        f"{list(range(nd - 1))} or {list(range(-nd, -1))}",
                        f"pass {dim_arg}=0 for the first dim")
    d = dim % nd
    if d == nd - 1:
        raise arg_error(fn, dim_arg, dim, f"is the last dim of {a_arg}, the contracted one (k)",
                        f"pass one of {list(range(nd - 1))}")
    if kind == "matmul_reduce_scatter" and a_shape[d] % size:
        length = a_shape[d]
        raise arg_error(fn, a_arg, a_text,
                        f"length {length} along {dim_arg} {d} must divide by the group size "
                        f"{size} (rank r gets block r of the product, all of one size)",
                        f"pad {a_arg} along dim {d} to a multiple of {size} "
                        f"(e.g. {length + (-length) % size}), or use a group whose size divides "
                        f"{length}")
    return d


def _rows(kind: str, a_shape, size: int) -> int:
    rows = 1
    for x in a_shape[:-1]:
        rows *= x
    return rows if kind == "all_gather_matmul" else rows // size


def _chunks(fn: str, chunks, rows: int) -> int | None:
    if chunks is None:
        return None
    top = min(MAX_CHUNKS, max(rows, 1))
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 0 <= chunks <= top:
        raise arg_error(fn, "chunks", chunks,
                        f"must be None or an int from 0 (no decomposition: the plain "
                        f"collective, then the matmul) to {top} (the rows of a block, "
                        f"{rows}, and at most {MAX_CHUNKS})",
                        "pass None to let the cost model choose")
    return chunks


def _op(fn: str, op) -> ReduceOp:
    rop = to_reduce_op(op)
    if rop is None:
        raise arg_error(fn, "op", op, "is not a reduction operator",
                        "pass commlib.ReduceOp.SUM or commlib.ReduceOp.AVG", CommTypeError)
    if rop not in OPS:
        raise arg_error(fn, "op", rop, f"a collective matmul reduces with {[o.name for o in OPS]}",
                        "use ReduceOp.SUM (or AVG), or matmul then commlib.reduce_scatter_tensor",
                        CommUnsupportedError)
    return rop


# ----- plans -------------------------------------------------------------------------------------
def _plan(kind: str, g, a_shape, b_shape, dtype, device, dim: int, chunks, agree: bool) -> OverlapPlan:
    """The plan of one checked call on group ``g``: the group's link and matmul rate (``agree``:
    the agreed rate, collective on the group's first call of this dtype; else whatever is known
    without communicating), then the pure, cached planner. The plans calls run (``agree``) are
    memoized per group beside selection's choices: pricing the plain collective asks the cost
    model for every algorithm (~30 µs), once per shape instead of once per call."""
    device = torch.device(device)
    key = ("overlap", kind, tuple(a_shape), tuple(b_shape), dtype, device.type, dim, chunks,
           *memo_key())
    memo = g.resources.choices
    if agree and key in memo:
        return memo[key]
    link, source = p2p_link(g, device.type)
    rate = (agreed_rate if agree else known_rate)(g, dtype, device)
    rows = _rows(kind, a_shape, g.size)
    if kind == KINDS[0]:  # the plain all-gather's output, in a's dtype
        nbytes, collective = g.size * rows * a_shape[-1] * dtype.itemsize, "all_gather"
    else:  # the plain reduce-scatter's input: the product in the accumulation dtype
        nbytes = g.size * rows * b_shape[1] * accumulation_dtype(dtype).itemsize
        collective = "reduce_scatter"
    plain_s, plain_source = (plain_seconds(g, collective, nbytes, dtype, device.type, link)
                             if g.size > 1 else (0.0, "one rank"))
    pl = plan(kind, tuple(a_shape), tuple(b_shape), dtype, g.size, link, rate, dim, chunks,
              source, plain_s, plain_source, shares_cores(g, device.type))
    if agree:
        memo[key] = pl
    return pl


def _plan_entry(kind: str, fn: str, a_arg: str, dim_arg: str, a_shape, b_shape, dtype, group,
                dim, chunks, device) -> OverlapPlan:
    g = resolve_group(group, fn)
    a_s, b_s = _shape(a_shape), _shape(b_shape)
    if a_s is None:
        raise arg_error(fn, f"{a_arg}_shape", a_shape, "must be a tuple of non-negative ints",
                        f"pass {a_arg}.shape", CommTypeError)
    if b_s is None:
        raise arg_error(fn, "b_shape", b_shape, "must be a tuple of non-negative ints",
                        "pass b.shape", CommTypeError)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise arg_error(fn, "dtype", dtype, "must be a floating torch.dtype",
                        "pass e.g. torch.float32", CommTypeError)
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        raise arg_error(fn, "device", device, "is not a device", "pass 'cpu' or 'cuda'",
                        CommTypeError) from None
    d = _dims(fn, kind, f"{a_arg}_shape", a_s, a_s, b_s, b_s, dim_arg, dim, g.size)
    chunks = _chunks(fn, chunks, _rows(kind, a_s, g.size))
    return _plan(kind, g, a_s, b_s, dtype, dev, d, chunks, agree=False)


def plan_all_gather_matmul(a_shard_shape, b_shape, *, dtype: torch.dtype = torch.float32,
                           group=None, gather_dim: int = 0, chunks: int | None = None,
                           device="cpu") -> OverlapPlan:
    """The plan :func:`all_gather_matmul` would run for a shard shaped ``a_shard_shape`` and ``b``
    shaped ``b_shape`` on ``group`` (default: the world): ``print()`` it for the table of
    candidate chunk counts. Local: never communicates (before the group's first collective matmul
    of ``dtype`` it prices the matmul with this rank's measurement, and says so)."""
    return _plan_entry("all_gather_matmul", "overlap.plan_all_gather_matmul", "a_shard",
                       "gather_dim", a_shard_shape, b_shape, dtype, group, gather_dim, chunks,
                       device)


def plan_matmul_reduce_scatter(a_shape, b_shape, *, dtype: torch.dtype = torch.float32,
                               group=None, scatter_dim: int = 0, chunks: int | None = None,
                               device="cpu") -> OverlapPlan:
    """The plan :func:`matmul_reduce_scatter` would run (see :func:`plan_all_gather_matmul`)."""
    return _plan_entry("matmul_reduce_scatter", "overlap.plan_matmul_reduce_scatter", "a",
                       "scatter_dim", a_shape, b_shape, dtype, group, scatter_dim, chunks, device)


def explain(kind: str, a_shape, b_shape, dtype: torch.dtype = torch.float32, group=None, *,
            dim: int = 0, chunks: int | None = None, device="cpu") -> str:
    """Why a collective matmul cuts its blocks as it does: the plan's table (every candidate
    chunk count's predicted hop, matmul and total time, the one chosen and why) for ``kind``
    (``"all_gather_matmul"``: ``a_shape`` is the shard; ``"matmul_reduce_scatter"``: the whole
    ``a``) with ``dim`` the gather or scatter dim. ``print(commlib.overlap.explain(
    "all_gather_matmul", (1024, 4096), (4096, 1024)))``. Local: never communicates."""
    if kind not in KINDS:
        raise arg_error("overlap.explain", "kind", kind, f"is not one of {list(KINDS)}",
                        "pass 'all_gather_matmul' or 'matmul_reduce_scatter'")
    entry = plan_all_gather_matmul if kind == KINDS[0] else plan_matmul_reduce_scatter
    dim_kw = {"gather_dim" if kind == KINDS[0] else "scatter_dim": dim}
    return str(entry(a_shape, b_shape, dtype=dtype, group=group, chunks=chunks, device=device,
                     **dim_kw))


# ----- the autograd functions --------------------------------------------------------------------
def _gathered(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """``(p, *shape)`` blocks -> one tensor, the blocks one after the other along ``dim`` (rank
    order): a view for dim 0, one copy otherwise."""
    p, shape = blocks.shape[0], blocks.shape[1:]
    if dim == 0:
        return blocks.view(p * shape[0], *shape[1:])
    return blocks.movedim(0, dim).reshape(*shape[:dim], p * shape[dim], *shape[dim + 1:])


def _split(t: torch.Tensor, dim: int, p: int) -> torch.Tensor:
    """The inverse of :func:`_gathered`: ``t``'s ``p`` equal blocks along ``dim`` as ``(p, rows,
    width)``, block j the rows of rank j (a view for dim 0 on contiguous ``t``, else one copy)."""
    blocks = t.unflatten(dim, (p, t.shape[dim] // p)).movedim(dim, 0)
    return blocks.reshape(p, -1, t.shape[-1])


def _run_gather(g, shard: torch.Tensor, b: torch.Tensor | None, dim: int, chunks,
                b_shape=None):
    b_shape = tuple(b.shape) if b is not None else b_shape
    pl = _plan("all_gather_matmul", g, shard.shape, b_shape, shard.dtype, shard.device, dim,
               chunks, agree=True)
    run = ring.gather_matmul if pl.chunks else ring.gather_then_matmul
    gathered, products = run(g, pl, shard.contiguous(), b)
    return _gathered(gathered, dim), (None if products is None else _gathered(products, dim))


def _run_scatter(g, a: torch.Tensor, b: torch.Tensor, dim: int, op: ReduceOp, chunks,
                 addend: torch.Tensor | None = None) -> torch.Tensor:
    p = g.size
    pl = _plan("matmul_reduce_scatter", g, a.shape, b.shape, a.dtype, a.device, dim, chunks,
               agree=True)
    run = ring.matmul_scatter if pl.chunks else ring.matmul_then_scatter
    out = run(g, pl, _split(a, dim, p), b, None if addend is None else _split(addend, dim, p))
    divisor = OPS[op](p)
    if divisor != 1:
        out.div_(divisor)
    shape = (*a.shape[:dim], a.shape[dim] // p, *a.shape[dim + 1:-1], b.shape[1])
    return out.to(a.dtype).view(shape)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _b_grad(x: torch.Tensor, dy: torch.Tensor, like_t: bool, dtype) -> torch.Tensor:
    """``x.T @ dy`` (``b``'s gradient), laid out as ``b`` is: where ``b`` is a transposed view (a
    layer's ``weight.t()``), as the transpose of a contiguous ``dy.T @ x``, so that the weight's
    gradient arrives contiguous (accumulating a strided one costs more than the matmul's
    communication saves: measured 3.7 ms per 16 MiB add here)."""
    if like_t:
        return (_flat(dy).t() @ _flat(x)).to(dtype).t()
    return (_flat(x).t() @ _flat(dy)).to(dtype)


def _transposed(b: torch.Tensor) -> bool:
    return b.dim() == 2 and b.stride(0) == 1 and b.stride(1) != 1


class AllGatherMatmul(torch.autograd.Function):
    """Forward: (gathered a, gathered a @ b). Backward: ``d a_shard`` = reduce-scatter of
    ``d c @ b.T + d gathered`` (one ring, :func:`ring.matmul_scatter` with the addend),
    ``d b = gathered.T @ d c`` (local)."""

    @staticmethod
    def forward(ctx, a_shard, b, group, dim, chunks):
        gathered, c = _run_gather(group, a_shard, b, dim, chunks)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(gathered if ctx.needs_input_grad[1] else None, b)
        ctx.args = (group, dim, chunks, tuple(a_shard.shape), _transposed(b))
        return gathered, c

    @staticmethod
    @once_differentiable
    def backward(ctx, d_gathered, d_c):
        gathered, b = ctx.saved_tensors
        group, dim, chunks, shard_shape, b_t = ctx.args
        need_a, need_b = ctx.needs_input_grad[:2]
        if d_c is None:  # only the gathered copy was used: its gradient alone is reduce-scattered
            shape = (*shard_shape[:dim], shard_shape[dim] * group.size, *shard_shape[dim + 1:-1],
                     b.shape[1])
            d_c = b.new_zeros(shape)
        da = db = None
        if need_a:
            da = _run_scatter(group, d_c, b.t(), dim, ReduceOp.SUM, chunks, d_gathered)
        if need_b:
            db = _b_grad(gathered, d_c, b_t, b.dtype)
        return da, db, None, None, None


class MatmulReduceScatter(torch.autograd.Function):
    """Forward: this rank's block of ``reduce_scatter(a @ b)``. Backward: ``(gathered d c,
    d a) = all_gather_matmul(d c_shard, b.T)`` (one ring), ``d b = a.T @ gathered d c``
    (local); AVG divides ``d c_shard`` by the group size first."""

    @staticmethod
    def forward(ctx, a, b, group, dim, op, chunks):
        out = _run_scatter(group, a, b, dim, op, chunks)
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None,
                              b if ctx.needs_input_grad[0] else None)
        ctx.args = (group, dim, op, chunks, tuple(b.shape), _transposed(b))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        a, b = ctx.saved_tensors
        group, dim, op, chunks, b_shape, b_t = ctx.args
        need_a, need_b = ctx.needs_input_grad[:2]
        divisor = OPS[op](group.size)
        if divisor != 1:
            d_out = d_out / divisor
        bt = b.t() if need_a else None
        d_c, da = _run_gather(group, d_out, bt, dim, chunks, (b_shape[1], b_shape[0]))
        db = _b_grad(a, d_c, b_t, a.dtype) if need_b else None
        return da, db, None, None, None, None


# ----- public entries ----------------------------------------------------------------------------
def all_gather_matmul(a_shard, b, *, group=None, gather_dim: int = 0, chunks: int | None = None):
    """``all_gather(a_shard)`` along ``gather_dim`` and its product with ``b``, the gather hidden
    behind the matmul (the all-gather-then-matmul of a column-parallel layer whose input is
    sharded, as PyTorch's async tensor parallelism and XLA's windowed einsum do it).

    Args:
        a_shard: this rank's shard, ``(..., k)``, the same shape on every rank.
        b: this rank's matrix, ``(k, n)``, of ``a_shard``'s dtype and device.
        group: the group (default: the world).
        gather_dim: the dim of ``a_shard`` the shards are concatenated along, in group rank
            order: any but the last (negative counts from the end).
        chunks: pieces each shard travels in (default: the cost model's choice, see
            :func:`explain`); the same on every rank.

    Returns:
        ``(a_gathered, a_gathered @ b)``; differentiable in ``a_shard`` and ``b`` (the backward
        reduce-scatters ``d c @ b.T + d a_gathered`` with the same overlap).

    Example (2 ranks, gather_dim 0)::

        a_shard = torch.full((1, 2), float(rank + 1))   # rank 0: [[1, 1]]; rank 1: [[2, 2]]
        b = torch.eye(2) * (rank + 1)
        a, c = all_gather_matmul(a_shard, b)
        # every rank: a = [[1, 1], [2, 2]]
        # rank 0: c = [[1, 1], [2, 2]]; rank 1: c = [[2, 2], [4, 4]]
    """
    fn = "overlap.all_gather_matmul"
    with checked_call(fn, group) as (g, call):
        a_shard = _tensor(fn, "a_shard", a_shard, "this rank's shard, shaped (..., k)")
        b = _tensor(fn, "b", b, "this rank's (k, n) matrix")
        _pair(fn, "a_shard", a_shard, b)
        d = _dims(fn, "all_gather_matmul", "a_shard", tuple(a_shard.shape),
                  f"<tensor shape={tuple(a_shard.shape)}>", tuple(b.shape),
                  f"<tensor shape={tuple(b.shape)}>", "gather_dim", gather_dim, g.size)
        chunks = _chunks(fn, chunks, _rows("all_gather_matmul", a_shard.shape, g.size))
        call.update(a_shard=tuple(a_shard.shape), b=tuple(b.shape), dtype=dtype_name(a_shard.dtype),
                    gather_dim=d, chunks=chunks)
    return AllGatherMatmul.apply(a_shard, b, g, d, chunks)


def matmul_reduce_scatter(a, b, *, group=None, scatter_dim: int = 0, op=ReduceOp.SUM,
                          chunks: int | None = None):
    """``reduce_scatter(a @ b)`` along ``scatter_dim``: rank r gets block r, summed over the
    group's ranks, the reduction hidden behind the matmul (the matmul-then-reduce-scatter of a
    row-parallel layer whose output is sharded).

    Args:
        a: this rank's ``(..., k)``, the same shape on every rank; its length along
            ``scatter_dim`` must divide by the group size.
        b: this rank's ``(k, n)``, of ``a``'s dtype and device.
        group: the group (default: the world).
        scatter_dim: the dim of the product split into the group's blocks: any but the last.
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG`` (others raise ``CommUnsupportedError``).
        chunks: pieces each accumulator travels in (default: the cost model's choice).

    Returns:
        this rank's block of the reduced product, ``a``'s shape with ``scatter_dim`` divided by
        the group size and the last dim ``n``; differentiable in ``a`` and ``b`` (the backward is
        an :func:`all_gather_matmul` of the gradient with ``b.T``).

    Example (2 ranks)::

        a = torch.ones(2, 2) * (rank + 1); b = torch.eye(2)
        c = matmul_reduce_scatter(a, b)
        # a @ b summed over ranks is 3 everywhere: rank 0 gets row 0 [[3, 3]], rank 1 row 1
    """
    fn = "overlap.matmul_reduce_scatter"
    with checked_call(fn, group) as (g, call):
        a = _tensor(fn, "a", a, "this rank's (..., k) tensor")
        b = _tensor(fn, "b", b, "this rank's (k, n) matrix")
        _pair(fn, "a", a, b)
        d = _dims(fn, "matmul_reduce_scatter", "a", tuple(a.shape),
                  f"<tensor shape={tuple(a.shape)}>", tuple(b.shape),
                  f"<tensor shape={tuple(b.shape)}>", "scatter_dim", scatter_dim, g.size)
        rop = _op(fn, op)
        chunks = _chunks(fn, chunks, _rows("matmul_reduce_scatter", a.shape, g.size))
        call.update(a=tuple(a.shape), b=tuple(b.shape), dtype=dtype_name(a.dtype), scatter_dim=d,
                    op=rop.name, chunks=chunks)
    return MatmulReduceScatter.apply(a, b, g, d, rop, chunks)
