"""The rest of torch.distributed's set on real ranks: gather, scatter, all_to_all (lists),
reduce_scatter (lists), all_reduce_coalesced, all_gather_single / reduce_scatter_single, the
object collectives, monitored_barrier and the module-level names of commlib.api.compat.

Run under ``mpiexec -n N`` (backend mpi), under torchrun's variables (backend torch), or in one
plain process (backend self); ``EXPECT_BACKEND`` names the backend the launch should give. Every
expected value is computed here from every rank's input, which each rank rebuilds from (rank,
salt); never by commlib. Error cases check that the rank whose call is wrong raises the typed
error: in debug mode (``COMMLIB_DEBUG=1``) every other rank makes the correct call and raises
``CommMismatchError`` naming it; otherwise the others skip the call (a failed check posts
nothing), except for the object collectives, where every rank raises in every mode.
"""

import datetime
import os
import time
import warnings

import torch
from _harness import expect_error, main

import commlib
from commlib import CommArgumentError, CommMismatchError, CommStateError, CommTimeoutError, CommTypeError, ReduceOp

DTYPES = [torch.float32, torch.int64, torch.bfloat16]
SHAPES = [(5,), (2, 3), (), (0,)]


def world():
    return commlib.get_rank(), commlib.get_world_size()


def debug() -> bool:
    return commlib.get_world_group().debug


def data(rank: int, shape, dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers (1..3), exact in every dtype, so that sums over up to
    4 ranks are exact too."""
    seed = 7919 * rank + 104_729 * salt + 31 * DTYPES.index(dtype) + 7 * len(shape) + sum(shape)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 4, tuple(shape), generator=g).to(dtype)


def check(got, want, *what):
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    assert torch.equal(got, want), (what, got, want)


def finish(work, async_op):
    if async_op:
        assert isinstance(work, commlib.Work), work
        assert work.wait() is True and work.is_completed()
    else:
        assert work is None, work


# ----- gather and scatter -----------------------------------------------------------------------
def case_gather_every_root_dtype_and_shape():
    r, n = world()
    for dtype in DTYPES:
        for shape in SHAPES:
            for root in range(n):
                for async_op in (False, True):
                    t = data(r, shape, dtype)
                    outs = [torch.full(shape, -1).to(dtype) for _ in range(n)] if r == root else None
                    if async_op:
                        w = commlib.gather(t, outs, group_dst=root, async_op=True)
                    else:
                        w = commlib.gather(t, outs, dst=root)
                    finish(w, async_op)
                    check(t, data(r, shape, dtype), "gather leaves the input", dtype, shape)
                    if r == root:
                        for k in range(n):
                            check(outs[k], data(k, shape, dtype), "gather", dtype, shape, root, k)


def case_scatter_every_root_dtype_and_shape():
    r, n = world()
    for dtype in DTYPES:
        for shape in SHAPES:
            for root in range(n):
                for async_op in (False, True):
                    ins = [data(root, shape, dtype, salt=k) for k in range(n)] if r == root else None
                    t = torch.full(shape, -1).to(dtype)
                    w = commlib.scatter(t, ins, src=root, async_op=async_op)
                    finish(w, async_op)
                    check(t, data(root, shape, dtype, salt=r), "scatter", dtype, shape, root)
                    if r == root:  # the list is left as it was
                        for k in range(n):
                            check(ins[k], data(root, shape, dtype, salt=k), "scatter list", k)


def case_gather_scatter_non_contiguous_and_default_root():
    r, n = world()
    t = data(r, (3, 2), torch.float32).t()  # (2, 3), not contiguous
    outs = [torch.zeros(3, 2).t() for _ in range(n)] if r == 0 else None
    commlib.gather(t, outs)  # default root: group rank 0
    if r == 0:
        for k in range(n):
            check(outs[k], data(k, (3, 2), torch.float32).t(), "non-contiguous gather", k)
    out = torch.zeros(3, 2).t()
    ins = [data(0, (3, 2), torch.float32, salt=k).t() for k in range(n)] if r == 0 else None
    commlib.scatter(out, ins)
    check(out, data(0, (3, 2), torch.float32, salt=r).t(), "non-contiguous scatter")
    # the root's own tensor may be an entry of its list
    t = data(r, (4,), torch.int64)
    outs = [torch.zeros(4, dtype=torch.int64) for _ in range(n)] if r == 0 else None
    if r == 0:
        outs[0] = t
    commlib.gather(t, outs, dst=0)
    if r == 0:
        for k in range(n):
            check(outs[k], data(k, (4,), torch.int64), "gather into the input", k)


def case_gather_scatter_move_only_their_blocks():
    """The communication pattern: one all-to-all whose only non-zero split sizes are to the root
    (gather) or from it (scatter), so each rank moves exactly its own block."""
    r, n = world()
    backend = commlib.get_world_group().backend
    calls = []
    original = backend.all_to_all

    def spy(out, inp, out_counts, in_counts, blocking=False):
        calls.append((list(out_counts), list(in_counts)))
        return original(out, inp, out_counts, in_counts, blocking)

    backend.all_to_all = spy
    try:
        root = n - 1
        outs = [torch.empty(5) for _ in range(n)] if r == root else None
        commlib.gather(torch.ones(5), outs, dst=root)
        ins = [torch.ones(5) for _ in range(n)] if r == root else None
        commlib.scatter(torch.empty(5), ins, src=root)
    finally:
        del backend.all_to_all
    to_root = [5 if k == root else 0 for k in range(n)]
    everyone = [5] * n
    nothing = [0] * n
    want_gather = (everyone if r == root else nothing, to_root)
    want_scatter = (to_root, everyone if r == root else nothing)
    assert calls == [want_gather, want_scatter], (r, calls)


# ----- all_to_all, reduce_scatter, all_reduce_coalesced: the list forms ---------------------------
def _a2a_size(i: int, j: int) -> int:
    """Elements rank i sends to rank j: uneven, some zero."""
    return (2 * i + j) % 3


def case_all_to_all_lists_uneven():
    r, n = world()
    for dtype in DTYPES:
        for async_op in (False, True):
            ins = [data(r, (_a2a_size(r, j),), dtype, salt=j) for j in range(n)]
            outs = [torch.full((_a2a_size(i, r),), -1).to(dtype) for i in range(n)]
            finish(commlib.all_to_all(outs, ins, async_op=async_op), async_op)
            for i in range(n):
                check(outs[i], data(i, (_a2a_size(i, r),), dtype, salt=r), "all_to_all", dtype, i)
    # shapes may differ between the lists when the element counts agree
    ins = [data(r, (2, 3), torch.float32, salt=j) for j in range(n)]
    outs = [torch.empty(6) for _ in range(n)]
    commlib.all_to_all(outs, ins)
    for i in range(n):
        check(outs[i], data(i, (2, 3), torch.float32, salt=r).reshape(-1), "all_to_all reshaped")


def _reference(xs, op, dtype):
    wide = torch.stack([x.to(torch.float64) for x in xs])
    if op is ReduceOp.SUM:
        out = wide.sum(0)
    elif op is ReduceOp.AVG:
        out = wide.sum(0) / len(xs)
    elif op is ReduceOp.MAX:
        out = wide.amax(0)
    else:
        out = wide.prod(0)
    return out.to(dtype)


def case_reduce_scatter_lists():
    r, n = world()
    for dtype in DTYPES:
        ops = [ReduceOp.SUM, ReduceOp.MAX] + ([ReduceOp.AVG] if dtype is torch.float32 else [])
        for op in ops:
            for shape in SHAPES:
                for async_op in (False, True):
                    ins = [data(r, shape, dtype, salt=k) for k in range(n)]
                    out = torch.full(shape, -1).to(dtype)
                    finish(commlib.reduce_scatter(out, ins, op=op, async_op=async_op), async_op)
                    want = _reference([data(k, shape, dtype, salt=r) for k in range(n)], op, dtype)
                    check(out, want, "reduce_scatter", dtype, op, shape)
                    check(ins[0], data(r, shape, dtype, salt=0), "reduce_scatter input kept")


def case_all_reduce_coalesced():
    r, n = world()
    shapes = [(3,), (2, 2), (), (0,), (7,)]
    for dtype in DTYPES:
        ops = [ReduceOp.SUM, ReduceOp.PRODUCT] + ([ReduceOp.AVG] if dtype is torch.float32 else [])
        for op in ops:
            for async_op in (False, True):
                ts = [data(r, s, dtype, salt=k) for k, s in enumerate(shapes)]
                finish(commlib.all_reduce_coalesced(ts, op=op, async_op=async_op), async_op)
                for k, s in enumerate(shapes):
                    want = _reference([data(i, s, dtype, salt=k) for i in range(n)], op, dtype)
                    check(ts[k], want, "all_reduce_coalesced", dtype, op, k)
    t = data(r, (4,), torch.int64)  # a single tensor, as torch accepts
    commlib.all_reduce_coalesced(t)
    check(t, _reference([data(i, (4,), torch.int64) for i in range(n)], ReduceOp.SUM, torch.int64),
          "all_reduce_coalesced(tensor)")
    nc = data(r, (3, 4), torch.float32).t()  # non-contiguous entries get their results too
    commlib.all_reduce_coalesced([nc])
    check(nc, _reference([data(i, (3, 4), torch.float32).t() for i in range(n)], ReduceOp.SUM,
                         torch.float32), "all_reduce_coalesced non-contiguous")


def case_torch_2_13_names_are_the_same_functions():
    r, n = world()
    for dtype in DTYPES:
        for fn in (commlib.all_gather_single, commlib.all_gather_into_tensor):
            out = torch.zeros(n, 3).to(dtype)
            assert fn(out, data(r, (3,), dtype)) is None
            check(out, torch.stack([data(k, (3,), dtype) for k in range(n)]), fn.__name__, dtype)
        for fn in (commlib.reduce_scatter_single, commlib.reduce_scatter_tensor):
            out = torch.zeros(3).to(dtype)
            w = fn(out, data(r, (n * 3,), dtype), async_op=True)
            w.wait()
            want = _reference([data(k, (n * 3,), dtype)[3 * r:3 * r + 3] for k in range(n)],
                              ReduceOp.SUM, dtype)
            check(out, want, fn.__name__, dtype)
    # errors name the function as called
    expect_error(lambda: commlib.all_gather_single(torch.empty(n + 1), torch.ones(1)),
                 "commlib.all_gather_single()", "'output_tensor'")
    expect_error(lambda: commlib.reduce_scatter_single(torch.empty(1), torch.ones(n + 1)),
                 "commlib.reduce_scatter_single()", "'input'")


# ----- object collectives -----------------------------------------------------------------------
def obj(rank: int, salt: int = 0):
    """A picklable object whose pickled size depends on the rank (uneven byte counts)."""
    return {"rank": rank, "salt": salt, "payload": list(range(37 * rank + salt)),
            "text": "x" * (rank * 100 + 3), "tensor": torch.arange(rank + 1)}


def same_obj(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def case_object_collectives():
    r, n = world()
    out = [None] * n
    commlib.all_gather_object(out, obj(r))
    assert all(same_obj(out[k], obj(k)) for k in range(n)), out
    for root in range(n):
        got = [None] * n if r == root else None
        commlib.gather_object(obj(r, salt=root), got, dst=root)
        if r == root:
            assert all(same_obj(got[k], obj(k, salt=root)) for k in range(n)), got
        objs = [obj(root, salt=k) for k in range(3)] if r == root else [None, "stale", 3]
        commlib.broadcast_object_list(objs, src=root)
        assert all(same_obj(objs[k], obj(root, salt=k)) for k in range(3)), objs
        mine = ["stale"]
        ins = [obj(root, salt=k) for k in range(n)] if r == root else ["ignored off the source"]
        commlib.scatter_object_list(mine, ins, group_src=root)
        assert same_obj(mine[0], obj(root, salt=r)), mine
    empty = []
    commlib.broadcast_object_list(empty, src=0)  # nothing to move, still collective
    assert empty == []
    objs = [None]
    commlib.broadcast_object_list(objs, src=n - 1, device=torch.device("cpu"))
    assert objs == [None]


# ----- groups ----------------------------------------------------------------------------------
def case_subgroup():
    r, n = world()
    members = list(range(n - 1, -1, -2))  # every other rank, in reverse order
    g = commlib.new_group(members)
    if r not in members:
        for call in (lambda: commlib.gather(torch.ones(1), group=g),
                     lambda: commlib.all_gather_object([None] * len(members), 1, group=g),
                     lambda: commlib.monitored_barrier(group=g)):
            expect_error(call, "is not a member of group", kind=CommStateError)
        assert commlib.get_process_group_ranks(g) == members
        assert g == commlib.GroupMember.NON_GROUP_MEMBER
        assert not (g != commlib.GroupMember.NON_GROUP_MEMBER)
        commlib.barrier()
        return
    me, m = members.index(r), len(members)
    assert g != commlib.GroupMember.NON_GROUP_MEMBER
    assert commlib.get_group_rank(g, r) == me and commlib.get_global_rank(g, me) == r
    assert commlib.get_process_group_ranks(g) == members
    for dtype in DTYPES:
        root = members[-1]  # a world rank; group rank m - 1
        outs = [torch.zeros(2).to(dtype) for _ in range(m)] if r == root else None
        commlib.gather(data(r, (2,), dtype), outs, dst=root, group=g)
        if r == root:
            for k in range(m):
                check(outs[k], data(members[k], (2,), dtype), "group gather in group order", k)
        t = torch.zeros(2).to(dtype)
        ins = [data(members[0], (2,), dtype, salt=k) for k in range(m)] if me == 0 else None
        commlib.scatter(t, ins, group=g, group_src=0)
        check(t, data(members[0], (2,), dtype, salt=me), "group scatter group_src")
        ins = [data(r, (_a2a_size(me, j),), dtype, salt=j) for j in range(m)]
        outs = [torch.zeros(_a2a_size(i, me)).to(dtype) for i in range(m)]
        commlib.all_to_all(outs, ins, group=g)
        for i in range(m):
            check(outs[i], data(members[i], (_a2a_size(i, me),), dtype, salt=me), "group a2a", i)
        out = torch.zeros(2).to(dtype)
        commlib.reduce_scatter(out, [data(r, (2,), dtype, salt=k) for k in range(m)], group=g)
        want = _reference([data(q, (2,), dtype, salt=me) for q in members], ReduceOp.SUM, dtype)
        check(out, want, "group reduce_scatter")
        ts = [data(r, (3,), dtype), data(r, (), dtype, salt=1)]
        commlib.all_reduce_coalesced(ts, group=g)
        check(ts[0], _reference([data(q, (3,), dtype) for q in members], ReduceOp.SUM, dtype), "c0")
        check(ts[1], _reference([data(q, (), dtype, salt=1) for q in members], ReduceOp.SUM, dtype), "c1")
    got = [None] * m
    commlib.all_gather_object(got, obj(r), group=g)
    assert all(same_obj(got[k], obj(members[k])) for k in range(m))
    got = [None] * m if me == 0 else None
    commlib.gather_object(obj(r), got, group=g, group_dst=0)
    if me == 0:
        assert all(same_obj(got[k], obj(members[k])) for k in range(m))
    objs = ["from", members[-1]] if r == members[-1] else [None, None]
    commlib.broadcast_object_list(objs, src=members[-1], group=g)
    assert objs == ["from", members[-1]], objs
    mine = [None]
    commlib.scatter_object_list(mine, list(range(100, 100 + m)) if me == 0 else None, group=g)
    assert mine == [100 + me], mine
    commlib.monitored_barrier(group=g, timeout=30)
    commlib.destroy_process_group(g)  # this group only
    expect_error(lambda: commlib.all_reduce(torch.ones(1), group=g), "destroy_process_group",
                 kind=CommStateError)
    commlib.barrier()  # the world is still usable


# ----- monitored_barrier ------------------------------------------------------------------------
LATE = 1.2  # seconds a late rank sleeps; the barrier's timeout is 0.4 s


def _expect_timeout(call, *words):
    expect_error(call, "monitored_barrier", *words, kind=CommTimeoutError)


def case_monitored_barrier():
    r, n = world()
    commlib.monitored_barrier(timeout=30)
    commlib.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    commlib.monitored_barrier()  # the group's timeout
    expect_error(lambda: commlib.monitored_barrier(timeout=-1), "'timeout'", "positive")
    expect_error(lambda: commlib.monitored_barrier(wait_all_ranks="yes"), "'wait_all_ranks'",
                 kind=CommTypeError)
    if n == 1 or debug():  # it never runs the debug-mode check: the late cases add nothing there
        return
    # The last ranks are late (the last two at 4 ranks, so that rank 1 is on time): rank 0 names
    # them at its deadline, the ranks on time when rank 0 answers, and each late rank as soon as
    # it arrives (the answer waits for it). Without wait_all_ranks the first is named and the
    # rest counted; with it, all of them.
    late = list(range(max(1, n - 2), n))
    for wait_all in (False, True):
        commlib.barrier()
        if r in late:
            time.sleep(LATE)
        named = late if wait_all else late[:1]
        words = ["group rank" + ("s " if len(named) > 1 else " ")
                 + ", ".join(f"{k} (world rank {k})" for k in named)]
        if not wait_all and len(late) > 1:
            words.append(f"and {len(late) - 1} more (wait_all_ranks=True lists every one)")
        _expect_timeout(lambda w=wait_all: commlib.monitored_barrier(timeout=0.4, wait_all_ranks=w),
                        *words, "did not reach the barrier within 0.4 s")
    commlib.barrier()  # every message of the failed barriers was consumed: the group goes on
    # Rank 0 is late: the others give up after twice the timeout, naming it.
    if r == 0:
        time.sleep(LATE)
        commlib.monitored_barrier(timeout=0.4)  # everyone had arrived: it passes on rank 0
    else:
        _expect_timeout(lambda: commlib.monitored_barrier(timeout=0.4),
                        "group rank 0 (world rank 0)", "did not answer within 0.8 s")
    commlib.barrier()
    t = torch.ones(1)
    commlib.all_reduce(t)
    assert t.item() == n


# ----- errors on the rank that is wrong ---------------------------------------------------------
def one_rank_wrong(wrong: int, bad, good, kind, *words):
    """``bad()`` on rank ``wrong`` raises ``kind`` naming ``words``. In debug mode every other rank
    calls ``good()`` and raises CommMismatchError naming ``wrong``; else they do not call."""
    r, _ = world()
    if r == wrong:
        expect_error(bad, *words, "Fix:", kind=kind)
    elif debug():
        expect_error(good, f"ranks [{wrong}] failed their argument checks", kind=CommMismatchError)


def case_errors_gather_scatter():
    r, n = world()
    wrong = n - 1
    root = 0
    t = torch.ones(2)
    good_list = [torch.empty(2) for _ in range(n)]
    if n > 1:  # a list off the root
        one_rank_wrong(wrong, lambda: commlib.gather(t, good_list, dst=root),
                       lambda: commlib.gather(t, good_list if r == root else None, dst=root),
                       CommArgumentError, "commlib.gather()", "'gather_list'",
                       f"given on group rank {wrong}", "only the root (group rank 0)", "None")
        one_rank_wrong(wrong, lambda: commlib.scatter(t, good_list, src=root),
                       lambda: commlib.scatter(t, good_list if r == root else None, src=root),
                       CommArgumentError, "commlib.scatter()", "'scatter_list'",
                       f"given on group rank {wrong}")
    # the root without a list, with a wrong length, shape or dtype
    cases = [
        (None, CommArgumentError, ["is required on the root (group rank 0, this rank)"]),
        (good_list + [torch.empty(2)], CommArgumentError, ["<list of", f"group size ({n})"]),
        (torch.empty(n, 2), CommTypeError, ["must be a list"]),
        ([torch.empty(3)] + good_list[1:], CommArgumentError, ["'gather_list[0]'", "shape of 'tensor' (2,)"]),
        (good_list[:-1] + [torch.empty(2, dtype=torch.int64)], CommTypeError,
         [f"'gather_list[{n - 1}]'", "dtype of 'tensor' (float32)"]),
    ]
    for bad_list, kind, words in cases:
        one_rank_wrong(root, lambda b=bad_list: commlib.gather(t, b, dst=root),
                       lambda: commlib.gather(t, None, dst=root), kind, "commlib.gather()", *words)
        scatter_words = [w.replace("gather_list", "scatter_list") for w in words]
        one_rank_wrong(root, lambda b=bad_list: commlib.scatter(t, b, src=root),
                       lambda: commlib.scatter(t, None, src=root), kind, "commlib.scatter()",
                       *scatter_words)
    # roots: every rank is wrong the same way
    for call, words in [(lambda: commlib.gather(t, None, dst=0, group_dst=0), ["'dst'", "group_dst"]),
                        (lambda: commlib.scatter(t, None, src=n), ["'src'", f"world ranks {list(range(n))}"]),
                        (lambda: commlib.scatter(t, None, group_src=-1), ["'group_src'"])]:
        expect_error(call, *words, "Fix:")


def case_errors_lists_and_coalesced():
    r, n = world()
    wrong = n - 1
    ok_ins = [torch.ones(1) for _ in range(n)]
    ok_outs = [torch.empty(1) for _ in range(n)]
    one_rank_wrong(wrong, lambda: commlib.all_to_all(ok_outs, ok_ins[:-1]),
                   lambda: commlib.all_to_all(ok_outs, ok_ins), CommArgumentError,
                   "commlib.all_to_all()", "'input_tensor_list'", f"group size ({n})")
    one_rank_wrong(wrong, lambda: commlib.all_to_all(torch.empty(n), ok_ins),
                   lambda: commlib.all_to_all(ok_outs, ok_ins), CommTypeError,
                   "'output_tensor_list'", "must be a list")
    bad_outs = ok_outs[:-1] + [torch.empty(1, dtype=torch.int64)]
    one_rank_wrong(wrong, lambda: commlib.all_to_all(bad_outs, ok_ins),
                   lambda: commlib.all_to_all(ok_outs, ok_ins), CommTypeError,
                   f"'output_tensor_list[{n - 1}]'", "dtype of 'input_tensor_list[0]' (float32)")
    out = torch.empty(2)
    ok = [torch.ones(2) for _ in range(n)]
    one_rank_wrong(wrong, lambda: commlib.reduce_scatter(out, ok[:-1] + [torch.ones(3)]),
                   lambda: commlib.reduce_scatter(out, ok), CommArgumentError,
                   "commlib.reduce_scatter()", f"'input_list[{n - 1}]'", "shape of 'output' (2,)",
                   "blocks of a reduce-scatter are equal")
    one_rank_wrong(wrong, lambda: commlib.reduce_scatter(out, ok + ok),
                   lambda: commlib.reduce_scatter(out, ok), CommArgumentError, "'input_list'",
                   f"group size ({n})")
    one_rank_wrong(wrong, lambda: commlib.reduce_scatter(torch.empty(2, dtype=torch.int64), ok, op=ReduceOp.AVG),
                   lambda: commlib.reduce_scatter(out, ok), CommTypeError, "'input_list[0]'",
                   "dtype of 'output' (int64)")
    one_rank_wrong(wrong, lambda: commlib.reduce_scatter(out, ok, op="mean"),
                   lambda: commlib.reduce_scatter(out, ok), CommTypeError, "commlib.reduce_scatter()",
                   "'op'")
    ts = [torch.ones(2), torch.ones(3)]
    one_rank_wrong(wrong, lambda: commlib.all_reduce_coalesced([torch.ones(2), torch.ones(3, dtype=torch.int64)]),
                   lambda: commlib.all_reduce_coalesced(ts), CommTypeError,
                   "commlib.all_reduce_coalesced()", "'tensors[1]'", "dtype of tensors[0] (float32)",
                   "one call per dtype")
    one_rank_wrong(wrong, lambda: commlib.all_reduce_coalesced([]),
                   lambda: commlib.all_reduce_coalesced(ts), CommArgumentError, "'tensors'",
                   "at least one tensor")
    one_rank_wrong(wrong, lambda: commlib.all_reduce_coalesced([torch.ones(2, dtype=torch.int64)], op=ReduceOp.AVG),
                   lambda: commlib.all_reduce_coalesced([torch.ones(2, dtype=torch.int64)]),
                   CommArgumentError, "'op'", "AVG is defined on floating dtypes")
    one_rank_wrong(wrong, lambda: commlib.all_reduce_coalesced([torch.ones(2), [1.0]]),
                   lambda: commlib.all_reduce_coalesced(ts), CommTypeError, "'tensors[1]'")


class Unpicklable:
    def __reduce__(self):
        raise TypeError("not today")


def _every_rank_raises(r, wrong, call, kind, *words):
    """An object collective: the wrong rank raises ``kind``; every other rank, in every mode,
    CommMismatchError naming it."""
    if r == wrong:
        expect_error(call, *words, "Fix:", kind=kind)
    else:
        expect_error(call, f"group rank {[wrong]} of group 'world' failed its argument checks",
                     kind=CommMismatchError)


def case_errors_object_collectives():
    r, n = world()
    wrong = n - 1
    bad = Unpicklable() if r == wrong else r
    _every_rank_raises(r, wrong, lambda: commlib.all_gather_object([None] * n, bad), CommTypeError,
                       "commlib.all_gather_object()", "'obj'", "cannot be pickled", "not today")
    _every_rank_raises(r, wrong, lambda: commlib.all_gather_object([None] * (n + (r == wrong)), 1),
                       CommArgumentError, "'object_list'", f"group size ({n})")
    _every_rank_raises(r, wrong, lambda: commlib.gather_object(bad, [None] * n if r == 0 else None),
                       CommTypeError, "commlib.gather_object()", "cannot be pickled")
    if n > 1:
        _every_rank_raises(r, wrong, lambda: commlib.gather_object(1, [None] * n if r in (0, wrong) else None),
                           CommArgumentError, "'object_gather_list'", f"given on group rank {wrong}")
        _every_rank_raises(r, 0, lambda: commlib.gather_object(1, None), CommArgumentError,
                           "'object_gather_list'", "on the root (group rank 0, this rank)")
        objs = [Unpicklable()] if r == 0 else [None]
        _every_rank_raises(r, 0, lambda: commlib.broadcast_object_list(objs, src=0), CommTypeError,
                           "commlib.broadcast_object_list()", "'object_list[0]'", "cannot be pickled")
        _every_rank_raises(r, 0, lambda: commlib.scatter_object_list([None], ["too", "short"][:n - 1]),
                           CommArgumentError, "'scatter_object_input_list'", f"group size ({n})")
        # lists of different lengths, and ranks naming different roots: every rank raises
        expect_error(lambda: commlib.broadcast_object_list([None] * (2 + (r == wrong)), src=0),
                     "object_list has 2 entries on the source", f"group ranks [{wrong}]",
                     kind=CommMismatchError)
        expect_error(lambda: commlib.gather_object(1, [None] * n if r in (0, wrong) else None,
                                                   group_dst=wrong if r == wrong else 0),
                     "name different roots", kind=CommMismatchError)
    _every_rank_raises(r, wrong, lambda: commlib.scatter_object_list([] if r == wrong else [None], list(range(n))),
                       CommArgumentError, "'scatter_object_output_list'", "non-empty list")
    _every_rank_raises(r, wrong, lambda: commlib.broadcast_object_list((1,) if r == wrong else [1], src=0),
                       CommTypeError, "'object_list'", "must be a list")
    # the group is in step afterwards
    out = [None] * n
    commlib.all_gather_object(out, r)
    assert out == list(range(n))


# ----- the module-level names of torch.distributed ----------------------------------------------
def case_zz_compat_names():
    """Runs last (case order is alphabetical): it finalizes and re-initializes commlib."""
    r, n = world()
    world_group = commlib.get_world_group()
    assert commlib.is_available() is True
    assert commlib.get_backend() == os.environ.get("EXPECT_BACKEND", "self")
    assert commlib.get_backend(world_group) == commlib.get_backend()
    assert commlib.GroupMember.WORLD is world_group
    assert commlib.get_process_group_ranks(None) == list(range(n))
    assert commlib.get_process_group_ranks(world_group) == list(range(n))
    assert [commlib.get_global_rank(None, k) for k in range(n)] == list(range(n))
    assert commlib.get_group_rank(world_group, r) == r
    expect_error(lambda: commlib.get_global_rank(world_group, n), "'group_rank'", f"0..{n - 1}")
    expect_error(lambda: commlib.get_group_rank(world_group, n), "'global_rank'", "not a member")
    expect_error(lambda: commlib.get_process_group_ranks("world"), "'group'", kind=CommTypeError)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert commlib.reduce_op.SUM is ReduceOp.SUM and commlib.reduce_op.MAX is ReduceOp.MAX
    assert len(caught) == 2 and all(w.category is FutureWarning for w in caught)
    assert "commlib.ReduceOp" in str(caught[0].message)
    # teardown and setup, torch.distributed's way
    expect_error(lambda: commlib.init_process_group("gloo"), "already initialized",
                 "destroy_process_group", kind=CommStateError)
    backend = commlib.get_backend()
    commlib.destroy_process_group()
    assert not commlib.is_initialized() and commlib.GroupMember.WORLD is None
    expect_error(lambda: commlib.init_process_group("ucc"), "'backend'", "'gloo' or 'nccl'")
    expect_error(lambda: commlib.init_process_group(7), "'backend'", kind=CommTypeError)
    expect_error(lambda: commlib.init_process_group("gloo", timeout=0), "'timeout'", "positive")
    if backend != "torch":  # no torch rendezvous here: "gloo" runs on the launcher's engine
        expect_error(lambda: commlib.init_process_group("mpi", pg_options=object()), "'pg_options'",
                     "torch.distributed's process groups")
        assert not commlib.is_initialized()
    if backend == "torch" and n > 1:  # torchrun's ranks, each its own MPI world: refused
        expect_error(lambda: commlib.init_process_group("mpi"), "sees 1 rank(s)",
                     f"WORLD_SIZE={n}", "mpiexec", kind=commlib.CommBackendError)
        assert not commlib.is_initialized()
    commlib.init_process_group("gloo", timeout=datetime.timedelta(seconds=60), rank=r, world_size=n)
    assert commlib.get_backend() == backend and commlib.get_world_size() == n
    assert commlib.GroupMember.WORLD is commlib.get_world_group() is not world_group
    t = torch.ones(1)
    commlib.all_reduce(t)
    assert t.item() == n
    if backend != "torch":
        commlib.destroy_process_group()
        expect_error(lambda: commlib.init_process_group(world_size=n + 1), "'world_size'",
                     f"differs from what the launcher started (world_size {n}")
        assert not commlib.is_initialized()
        commlib.init_process_group()  # detected, as commlib.init()
        assert commlib.get_backend() == backend


if __name__ == "__main__":
    main(globals())
