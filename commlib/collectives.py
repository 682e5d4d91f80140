"""The drop-in collectives: torch.distributed's signatures and in-place semantics.

Each public function checks its arguments (raising a ``CommError`` subclass whose message names the
function, argument, value, rule and fix), optionally checks that all ranks agree (debug mode), picks
an algorithm, and runs it through the progress loop in :mod:`commlib._progress`.

How data reaches the algorithms:

* NumPy and CuPy arrays are viewed as torch tensors (no copy); results land in the caller's memory.
* Non-contiguous tensors work on every backend: the data is gathered into a contiguous buffer and
  results are copied back into the caller's tensor (one extra copy each way).
* Reductions of float16/bfloat16 accumulate in float32 unless the engine reduces them natively
  (NCCL); bool reduces as uint8 with SUM/MAX as OR and PRODUCT/MIN as AND.
* AVG is a SUM divided once by the group size, on floating dtypes only.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch

from . import debug as _debug
from ._plans import PLANS as _PLANS
from ._plans import planned_pair, remember, remember_pair
from ._progress import _ABANDONED, Work, completed_work, drive, start, unusable
from ._tensors import as_tensor, overlaps, work_view
from .algorithms import Ctx
from .errors import CommArgumentError, CommError, CommTypeError, arg_error
from .group import Group, resolve_group
from .kernels import finish_avg_
from .ops import ReduceOp, accumulation_dtype, dtype_name, resolve_op, to_reduce_op
from .tuning import select

__all__ = [
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "P2POp", "barrier",
]

_TAG_SPACE = 1 << 14  # algorithm tags cycle through [0, 2**14): below every MPI's MPI_TAG_UB
_USER_TAG_MAX = 32767  # the smallest MPI_TAG_UB the MPI standard allows


# ----- shared checks -----------------------------------------------------------------------
def _fail(group: Group, fn: str, exc: CommError) -> None:
    """In debug mode, a rank whose own checks failed tells the others before raising, so every
    rank raises instead of the others waiting."""
    if group.debug:
        _debug.agree(group, fn, "", error=exc)


def _agree(group: Group, fn: str, algo, **fields) -> None:
    # The algorithm is part of the call: ranks running different ones (algorithm=, COMMLIB_ALGO)
    # would exchange mismatched messages.
    fields["algorithm"] = algo.__module__.rsplit(".", 1)[-1]
    text = ", ".join(f"{k}={v}" for k, v in fields.items())
    _debug.agree(group, fn, f"{fn}({text})")


_OP_CACHE: dict = {}


def _op(fn: str, op, dtype: torch.dtype) -> ReduceOp:
    try:
        return _OP_CACHE[op, dtype]
    except (KeyError, TypeError):
        pass
    rop = to_reduce_op(op)
    if rop is None:
        raise arg_error(fn, "op", op, "is not a reduction operator",
                        "pass commlib.ReduceOp.SUM/AVG/PRODUCT/MIN/MAX/BAND/BOR/BXOR", CommTypeError)
    applied = resolve_op(rop, dtype)
    if applied is None:
        if rop is ReduceOp.AVG:
            rule, fix = f"AVG is defined on floating dtypes, not {dtype_name(dtype)}", \
                "reduce with SUM and divide, or convert to a floating dtype"
        else:
            rule, fix = f"{rop.name} is a bitwise op and {dtype_name(dtype)} is floating", \
                "use SUM/MIN/MAX/PRODUCT, or an integer dtype"
        raise arg_error(fn, "op", rop, rule, fix)
    try:
        _OP_CACHE[op, dtype] = applied
    except TypeError:
        pass
    return applied


def _root(fn: str, group: Group, arg: str, global_root, group_root) -> int:
    if group_root is not None:
        if global_root is not None:
            raise arg_error(fn, arg, global_root, f"given together with group_{arg}",
                            f"pass only one of {arg} (world rank) and group_{arg} (group rank)")
        if not isinstance(group_root, int) or not 0 <= group_root < group.size:
            raise arg_error(fn, f"group_{arg}", group_root,
                            f"must be a rank of group {group.name!r} (0..{group.size - 1})",
                            "pass a rank within the group")
        return group_root
    if global_root is None:
        return 0  # default: the group's first rank
    if not isinstance(global_root, int) or group.group_rank(global_root) < 0:
        raise arg_error(fn, arg, global_root,
                        f"must be a world rank in group {group.name!r} (world ranks "
                        f"{list(group.ranks)})",
                        f"pass one of those, or group_{arg}= for a rank within the group")
    return group.group_rank(global_root)


def _same(fn: str, arg: str, t: torch.Tensor, ref: torch.Tensor, ref_arg: str) -> None:
    if t.dtype != ref.dtype:
        raise arg_error(fn, arg, f"<tensor dtype={dtype_name(t.dtype)}>",
                        f"must have the dtype of '{ref_arg}' ({dtype_name(ref.dtype)})",
                        "convert one of them", CommTypeError)
    if t.device != ref.device:
        raise arg_error(fn, arg, f"<tensor device={t.device}>",
                        f"must be on the device of '{ref_arg}' ({ref.device})",
                        "move one of them")


def _ctx(group: Group, op: ReduceOp | None, blocking: bool = False, _new=tuple.__new__) -> Ctx:
    return _new(Ctx, (group.backend, group.rank, group.size, group.seq % _TAG_SPACE, op,
                      blocking))


def _reduce_view(flat: torch.Tensor, group: Group) -> torch.Tensor:
    """The buffer a reduction runs on: bool as uint8, half precision upcast when the engine
    cannot accumulate it (a copy), everything else ``flat`` itself."""
    dtype = flat.dtype
    if dtype is torch.bool:
        return flat.view(torch.uint8)
    if dtype in group.backend.native_reduce_dtypes:
        return flat
    acc = accumulation_dtype(dtype)
    return flat if acc is dtype else flat.to(acc)


def _natively(algo, group: Group, t: torch.Tensor) -> bool:
    """The algorithm reduces ``t``'s dtype and AVG itself on this group (``reduces_natively``,
    e.g. the shared-memory ones), so the API layer neither upcasts nor divides."""
    natively = getattr(algo, "reduces_natively", None)
    return natively is not None and natively(group.backend, t)


# ----- reductions in place: all_reduce, reduce ---------------------------------------------
# Each executor below prepares the buffers, creates the algorithm's generator and returns it with
# a ``finish`` callable (or None when there is nothing left to do: the common, latency-bound case)
# that runs after the last step: AVG division, copy back from an upcast or contiguous copy.
def _as_reducible(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.uint8) if flat.dtype is torch.bool else flat


def _reduce_in_place(group, algo, t, op, root, blocking):
    ctx = _ctx(group, op, blocking)
    if root is None and _natively(algo, group, t):
        # The algorithm reduces every dtype itself (float32 accumulation of half precision, AVG
        # divided before the one rounding): no upcast copy, no division here.
        flat, copied = work_view(t, "all_reduce")
        gen = algo(ctx, _as_reducible(flat))
        return gen, ((lambda: t.copy_(flat)) if copied else None), (t, flat)
    if op is not ReduceOp.AVG and t.dtype in group.backend.native_reduce_dtypes \
            and t.is_contiguous():  # the common case: the engine works on t itself
        return (algo(ctx, t) if root is None else algo(ctx, t, root)), None, t
    flat, copied = work_view(t, "all_reduce" if root is None else "reduce")
    buf = _reduce_view(flat, group)
    gen = algo(ctx, buf) if root is None else algo(ctx, buf, root)
    upcast = buf.dtype is not flat.dtype and flat.dtype is not torch.bool
    if (root is not None and group.rank != root) or not (copied or upcast or op is ReduceOp.AVG):
        return gen, None, (t, buf)  # non-root tensors of reduce are left as they were

    def finish():
        if op is ReduceOp.AVG:
            finish_avg_(buf, group.size)
        if upcast:
            flat.copy_(buf)
        if copied:
            t.copy_(flat)

    return gen, finish, (t, buf)


def _run_plan(g: Group, post, tensor, what: str = "all_reduce") -> None:
    """Run a planned call (commlib/_plans.py): the engine's blocking call under the watchdog, or
    its non-blocking call through the poll loop (``COMMLIB_TIMEOUT_MODE=raise``)."""
    if g.broken is not None:
        unusable(g, what)
    if not g.blocking:
        try:
            return drive(None, [post()], g, what, g.seq, g.timeout)
        except BaseException:
            # Timed out: the engine may still write into the tensor (the plan's view of its
            # memory does not own it), so it must outlive the request.
            _ABANDONED.append(tensor)
            raise
    backend = g.backend
    backend.inflight = what  # what the watchdog sees (commlib/_watchdog.py)
    try:
        post()
    finally:
        backend.inflight = None
    return None


def _plan_pair(fn: str, g: Group, algo, out, inp, output, input, rop, op, group, algorithm,
               async_op: bool):
    """Store and run a plan for a blocking ``reduce_scatter_tensor``/``all_gather_into_tensor``
    (``rop`` None) whose algorithm has one, on plain contiguous non-overlapping torch tensors the
    algorithm moves or reduces itself; else None (the general path runs)."""
    prepare = getattr(algo, "prepare", None)
    if prepare is None or async_op or g.debug or out is not output or inp is not input \
            or rop is ReduceOp.AVG or not (out.is_contiguous() and inp.is_contiguous()) \
            or overlaps(inp.reshape(-1), out.reshape(-1)):
        return None
    if rop is not None and not (out.dtype in g.backend.native_reduce_dtypes
                                or (out.dtype is not torch.bool and _natively(algo, g, out))):
        return None
    post = prepare(g.backend, out, inp, rop, g.blocking)
    if post is None:
        return None
    remember_pair(fn, output, input, op, group, algorithm, g, post)
    return post


def _repeat(fn: str, out, inp, op, group, algorithm) -> bool:
    """Run the stored plan of this exact blocking call (a repeated call: see commlib/_plans.py);
    False when there is none."""
    hit = planned_pair(fn, out, inp, op, group, algorithm)
    if hit is None:
        return False
    g, post = hit
    g.seq += 1
    _run_plan(g, post, (out, inp), fn)
    return True


def all_reduce(tensor, op=ReduceOp.SUM, group: Group | None = None, async_op: bool = False, *,
               algorithm: str | None = None):
    """Reduce ``tensor`` across the group; every rank gets the result in place.

    Example (3 ranks, ``t = torch.full((2,), rank + 1.0)``): after ``all_reduce(t)`` every rank
    holds ``[6., 6.]``.
    """
    plan = _PLANS.get(id(tensor))
    if plan is not None and not async_op and plan[0]() is tensor and plan[1] is op \
            and plan[2] is group and plan[3] is algorithm and tensor.data_ptr() == plan[4] \
            and tensor.numel() == plan[5] and tensor.is_contiguous():
        g = plan[6]  # a repeated call: see commlib/_plans.py
        g.seq += 1
        return _run_plan(g, plan[7], tensor)
    g = resolve_group(group, "all_reduce")
    try:
        t = as_tensor(tensor, "all_reduce", "tensor", writable=True)
        rop = _op("all_reduce", op, t.dtype)
        algo = select("all_reduce", t.nbytes, g, algorithm, "all_reduce", t.dtype)
    except CommError as exc:
        _fail(g, "all_reduce", exc)
        raise
    if g.debug:
        _agree(g, "all_reduce", algo, shape=tuple(t.shape), dtype=dtype_name(t.dtype), op=rop.name)
    g.seq += 1
    if t.numel() == 0:
        return completed_work() if async_op else None
    prepare = getattr(algo, "prepare", None)
    if prepare is not None and not async_op and not g.debug and t is tensor \
            and rop is not ReduceOp.AVG and t.is_contiguous() \
            and (t.dtype in g.backend.native_reduce_dtypes
                 or (t.dtype is not torch.bool and _natively(algo, g, t))):
        post = prepare(g.backend, t, t, rop, g.blocking)
        if post is not None:
            remember(tensor, op, group, algorithm, g, post)
            return _run_plan(g, post, tensor)
    blocking = g.blocking and not async_op
    return start(*_reduce_in_place(g, algo, t, rop, None, blocking), g, "all_reduce", g.seq, async_op)


def reduce(tensor, dst: int | None = None, op=ReduceOp.SUM, group: Group | None = None,
           async_op: bool = False, *, group_dst: int | None = None, algorithm: str | None = None):
    """Reduce ``tensor`` across the group into rank ``dst`` (a world rank; or ``group_dst``, a
    rank of the group). Other ranks' tensors are left unchanged."""
    g = resolve_group(group, "reduce")
    try:
        t = as_tensor(tensor, "reduce", "tensor", writable=True)
        rop = _op("reduce", op, t.dtype)
        root = _root("reduce", g, "dst", dst, group_dst)
        algo = select("reduce", t.nbytes, g, algorithm, "reduce", t.dtype)
    except CommError as exc:
        _fail(g, "reduce", exc)
        raise
    if g.debug:
        _agree(g, "reduce", algo, shape=tuple(t.shape), dtype=dtype_name(t.dtype), op=rop.name,
               root=root)
    g.seq += 1
    if t.numel() == 0:
        return completed_work() if async_op else None
    return start(*_reduce_in_place(g, algo, t, rop, root, g.blocking and not async_op), g, "reduce", g.seq, async_op)


# ----- broadcast ---------------------------------------------------------------------------
def _broadcast(group, algo, t, root, blocking):
    flat, copied = work_view(t, "broadcast")
    gen = algo(_ctx(group, None, blocking), flat, root)
    if copied and group.rank != root:
        return gen, (lambda: t.copy_(flat)), (t, flat)
    return gen, None, (t, flat)


def broadcast(tensor, src: int | None = None, group: Group | None = None, async_op: bool = False,
              *, group_src: int | None = None, algorithm: str | None = None):
    """Copy ``tensor`` from rank ``src`` (world rank; or ``group_src``) to every rank, in place."""
    g = resolve_group(group, "broadcast")
    try:
        t = as_tensor(tensor, "broadcast", "tensor", writable=True)
        root = _root("broadcast", g, "src", src, group_src)
        algo = select("broadcast", t.nbytes, g, algorithm, "broadcast")
    except CommError as exc:
        _fail(g, "broadcast", exc)
        raise
    if g.debug:
        _agree(g, "broadcast", algo, shape=tuple(t.shape), dtype=dtype_name(t.dtype), root=root)
    g.seq += 1
    if t.numel() == 0:
        return completed_work() if async_op else None
    return start(*_broadcast(g, algo, t, root, g.blocking and not async_op), g, "broadcast", g.seq, async_op)


# ----- all-gather --------------------------------------------------------------------------
def _prepare_gather_input(inp: torch.Tensor, out: torch.Tensor, rank: int = -1) -> torch.Tensor:
    """``inp`` flat, cloned where it overlaps ``out``, except when it is exactly block ``rank`` of
    ``out`` (``rank`` >= 0: the algorithm gathers in place)."""
    flat = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
    if not overlaps(flat, out):
        return flat
    if rank >= 0 and flat.data_ptr() == out.data_ptr() + rank * flat.numel() * flat.element_size():
        return flat
    return flat.clone()


def all_gather_into_tensor(output_tensor, input_tensor, group: Group | None = None,
                           async_op: bool = False, *, algorithm: str | None = None):
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` in rank order.

    ``output_tensor`` holds ``group size`` times the elements of ``input_tensor`` (any shape,
    e.g. ``(size * n, ...)`` or ``(size, n, ...)``). ``input_tensor`` may be this rank's slice of
    ``output_tensor`` (in-place all-gather).
    """
    fn = "all_gather_into_tensor"
    if not async_op and _repeat(fn, output_tensor, input_tensor, None, group, algorithm):
        return None
    g = resolve_group(group, fn)
    try:
        out = as_tensor(output_tensor, fn, "output_tensor", writable=True)
        inp = as_tensor(input_tensor, fn, "input_tensor")
        _same(fn, "input_tensor", inp, out, "output_tensor")
        if out.numel() != g.size * inp.numel():
            raise arg_error(fn, "output_tensor", f"<tensor shape={tuple(out.shape)}>",
                            f"must hold group size ({g.size}) x input elements "
                            f"({inp.numel()}) = {g.size * inp.numel()} elements",
                            f"allocate it as torch.empty(({g.size} * {tuple(inp.shape)[0] if inp.dim() else 1}, ...))")
        algo = select("all_gather", out.numel() * out.element_size(), g, algorithm, fn)
    except CommError as exc:
        _fail(g, fn, exc)
        raise
    if g.debug:
        _agree(g, fn, algo, shape=tuple(inp.shape), dtype=dtype_name(inp.dtype))
    g.seq += 1
    if out.numel() == 0:
        return completed_work() if async_op else None
    post = _plan_pair(fn, g, algo, out, inp, output_tensor, input_tensor, None, None, group,
                      algorithm, async_op)
    if post is not None:
        return _run_plan(g, post, (out, inp), fn)
    out_buf, copied = work_view(out, fn, "output_tensor")
    in_place = getattr(algo, "gathers_in_place", None)
    own = g.rank if not copied and in_place is not None and in_place(g.backend, out) else -1
    inp_flat = _prepare_gather_input(inp, out, own)
    gen = algo(_ctx(g, None, g.blocking and not async_op), out_buf, inp_flat)
    finish = (lambda: out.copy_(out_buf)) if copied else None
    return start(gen, finish, (out, out_buf, inp_flat), g, fn, g.seq, async_op)


def all_gather(tensor_list: list, tensor, group: Group | None = None, async_op: bool = False, *,
               algorithm: str | None = None):
    """Gather every rank's ``tensor`` into ``tensor_list`` (one tensor per rank, same shape)."""
    fn = "all_gather"
    g = resolve_group(group, fn)
    try:
        inp = as_tensor(tensor, fn, "tensor")
        if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != g.size:
            is_list = isinstance(tensor_list, (list, tuple))
            raise arg_error(fn, "tensor_list", f"<list of {len(tensor_list)}>" if is_list
                            else f"<{type(tensor_list).__module__}.{type(tensor_list).__qualname__}>",
                            f"must be a list of group size ({g.size}) tensors",
                            f"pass [torch.empty_like(tensor) for _ in range({g.size})]",
                            CommArgumentError if is_list else CommTypeError)
        outs = [as_tensor(o, fn, f"tensor_list[{i}]", writable=True)
                for i, o in enumerate(tensor_list)]
        for i, o in enumerate(outs):
            _same(fn, f"tensor_list[{i}]", o, inp, "tensor")
            if o.numel() != inp.numel():
                raise arg_error(fn, f"tensor_list[{i}]", f"<tensor shape={tuple(o.shape)}>",
                                f"must have as many elements as 'tensor' ({inp.numel()})",
                                "allocate each with torch.empty_like(tensor)")
        algo = select("all_gather", inp.numel() * inp.element_size() * g.size, g, algorithm, fn)
    except CommError as exc:
        _fail(g, fn, exc)
        raise
    if g.debug:
        _agree(g, fn, algo, shape=tuple(inp.shape), dtype=dtype_name(inp.dtype))
    g.seq += 1
    if inp.numel() == 0:
        return completed_work() if async_op else None
    flat = torch.empty(g.size * inp.numel(), dtype=inp.dtype, device=inp.device)
    n = inp.numel()

    def scatter_back():
        for i, o in enumerate(outs):
            o.copy_(flat[i * n:(i + 1) * n].view(o.shape))

    inp_flat = _prepare_gather_input(inp, flat)
    gen = algo(_ctx(g, None, g.blocking and not async_op), flat, inp_flat)
    return start(gen, scatter_back, (flat, inp_flat), g, fn, g.seq, async_op)


# ----- reduce-scatter ----------------------------------------------------------------------
def _reduce_scatter(group, algo, out, inp, op, blocking):
    out_flat, copied = work_view(out, "reduce_scatter_tensor", "output")
    inp_flat = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
    if _natively(algo, group, out):  # reduces every dtype itself, AVG included
        if overlaps(inp_flat, out_flat):
            inp_flat = inp_flat.clone()
        gen = algo(_ctx(group, op, blocking), _as_reducible(out_flat), _as_reducible(inp_flat))
        finish = (lambda: out.copy_(out_flat.view(out.shape))) if copied else None
        return gen, finish, (out, out_flat, inp_flat)
    inp_buf = _reduce_view(inp_flat, group)
    if inp_buf is inp_flat or inp_buf.data_ptr() == inp_flat.data_ptr():
        if overlaps(inp_flat, out_flat):
            inp_buf = inp_buf.clone()
    upcast = inp_buf.dtype is not inp_flat.dtype and inp_flat.dtype is not torch.bool
    if upcast:  # accumulate in a fresh float32 output, rounded once into the caller's
        out_buf = torch.empty(out_flat.shape, dtype=inp_buf.dtype, device=out_flat.device)
    else:
        out_buf = out_flat.view(inp_buf.dtype)  # itself, or bool viewed as uint8
    gen = algo(_ctx(group, op, blocking), out_buf, inp_buf)

    def finish():
        if op is ReduceOp.AVG:
            finish_avg_(out_buf, group.size)
        if upcast:
            out_flat.copy_(out_buf)
        if copied:
            out.copy_(out_flat.view(out.shape))

    return gen, finish, (out, out_buf, inp_buf)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group: Group | None = None,
                          async_op: bool = False, *, algorithm: str | None = None):
    """Reduce ``input`` (group size blocks of ``output.numel()`` elements) across the group; rank i
    gets block i, reduced, in ``output``."""
    fn = "reduce_scatter_tensor"
    if not async_op and _repeat(fn, output, input, op, group, algorithm):
        return None
    g = resolve_group(group, fn)
    try:
        out = as_tensor(output, fn, "output", writable=True)
        inp = as_tensor(input, fn, "input")
        _same(fn, "input", inp, out, "output")
        rop = _op(fn, op, out.dtype)
        if inp.numel() != g.size * out.numel():
            raise arg_error(fn, "input", f"<tensor shape={tuple(inp.shape)}>",
                            f"must hold group size ({g.size}) x output elements "
                            f"({out.numel()}) = {g.size * out.numel()} elements",
                            "size input as group size x output")
        algo = select("reduce_scatter", inp.numel() * inp.element_size(), g, algorithm, fn, inp.dtype)
    except CommError as exc:
        _fail(g, fn, exc)
        raise
    if g.debug:
        _agree(g, fn, algo, shape=tuple(out.shape), dtype=dtype_name(out.dtype), op=rop.name)
    g.seq += 1
    if out.numel() == 0:
        return completed_work() if async_op else None
    post = _plan_pair(fn, g, algo, out, inp, output, input, rop, op, group, algorithm, async_op)
    if post is not None:
        return _run_plan(g, post, (out, inp), fn)
    return start(*_reduce_scatter(g, algo, out, inp, rop, g.blocking and not async_op), g, fn, g.seq, async_op)


# ----- all-to-all --------------------------------------------------------------------------
def _splits(fn: str, arg: str, splits, t: torch.Tensor, size: int) -> list[int]:
    rows = t.shape[0] if t.dim() else 0
    if t.dim() == 0:
        raise arg_error(fn, arg.replace("_split_sizes", ""), "<0-d tensor>",
                        "must have a first dimension to split", "reshape it to (n, ...)")
    if splits is None or len(splits) == 0:
        if rows % size:
            raise arg_error(fn, arg, splits,
                            f"is empty, so dim 0 ({rows}) must divide by the group size ({size})",
                            f"pass {arg} explicitly, e.g. uneven sizes summing to {rows}")
        return [rows // size] * size
    try:
        splits = [int(s) for s in splits]
    except (TypeError, ValueError):
        raise arg_error(fn, arg, splits, "must be a list of ints", "pass e.g. [2, 3]") from None
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
        raise arg_error(fn, arg, splits,
                        f"must be {size} non-negative sizes summing to dim 0 ({rows})",
                        "give one size per rank of the group")
    return splits


def _all_to_all(group, algo, out, inp, out_counts, in_counts, blocking):
    out_flat, copied = work_view(out, "all_to_all_single", "output")
    inp_flat = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
    if overlaps(inp_flat, out_flat):
        inp_flat = inp_flat.clone()
    gen = algo(_ctx(group, None, blocking), out_flat, inp_flat, out_counts, in_counts)
    finish = (lambda: out.copy_(out_flat.view(out.shape))) if copied else None
    return gen, finish, (out, out_flat, inp_flat)


def all_to_all_single(output, input, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: Group | None = None,
                      async_op: bool = False, *, algorithm: str | None = None):
    """Split ``input`` along dim 0 (``input_split_sizes``, default equal), send part j to rank j,
    and concatenate what arrives into ``output`` (``output_split_sizes``) in rank order."""
    fn = "all_to_all_single"
    g = resolve_group(group, fn)
    try:
        out = as_tensor(output, fn, "output", writable=True)
        inp = as_tensor(input, fn, "input")
        _same(fn, "input", inp, out, "output")
        in_splits = _splits(fn, "input_split_sizes", input_split_sizes, inp, g.size)
        out_splits = _splits(fn, "output_split_sizes", output_split_sizes, out, g.size)
        if out.shape[1:] != inp.shape[1:]:
            raise arg_error(fn, "output", f"<tensor shape={tuple(out.shape)}>",
                            f"must match input's trailing dims {tuple(inp.shape[1:])}",
                            "allocate output as (rows, *input.shape[1:])")
        algo = select("all_to_all", inp.numel() * inp.element_size(), g, algorithm, fn)
    except CommError as exc:
        _fail(g, fn, exc)
        raise
    if g.debug:
        _agree(g, fn, algo, dtype=dtype_name(inp.dtype), row_shape=tuple(inp.shape[1:]))
    g.seq += 1
    row = math.prod(inp.shape[1:])
    in_counts = [s * row for s in in_splits]
    out_counts = [s * row for s in out_splits]
    return start(*_all_to_all(g, algo, out, inp, out_counts, in_counts,
                                g.blocking and not async_op), g, fn, g.seq, async_op)


# ----- barrier -----------------------------------------------------------------------------
def barrier(group: Group | None = None, async_op: bool = False, device_ids=None):
    """Block until every rank of the group has entered the barrier."""
    g = resolve_group(group, "barrier")
    algo = select("barrier", 0, g, None, "barrier")
    if g.debug:
        _agree(g, "barrier", algo)
    g.seq += 1
    ctx = _ctx(g, None, g.blocking and not async_op)
    return start(algo(ctx), None, None, g, "barrier", g.seq, async_op)


# ----- point-to-point ----------------------------------------------------------------------
def _peer(fn: str, group: Group, arg: str, peer, group_peer, allow_any: bool = False):
    if group_peer is None and peer is None:
        if allow_any:
            return None
        raise arg_error(fn, arg, None, "is required", f"pass {arg}=<world rank> or group_{arg}=")
    r = _root(fn, group, arg, peer, group_peer)
    return r


def _tag(fn: str, tag) -> int:
    if not isinstance(tag, int) or not 0 <= tag <= _USER_TAG_MAX:
        raise arg_error(fn, "tag", tag, f"must be an int in 0..{_USER_TAG_MAX}",
                        "use a small non-negative tag")
    return tag


def _p2p(group, what, t, peer, tag):
    flat, copied = work_view(t, None if what == "send" else "recv")
    if what == "send":
        return [group.backend.isend(flat, peer, tag, user=True)], None, (t, flat)
    handle = group.backend.irecv(flat, peer, tag, user=True)

    def finish():
        if copied:
            t.copy_(flat)
        source = peer if peer is not None else group.backend.source_of(handle)
        return group.ranks[source]

    return [handle], finish, (t, flat)


def _post_p2p(fn: str, what: str, tensor, peer, group, tag, group_peer, async_op: bool):
    g = resolve_group(group, fn)
    t = as_tensor(tensor, fn, "tensor", writable=(what == "recv"))
    arg = "dst" if what == "send" else "src"
    p = _peer(fn, g, arg, peer, group_peer, allow_any=(what == "recv"))
    tag = _tag(fn, tag)
    if not async_op and p == g.rank:  # at any group size: MPI does not buffer large messages
        raise arg_error(fn, arg, peer if peer is not None else group_peer,
                        f"is this rank itself; a blocking {what} to or from oneself never completes",
                        "use isend/irecv for messages to oneself, or another rank")
    return start(*_p2p(g, what, t, p, tag), g, fn, g.seq, async_op)


def send(tensor, dst: int | None = None, group: Group | None = None, tag: int = 0, *,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to world rank ``dst`` (or ``group_dst``); returns when it may be reused."""
    _post_p2p("send", "send", tensor, dst, group, tag, group_dst, False)


def recv(tensor, src: int | None = None, group: Group | None = None, tag: int = 0, *,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from world rank ``src`` (any rank if None); returns the sender's
    world rank."""
    return _post_p2p("recv", "recv", tensor, src, group, tag, group_src, False)


def isend(tensor, dst: int | None = None, group: Group | None = None, tag: int = 0, *,
          group_dst: int | None = None) -> Work:
    """Non-blocking :func:`send`; returns a ``Work``."""
    return _post_p2p("isend", "send", tensor, dst, group, tag, group_dst, True)


def irecv(tensor, src: int | None = None, group: Group | None = None, tag: int = 0, *,
          group_src: int | None = None) -> Work:
    """Non-blocking :func:`recv`; ``work.result()`` is the sender's world rank."""
    return _post_p2p("irecv", "recv", tensor, src, group, tag, group_src, True)


class P2POp(NamedTuple):
    """One point-to-point operation for :func:`batch_isend_irecv`: ``op`` is ``commlib.isend`` or
    ``commlib.irecv`` (``torch.distributed.isend``/``irecv`` are accepted too)."""

    op: Callable
    tensor: object
    peer: int | None = None
    group: Group | None = None
    tag: int = 0
    group_peer: int | None = None


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Post every send and receive of the list at once; returns one ``Work`` per op."""
    fn = "batch_isend_irecv"
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise arg_error(fn, "p2p_op_list", p2p_op_list, "must be a non-empty list of P2POp",
                        "pass [commlib.P2POp(commlib.isend, t, peer), ...]", CommTypeError)
    works = []
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise arg_error(fn, f"p2p_op_list[{i}]", p, "must be a commlib.P2POp",
                            "build it with commlib.P2POp(commlib.isend, tensor, peer)", CommTypeError)
        kind = getattr(p.op, "__name__", "")
        if kind not in ("isend", "irecv"):
            raise arg_error(fn, f"p2p_op_list[{i}].op", p.op, "must be isend or irecv",
                            "use commlib.isend or commlib.irecv")
        what = "send" if kind == "isend" else "recv"
        if what == "recv" and p.peer is None and p.group_peer is None:
            raise arg_error(fn, f"p2p_op_list[{i}].peer", None,
                            "a batched receive needs its peer", "give the sender's rank")
        works.append(_post_p2p(fn, what, p.tensor, p.peer, p.group, p.tag, p.group_peer, True))
    return works
