"""The drop-in collectives: torch.distributed's signatures and in-place semantics.

Each public function checks its arguments (raising a ``CommError`` subclass whose message names the
function, argument, value, rule and fix), optionally checks that all ranks agree (debug mode), picks
an algorithm (a record of :mod:`commlib.algorithms`, chosen by :mod:`commlib.tuning` over the
group's resources), and runs it through the progress loop in :mod:`commlib.runtime.progress`.
Point-to-point is in :mod:`commlib.api.p2p`, the object collectives (pickled Python objects) in
:mod:`commlib.api.objects`.

How data reaches the algorithms:

* NumPy and CuPy arrays are viewed as torch tensors (no copy); results land in the caller's memory.
* Non-contiguous tensors work on every backend: the data is gathered into a contiguous buffer and
  results are copied back into the caller's tensor (one extra copy each way).
* Reductions of float16/bfloat16 accumulate in float32 unless the engine reduces them natively
  (NCCL); bool reduces as uint8 with SUM/MAX as OR and PRODUCT/MIN as AND.
* AVG is a SUM divided once by the group size, on floating dtypes only.

The list forms of torch.distributed (``gather``, ``scatter``, ``all_to_all``, ``reduce_scatter``,
``all_reduce_coalesced``) pack their lists into one flat buffer and run the tensor form's
algorithm on it: ``gather`` and ``scatter`` are an all-to-all whose split sizes are zero except
to or from the root, so they move exactly the bytes of their definition.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Sequence

import torch

from ..algorithms import Ctx
from ..errors import CommArgumentError, CommError, CommTimeoutError, CommTypeError, arg_error
from ..kernels import finish_avg_
from ..ops import ReduceOp, accumulation_dtype, dtype_name, resolve_op, to_reduce_op
from ..runtime import debug as _debug
from ..runtime.group import Group
from ..runtime.mismatch import describe
from ..runtime.plans import PLANS as _PLANS
from ..runtime.plans import planned_pair, remember, remember_pair
from ..runtime.progress import (_ABANDONED, completed_work, drive, raise_engine_failure, start,
                                unusable)
from ..runtime.tensors import as_tensor, overlaps, work_view
from ..tuning import select
from .groups import resolve_group

__all__ = [
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier",
]

_TAG_SPACE = 1 << 14  # algorithm tags cycle through [0, 2**14): below every MPI's MPI_TAG_UB


# ----- shared checks -----------------------------------------------------------------------
def _fail(group: Group, fn: str, exc: CommError) -> None:
    """In debug mode, a rank whose own checks failed tells the others before raising, so every
    rank raises instead of the others waiting."""
    if group.debug:
        _debug.agree(group, fn, "", error=exc)


def _agree(group: Group, fn: str, algo, **fields) -> None:
    # The algorithm is part of the call: ranks running different ones (algorithm=, COMMLIB_ALGO)
    # would exchange mismatched messages.
    fields["algorithm"] = algo.name
    _debug.agree(group, fn, describe(fn, **fields))


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


def root_rank(fn: str, group: Group, arg: str, global_root, group_root) -> int:
    """The group rank given as ``arg`` (a world rank) or ``group_<arg>`` (a group rank), checked;
    default the group's first rank."""
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


def _describe(value) -> str:
    """How an argument that should be a list of tensors appears in an error message."""
    if isinstance(value, (list, tuple)):
        return f"<list of {len(value)}>"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _tensor_list(fn: str, arg: str, value, size: int, fix: str,
                 writable: bool = False) -> list[torch.Tensor]:
    """``value``, a list of one tensor per rank of the group, as torch tensors (checked)."""
    is_list = isinstance(value, (list, tuple))
    if not is_list or len(value) != size:
        raise arg_error(fn, arg, _describe(value), f"must be a list of group size ({size}) tensors",
                        fix, CommArgumentError if is_list else CommTypeError)
    return [as_tensor(t, fn, f"{arg}[{i}]", writable) for i, t in enumerate(value)]


def _root_list(fn: str, arg: str, value, group: Group, root: int, ref: torch.Tensor,
               writable: bool) -> list[torch.Tensor] | None:
    """The list argument of ``gather``/``scatter``: required on the root (group size tensors of
    ``tensor``'s shape, dtype and device), None (or empty, as torch allows) everywhere else."""
    given = value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0)
    if group.rank != root:
        if given:
            raise arg_error(fn, arg, _describe(value),
                            f"is given on group rank {group.rank}, but only the root (group rank "
                            f"{root}) takes a list", f"pass {arg}=None on every other rank")
        return None
    fix = f"pass [torch.empty_like(tensor) for _ in range({group.size})] on the root"
    if not given:
        raise arg_error(fn, arg, value, f"is required on the root (group rank {root}, this rank)",
                        fix)
    tensors = _tensor_list(fn, arg, value, group.size, fix, writable)
    for i, t in enumerate(tensors):
        _same(fn, f"{arg}[{i}]", t, ref, "tensor")
        if t.shape != ref.shape:
            raise arg_error(fn, f"{arg}[{i}]", f"<tensor shape={tuple(t.shape)}>",
                            f"must have the shape of 'tensor' {tuple(ref.shape)}",
                            "allocate each entry with torch.empty_like(tensor)")
    return tensors


def _flat_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, concatenated into one new flat buffer (a copy)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _copy_out(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outs`` (the inverse of :func:`_flat_cat`)."""
    offset = 0
    for o in outs:
        n = o.numel()
        o.copy_(flat[offset:offset + n].view(o.shape))
        offset += n


def _ctx(group: Group, what: str, op: ReduceOp | None, blocking: bool = False,
         _new=tuple.__new__) -> Ctx:
    """The algorithm's context for this call; raises first on a group that cannot run operations
    any more (every collective makes one before anything is posted: algorithms that finish in one
    step act when called, before the progress loop)."""
    if group.broken is not None:
        unusable(group, what)
    return _new(Ctx, (group.backend, group.rank, group.size, group.seq % _TAG_SPACE, op,
                      blocking, group.resources))


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
    """The algorithm reduces ``t``'s dtype and AVG itself on this group (its record's
    ``reduces_natively``, e.g. the shared-memory ones), so the API layer neither upcasts nor
    divides."""
    natively = algo.reduces_natively
    return natively is not None and natively(group.resources, t)


# ----- reductions in place: all_reduce, reduce ---------------------------------------------
# Each executor below prepares the buffers, creates the algorithm's generator and returns it with
# a ``finish`` callable (or None when there is nothing left to do: the common, latency-bound case)
# that runs after the last step: AVG division, copy back from an upcast or contiguous copy.
def _as_reducible(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.uint8) if flat.dtype is torch.bool else flat


def _reduce_in_place(group, algo, t, op, root, blocking):
    ctx = _ctx(group, "all_reduce" if root is None else "reduce", op, blocking)
    run = algo.run
    if root is None and _natively(algo, group, t):
        # The algorithm reduces every dtype itself (float32 accumulation of half precision, AVG
        # divided before the one rounding): no upcast copy, no division here.
        flat, copied = work_view(t, "all_reduce")
        gen = run(ctx, _as_reducible(flat))
        return gen, ((lambda: t.copy_(flat)) if copied else None), (t, flat)
    if op is not ReduceOp.AVG and t.dtype in group.backend.native_reduce_dtypes \
            and t.is_contiguous():  # the common case: the engine works on t itself
        return (run(ctx, t) if root is None else run(ctx, t, root)), None, t
    flat, copied = work_view(t, "all_reduce" if root is None else "reduce")
    buf = _reduce_view(flat, group)
    gen = run(ctx, buf) if root is None else run(ctx, buf, root)
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
    """Run a planned call (commlib/runtime/plans.py): the engine's blocking call under the
    watchdog, or its non-blocking call through the poll loop (``COMMLIB_TIMEOUT_MODE=raise``)."""
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
    res = g.resources
    res.inflight = what  # what the watchdog sees (commlib/runtime/watchdog.py)
    try:
        post()
    except RuntimeError as exc:  # the engine's error, as the CommBackendError of the operation
        raise_engine_failure(exc, g, what, g.seq)
    finally:
        res.inflight = None
    return None


def _plan_pair(fn: str, g: Group, algo, out, inp, output, input, rop, op, group, algorithm,
               async_op: bool):
    """Store and run a plan for a blocking ``reduce_scatter_tensor``/``all_gather_into_tensor``
    (``rop`` None) whose algorithm has one, on plain contiguous non-overlapping torch tensors the
    algorithm moves or reduces itself; else None (the general path runs)."""
    prepare = algo.prepare
    if prepare is None or async_op or g.debug or out is not output or inp is not input \
            or rop is ReduceOp.AVG or not (out.is_contiguous() and inp.is_contiguous()) \
            or overlaps(inp.reshape(-1), out.reshape(-1)):
        return None
    if rop is not None and not (out.dtype in g.backend.native_reduce_dtypes
                                or (out.dtype is not torch.bool and _natively(algo, g, out))):
        return None
    post = prepare(g.resources, out, inp, rop, g.blocking)
    if post is None:
        return None
    remember_pair(fn, output, input, op, group, algorithm, g, post)
    return post


def _repeat(fn: str, out, inp, op, group, algorithm) -> bool:
    """Run the stored plan of this exact blocking call (a repeated call: see commlib/runtime/plans.py);
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
        g = plan[6]  # a repeated call: see commlib/runtime/plans.py
        if g.on_all_reduce is not None:
            g.on_all_reduce(g, tensor.nbytes)
        g.seq += 1
        return _run_plan(g, plan[7], tensor)
    g = resolve_group(group, "all_reduce")
    if g.on_all_reduce is not None:  # before the choice: it may change the model
        g.on_all_reduce(g, getattr(tensor, "nbytes", 0))
    try:
        t = as_tensor(tensor, "all_reduce", "tensor", writable=True)
        rop = _op("all_reduce", op, t.dtype)
        algo = select("all_reduce", t.nbytes, g, algorithm, "all_reduce", t.dtype, t.device.type, rop)
    except CommError as exc:
        _fail(g, "all_reduce", exc)
        raise
    if g.debug:
        _agree(g, "all_reduce", algo, shape=tuple(t.shape), dtype=dtype_name(t.dtype), op=rop.name)
    g.seq += 1
    if t.numel() == 0:
        return completed_work() if async_op else None
    prepare = algo.prepare
    if prepare is not None and not async_op and not g.debug and t is tensor \
            and rop is not ReduceOp.AVG and t.is_contiguous() \
            and (t.dtype in g.backend.native_reduce_dtypes
                 or (t.dtype is not torch.bool and _natively(algo, g, t))):
        post = prepare(g.resources, t, t, rop, g.blocking)
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
        root = root_rank("reduce", g, "dst", dst, group_dst)
        algo = select("reduce", t.nbytes, g, algorithm, "reduce", t.dtype, t.device.type, rop)
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


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group: Group | None = None,
                         async_op: bool = False, *, algorithm: str | None = None):
    """Reduce every tensor of ``tensors`` across the group, in place, as one all-reduce.

    The tensors (one dtype, one device; any shapes; a single tensor is accepted too) are
    concatenated into one flat buffer, reduced with one ``all_reduce`` (the algorithm chosen for
    the total size), and the results are copied back into each tensor. Every rank passes the
    same shapes, in the same order.

    Example (3 ranks): ``a = torch.full((2,), rank + 1.0); b = torch.tensor([float(rank)])``;
    after ``all_reduce_coalesced([a, b])`` every rank holds ``a == [6., 6.]`` and ``b == [3.]``.
    """
    fn = "all_reduce_coalesced"
    g = resolve_group(group, fn)
    try:
        if isinstance(tensors, (list, tuple)):
            if not tensors:
                raise arg_error(fn, "tensors", tensors, "must hold at least one tensor",
                                "pass the tensors to reduce, e.g. [p.grad for p in params]")
            ts = [as_tensor(t, fn, f"tensors[{i}]", writable=True) for i, t in enumerate(tensors)]
        else:
            ts = [as_tensor(tensors, fn, "tensors", writable=True)]
        for i, t in enumerate(ts[1:], 1):
            if t.dtype != ts[0].dtype:
                raise arg_error(fn, f"tensors[{i}]", f"<tensor dtype={dtype_name(t.dtype)}>",
                                f"must have the dtype of tensors[0] ({dtype_name(ts[0].dtype)}): "
                                f"they are reduced as one buffer",
                                "make one call per dtype, or convert them", CommTypeError)
            _same(fn, f"tensors[{i}]", t, ts[0], "tensors[0]")
        rop = _op(fn, op, ts[0].dtype)
        total = sum(t.numel() for t in ts)
        algo = select("all_reduce", total * ts[0].element_size(), g, algorithm, fn, ts[0].dtype,
                      ts[0].device.type, rop)
    except CommError as exc:
        _fail(g, fn, exc)
        raise
    if g.debug:
        _agree(g, fn, algo, shapes=[tuple(t.shape) for t in ts], dtype=dtype_name(ts[0].dtype),
               op=rop.name)
    g.seq += 1
    if total == 0:
        return completed_work() if async_op else None
    flat = _flat_cat(ts)
    gen, finish, keep = _reduce_in_place(g, algo, flat, rop, None, g.blocking and not async_op)

    def copy_back():
        if finish is not None:
            finish()
        _copy_out(flat, ts)

    return start(gen, copy_back, (keep, ts), g, fn, g.seq, async_op)


# ----- broadcast ---------------------------------------------------------------------------
def _broadcast(group, algo, t, root, blocking):
    flat, copied = work_view(t, "broadcast")
    gen = algo.run(_ctx(group, "broadcast", None, blocking), flat, root)
    if copied and group.rank != root:
        return gen, (lambda: t.copy_(flat)), (t, flat)
    return gen, None, (t, flat)


def broadcast(tensor, src: int | None = None, group: Group | None = None, async_op: bool = False,
              *, group_src: int | None = None, algorithm: str | None = None):
    """Copy ``tensor`` from rank ``src`` (world rank; or ``group_src``) to every rank, in place."""
    g = resolve_group(group, "broadcast")
    try:
        t = as_tensor(tensor, "broadcast", "tensor", writable=True)
        root = root_rank("broadcast", g, "src", src, group_src)
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


def all_gather_single(output_tensor, input_tensor, group: Group | None = None,
                      async_op: bool = False, *, algorithm: str | None = None):
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` in rank order.

    ``output_tensor`` holds ``group size`` times the elements of ``input_tensor`` (any shape,
    e.g. ``(size * n, ...)`` or ``(size, n, ...)``). ``input_tensor`` may be this rank's slice of
    ``output_tensor`` (in-place all-gather). torch 2.13's name for ``all_gather_into_tensor``:
    the two are one implementation.

    Example (3 ranks): ``out = torch.empty(3, 2)``; after
    ``all_gather_single(out, torch.full((2,), float(rank)))`` every rank holds
    ``[[0., 0.], [1., 1.], [2., 2.]]``.
    """
    if not async_op and _repeat("all_gather_single", output_tensor, input_tensor, None, group,
                                algorithm):
        return None
    return _all_gather_single("all_gather_single", output_tensor, input_tensor, group, async_op,
                              algorithm)


def all_gather_into_tensor(output_tensor, input_tensor, group: Group | None = None,
                           async_op: bool = False, *, algorithm: str | None = None):
    """:func:`all_gather_single` under its name before torch 2.13 (kept, without a warning)."""
    if not async_op and _repeat("all_gather_into_tensor", output_tensor, input_tensor, None, group,
                                algorithm):
        return None
    return _all_gather_single("all_gather_into_tensor", output_tensor, input_tensor, group,
                              async_op, algorithm)


def _all_gather_single(fn: str, output_tensor, input_tensor, group, async_op: bool, algorithm):
    """The one implementation of both names (``fn``: the name the caller used, for its errors and
    its plan); a repeated call has been tried already."""
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
    in_place = algo.gathers_in_place
    own = g.rank if not copied and in_place is not None and in_place(g.resources, out) else -1
    inp_flat = _prepare_gather_input(inp, out, own)
    gen = algo.run(_ctx(g, fn, None, g.blocking and not async_op), out_buf, inp_flat)
    finish = (lambda: out.copy_(out_buf)) if copied else None
    return start(gen, finish, (out, out_buf, inp_flat), g, fn, g.seq, async_op)


def all_gather(tensor_list: list, tensor, group: Group | None = None, async_op: bool = False, *,
               algorithm: str | None = None):
    """Gather every rank's ``tensor`` into ``tensor_list`` (one tensor per rank, same shape)."""
    fn = "all_gather"
    g = resolve_group(group, fn)
    try:
        inp = as_tensor(tensor, fn, "tensor")
        outs = _tensor_list(fn, "tensor_list", tensor_list, g.size,
                            f"pass [torch.empty_like(tensor) for _ in range({g.size})]", True)
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
    inp_flat = _prepare_gather_input(inp, flat)
    gen = algo.run(_ctx(g, fn, None, g.blocking and not async_op), flat, inp_flat)
    return start(gen, lambda: _copy_out(flat, outs), (flat, inp_flat), g, fn, g.seq, async_op)


# ----- reduce-scatter ----------------------------------------------------------------------
def _reduce_scatter(group, algo, out, inp, op, blocking, fn="reduce_scatter_tensor"):
    out_flat, copied = work_view(out, fn, "output")
    inp_flat = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
    if _natively(algo, group, out):  # reduces every dtype itself, AVG included
        if overlaps(inp_flat, out_flat):
            inp_flat = inp_flat.clone()
        gen = algo.run(_ctx(group, fn, op, blocking), _as_reducible(out_flat),
                       _as_reducible(inp_flat))
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
    gen = algo.run(_ctx(group, fn, op, blocking), out_buf, inp_buf)

    def finish():
        if op is ReduceOp.AVG:
            finish_avg_(out_buf, group.size)
        if upcast:
            out_flat.copy_(out_buf)
        if copied:
            out.copy_(out_flat.view(out.shape))

    return gen, finish, (out, out_buf, inp_buf)


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group: Group | None = None,
                          async_op: bool = False, *, algorithm: str | None = None):
    """Reduce ``input`` (group size blocks of ``output.numel()`` elements) across the group; rank i
    gets block i, reduced, in ``output``. torch 2.13's name for ``reduce_scatter_tensor``: the two
    are one implementation.

    Example (3 ranks): ``inp = torch.arange(6.) + 10 * rank; out = torch.empty(2)``; after
    ``reduce_scatter_single(out, inp)`` rank 0 holds ``[30., 33.]``, rank 1 ``[36., 39.]``, rank
    2 ``[42., 45.]``.
    """
    if not async_op and _repeat("reduce_scatter_single", output, input, op, group, algorithm):
        return None
    return _reduce_scatter_single("reduce_scatter_single", output, input, op, group, async_op,
                                  algorithm)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group: Group | None = None,
                          async_op: bool = False, *, algorithm: str | None = None):
    """:func:`reduce_scatter_single` under its name before torch 2.13 (kept, without a warning)."""
    if not async_op and _repeat("reduce_scatter_tensor", output, input, op, group, algorithm):
        return None
    return _reduce_scatter_single("reduce_scatter_tensor", output, input, op, group, async_op,
                                  algorithm)


def _reduce_scatter_single(fn: str, output, input, op, group, async_op: bool, algorithm,
                           cache: bool = True):
    """The one implementation of both names and of :func:`reduce_scatter` (``fn``: the name the
    caller used); ``cache`` False for an ``input`` made for this call only (no plan to keep)."""
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
        algo = select("reduce_scatter", inp.numel() * inp.element_size(), g, algorithm, fn, inp.dtype,
                      inp.device.type, rop)
    except CommError as exc:
        _fail(g, fn, exc)
        raise
    if g.debug:
        _agree(g, fn, algo, shape=tuple(out.shape), dtype=dtype_name(out.dtype), op=rop.name)
    g.seq += 1
    if out.numel() == 0:
        return completed_work() if async_op else None
    if cache:
        post = _plan_pair(fn, g, algo, out, inp, output, input, rop, op, group, algorithm, async_op)
        if post is not None:
            return _run_plan(g, post, (out, inp), fn)
    return start(*_reduce_scatter(g, algo, out, inp, rop, g.blocking and not async_op, fn), g, fn,
                 g.seq, async_op)


def reduce_scatter(output, input_list: list, op=ReduceOp.SUM, group: Group | None = None,
                   async_op: bool = False, *, algorithm: str | None = None):
    """Reduce ``input_list[i]`` across the group into ``output`` on rank i.

    ``input_list`` holds group size tensors, each of ``output``'s shape, dtype and device. It is
    concatenated into one buffer (a copy) and reduced with the ``reduce_scatter_single``
    algorithm. dtypes and ops as for ``all_reduce``.

    Example (3 ranks): ``ins = [torch.full((2,), 10. * rank + i) for i in range(3)]``; after
    ``reduce_scatter(out, ins)`` rank i holds ``[30. + 3 * i, 30. + 3 * i]``.
    """
    fn = "reduce_scatter"
    g = resolve_group(group, fn)
    try:
        out = as_tensor(output, fn, "output", writable=True)
        ins = _tensor_list(fn, "input_list", input_list, g.size,
                           f"pass [torch.empty_like(output) for _ in range({g.size})]")
        for i, t in enumerate(ins):
            _same(fn, f"input_list[{i}]", t, out, "output")
            if t.shape != out.shape:
                raise arg_error(fn, f"input_list[{i}]", f"<tensor shape={tuple(t.shape)}>",
                                f"must have the shape of 'output' {tuple(out.shape)}: the blocks "
                                f"of a reduce-scatter are equal",
                                "pad the blocks to one shape, or use all_to_all_single with "
                                "uneven split sizes and reduce locally")
    except CommError as exc:
        _fail(g, fn, exc)
        raise
    return _reduce_scatter_single(fn, output, _flat_cat(ins), op, g, async_op, algorithm,
                                  cache=False)


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


def _all_to_all(group, algo, out, inp, out_counts, in_counts, blocking, fn="all_to_all_single",
                out_arg="output"):
    out_flat, copied = work_view(out, fn, out_arg)
    inp_flat = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
    if overlaps(inp_flat, out_flat):
        inp_flat = inp_flat.clone()
    gen = algo.run(_ctx(group, fn, None, blocking), out_flat, inp_flat, out_counts, in_counts)
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


def all_to_all(output_tensor_list: list, input_tensor_list: list, group: Group | None = None,
               async_op: bool = False, *, algorithm: str | None = None):
    """Send ``input_tensor_list[j]`` to rank j; ``output_tensor_list[i]`` receives what rank i sent.

    Both lists hold group size tensors of one dtype and device; their sizes may differ from peer
    to peer (what rank i sends to j has the element count that j's ``output_tensor_list[i]``
    has). The lists are packed into one buffer each and moved by the ``all_to_all_single``
    algorithm with the element counts as split sizes.

    Example (3 ranks): ``ins = [torch.tensor([10 * rank + j]) for j in range(3)]``; after
    ``all_to_all(outs, ins)`` rank j holds ``outs == [[j], [10 + j], [20 + j]]``.
    """
    fn = "all_to_all"
    g = resolve_group(group, fn)
    try:
        ins = _tensor_list(fn, "input_tensor_list", input_tensor_list, g.size,
                           "pass one tensor per rank of the group (the part sent to it)")
        outs = _tensor_list(fn, "output_tensor_list", output_tensor_list, g.size,
                            "pass one tensor per rank of the group (the part received from it)",
                            writable=True)
        for i, t in enumerate(ins[1:], 1):
            _same(fn, f"input_tensor_list[{i}]", t, ins[0], "input_tensor_list[0]")
        for i, t in enumerate(outs):
            _same(fn, f"output_tensor_list[{i}]", t, ins[0], "input_tensor_list[0]")
        in_counts = [t.numel() for t in ins]
        out_counts = [t.numel() for t in outs]
        algo = select("all_to_all", sum(in_counts) * ins[0].element_size(), g, algorithm, fn)
    except CommError as exc:
        _fail(g, fn, exc)
        raise
    if g.debug:
        _agree(g, fn, algo, dtype=dtype_name(ins[0].dtype))
    g.seq += 1
    # Runs even when this rank moves nothing: its peers' counts may pair with it.
    out = torch.empty(sum(out_counts), dtype=ins[0].dtype, device=ins[0].device)
    gen, finish, keep = _all_to_all(g, algo, out, _flat_cat(ins), out_counts, in_counts,
                                    g.blocking and not async_op, fn)
    return start(gen, lambda: _copy_out(out, outs), (keep, outs), g, fn, g.seq, async_op)


def _rooted(fn: str, g: Group, algo, tensor: torch.Tensor, root: int, gathering: bool,
            root_list: list[torch.Tensor] | None, async_op: bool):
    """``gather`` (``gathering``) or ``scatter`` of ``tensor``'s ``n`` elements as an all-to-all
    whose only non-zero split sizes are to the root (gather) or from it (scatter): every rank
    moves exactly its own block, as the definition says."""
    n, size = tensor.numel(), g.size
    blocking = g.blocking and not async_op
    to_root = [0] * size
    to_root[root] = n
    if gathering:
        if g.rank == root:
            out = torch.empty(size * n, dtype=tensor.dtype, device=tensor.device)
            gen, _, keep = _all_to_all(g, algo, out, tensor, [n] * size, to_root, blocking, fn)
            return start(gen, lambda: _copy_out(out, root_list), (keep, root_list), g, fn, g.seq,
                         async_op)
        out = tensor.new_empty(0)
        return start(*_all_to_all(g, algo, out, tensor, [0] * size, to_root, blocking, fn), g, fn,
                     g.seq, async_op)
    inp = _flat_cat(root_list) if g.rank == root else tensor.new_empty(0)
    counts = [n] * size if g.rank == root else [0] * size
    return start(*_all_to_all(g, algo, tensor, inp, to_root, counts, blocking, fn, "tensor"), g,
                 fn, g.seq, async_op)


def _rooted_call(fn: str, tensor, root_list, list_arg: str, root_arg: str, root, group_root,
                 group, async_op: bool, algorithm):
    """Checks, debug agreement and run of ``gather`` / ``scatter``."""
    gathering = fn == "gather"
    g = resolve_group(group, fn)
    try:
        t = as_tensor(tensor, fn, "tensor", writable=not gathering)
        r = root_rank(fn, g, root_arg, root, group_root)
        lst = _root_list(fn, list_arg, root_list, g, r, t, writable=gathering)
        algo = select("all_to_all", t.numel() * t.element_size() * g.size, g, algorithm, fn)
    except CommError as exc:
        _fail(g, fn, exc)
        raise
    if g.debug:
        _agree(g, fn, algo, shape=tuple(t.shape), dtype=dtype_name(t.dtype), root=r)
    g.seq += 1
    if t.numel() == 0:
        return completed_work() if async_op else None
    return _rooted(fn, g, algo, t, r, gathering, lst, async_op)


def gather(tensor, gather_list: list | None = None, dst: int | None = None,
           group: Group | None = None, async_op: bool = False, group_dst: int | None = None, *,
           algorithm: str | None = None):
    """Gather every rank's ``tensor`` into ``gather_list`` on rank ``dst`` (a world rank; or
    ``group_dst``, a rank of the group; default group rank 0).

    ``gather_list`` is given on the root only: group size tensors of ``tensor``'s shape, dtype and
    device; ``gather_list[i]`` receives rank i's ``tensor``. Other ranks pass None. Runs as an
    all-to-all in which each rank sends its ``tensor`` to the root and nothing elsewhere.

    Example (3 ranks): ``outs = [torch.empty(2) for _ in range(3)] if rank == 1 else None``; after
    ``gather(torch.full((2,), float(rank)), outs, dst=1)`` rank 1 holds
    ``outs == [[0., 0.], [1., 1.], [2., 2.]]``.
    """
    return _rooted_call("gather", tensor, gather_list, "gather_list", "dst", dst, group_dst,
                        group, async_op, algorithm)


def scatter(tensor, scatter_list: list | None = None, src: int | None = None,
            group: Group | None = None, async_op: bool = False, group_src: int | None = None, *,
            algorithm: str | None = None):
    """Rank i receives ``scatter_list[i]`` of rank ``src`` (a world rank; or ``group_src``; default
    group rank 0) in ``tensor``.

    ``scatter_list`` is given on the root only: group size tensors of ``tensor``'s shape, dtype
    and device. Other ranks pass None. Runs as an all-to-all in which the root sends one block to
    each rank and the others send nothing.

    Example (3 ranks): ``ins = [torch.full((2,), 10. + i) for i in range(3)] if rank == 0 else
    None``; after ``scatter(t, ins, src=0)`` rank i holds ``t == [10. + i, 10. + i]``.
    """
    return _rooted_call("scatter", tensor, scatter_list, "scatter_list", "src", src, group_src,
                        group, async_op, algorithm)


# ----- barrier -----------------------------------------------------------------------------
def barrier(group: Group | None = None, async_op: bool = False, device_ids=None):
    """Block until every rank of the group has entered the barrier."""
    g = resolve_group(group, "barrier")
    algo = select("barrier", 0, g, None, "barrier")
    if g.debug:
        _agree(g, "barrier", algo)
    g.seq += 1
    ctx = _ctx(g, "barrier", None, g.blocking and not async_op)
    return start(algo.run(ctx), None, None, g, "barrier", g.seq, async_op)


def _barrier_timeout(fn: str, timeout, group: Group) -> float | None:
    """``timeout`` (seconds or a ``timedelta``; None: the group's) in seconds, or None (none)."""
    if timeout is None:
        return group.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise arg_error(fn, "timeout", timeout, "must be a positive number of seconds or a timedelta",
                        "pass e.g. timeout=datetime.timedelta(seconds=30), or None for the "
                        "group's timeout")
    return float(seconds)


def _wait_each(backend, handles: dict, limit: float | None) -> set:
    """Wait until every handle of ``handles`` (key -> handle) completes or ``limit`` seconds pass;
    the keys of those that completed. Polls each one on its own, sleeping between passes (from
    50 us, doubling to 5 ms), so a waiting rank leaves the cores to the ranks it waits for."""
    if limit is None:
        backend.wait(list(handles.values()))
        return set(handles)
    deadline = time.monotonic() + limit
    done: set = set()
    pause = 5e-5
    while True:
        for key, h in handles.items():
            if key not in done and backend.test([h]):
                done.add(key)
        if len(done) == len(handles) or time.monotonic() > deadline:
            return done
        time.sleep(pause)
        pause = min(2 * pause, 5e-3)


def monitored_barrier(group: Group | None = None, timeout=None, wait_all_ranks: bool = False):
    """A barrier that names the ranks that did not reach it, instead of hanging.

    Group rank 0 waits up to ``timeout`` (seconds or a ``timedelta``; default the group's
    ``COMMLIB_TIMEOUT``) for a message from every other rank, then answers each with the list of
    ranks that did not arrive. If any did not, every rank raises ``CommTimeoutError`` naming
    them: rank 0 at its deadline, the others when the answer arrives, and a rank that arrives
    late as soon as it does (the answer is waiting for it). Without ``wait_all_ranks`` the
    message names the first missing rank, as torch's does; with it, all of them. A rank other
    than 0 waits up to twice the timeout for the answer, then raises naming rank 0 (which has not
    reached the barrier, or is stuck before it).

    Unlike ``barrier``, it runs as point-to-point messages to and from rank 0 (2 (n - 1) small
    messages), and it never exchanges a debug-mode fingerprint first: a missing rank is what it
    reports, not a reason to wait.
    """
    fn = "monitored_barrier"
    g = resolve_group(group, fn)
    limit = _barrier_timeout(fn, timeout, g)
    if not isinstance(wait_all_ranks, bool):
        raise arg_error(fn, "wait_all_ranks", wait_all_ranks, "must be True or False",
                        "pass wait_all_ranks=True to list every rank that did not arrive",
                        CommTypeError)
    if g.broken is not None:
        unusable(g, fn)
    g.seq += 1
    tag = g.seq % _TAG_SPACE
    if g.size == 1:
        return None
    backend = g.backend
    device = "cpu" if "cpu" in backend.devices else "cuda"
    if g.rank == 0:
        tokens = {r: torch.empty(1, dtype=torch.int64, device=device) for r in range(1, g.size)}
        handles = {r: backend.irecv(tokens[r], r, tag) for r in tokens}
        arrived = _wait_each(backend, handles, limit)
        missing = [r for r in tokens if r not in arrived]
        verdict = torch.zeros(g.size, dtype=torch.int64, device=device)
        verdict[missing] = 1
        # Every rank gets the verdict, a missing one too: it finds it when it arrives, and raises.
        sends = {r: backend.isend(verdict, r, tag) for r in tokens}
        sent = _wait_each(backend, {r: sends[r] for r in arrived}, limit)
        if missing or len(sent) < len(arrived):
            # What a missing rank has not matched yet stays posted: its buffers must outlive it.
            _ABANDONED.append((handles, sends, tokens, verdict))
        if missing:
            raise _not_arrived(fn, g, missing, limit, wait_all_ranks)
        return None
    token = torch.full((1,), g.rank, dtype=torch.int64, device=device)
    verdict = torch.empty(g.size, dtype=torch.int64, device=device)
    handles = {"verdict": backend.irecv(verdict, 0, tag)}  # posted before rank 0 can answer
    handles["token"] = backend.isend(token, 0, tag)
    done = _wait_each(backend, {"verdict": handles["verdict"]},
                      None if limit is None else 2 * limit)
    if not done:
        _ABANDONED.append((handles, token, verdict))
        raise CommTimeoutError(
            f"commlib.{fn}: group rank 0 (world rank {g.ranks[0]}) of group {g.name!r} did not "
            f"answer within {2 * limit:g} s (twice the timeout) on rank {g.rank}: it has not "
            f"reached the barrier, or is stuck before it. Fix: see what rank 0 is doing (its "
            f"traceback, or COMMLIB_DEBUG=1), or raise the timeout if it is just slow.")
    backend.wait([handles["token"]])  # rank 0 answered, so it has received the token
    missing = [r for r in range(g.size) if verdict[r]]
    if missing:
        raise _not_arrived(fn, g, missing, limit, wait_all_ranks)
    return None


def _not_arrived(fn: str, g: Group, missing: list[int], limit: float, wait_all: bool):
    named = missing if wait_all else missing[:1]
    ranks = ", ".join(f"{r} (world rank {g.ranks[r]})" for r in named)
    more = "" if wait_all or len(missing) == 1 else \
        f" and {len(missing) - 1} more (wait_all_ranks=True lists every one)"
    return CommTimeoutError(
        f"commlib.{fn}: group {g.name!r} (size {g.size}), operation #{g.seq}: group rank"
        f"{'s' if len(named) > 1 else ''} {ranks}{more} did not reach the barrier within "
        f"{limit:g} s of rank 0 (seen on rank {g.rank}). Fix: find what those ranks are doing "
        f"(their tracebacks, or COMMLIB_DEBUG=1 to compare the calls), or raise the timeout if "
        f"they are just slow.")
