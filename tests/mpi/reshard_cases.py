"""commlib.reshard on real ranks, against the full tensor sliced by the destination layout.

Every rank builds the same full tensor from a seed; source shards are cut from it here with
torch.chunk (mesh dimensions in order, the DTensor rule), never with the library's Layout.box or
Layout.shard; a Partial source gets random integer addends that sum exactly to the full tensor.
The bytes each rank sends are counted with commlib.nn.functional.traffic() and compared with the
plan's ``sent`` and, summed over the ranks, its ``bytes_by_link``; in a few hand cases with values
written out here. Where source and destination share one mesh over the world, DTensor's
``redistribute`` on gloo is a second oracle.

``RESHARD_TEST_HOSTS=a,a,b,b`` puts rank k on virtual host ``a``/``b`` (COMMLIB_TEST_HOST, read
before commlib.init()), so that bytes split into cross-host and intra-host ones.
"""

from __future__ import annotations

import math
import os
import random
import sys

_LAYOUT = os.environ.get("RESHARD_TEST_HOSTS", "")
if _LAYOUT:
    os.environ["COMMLIB_TEST_HOST"] = _LAYOUT.split(",")[int(os.environ["PMI_RANK"])]

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _harness import expect_error, init_gloo, main  # noqa: E402
from _reshard import (chunk_piece, coords, flat, random_mesh, random_placements,  # noqa: E402
                      shape_of)

import commlib  # noqa: E402
from commlib import CommArgumentError, CommMismatchError, CommTypeError  # noqa: E402
from commlib.nn.functional import traffic  # noqa: E402
from commlib.reshard import Layout, Partial, Replicate, Shard, plan, reshard  # noqa: E402

STRATEGIES = ("auto", "sendrecv", "broadcast", "allgather")
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
KINDS = {"reshard.cross", "reshard.intra"}


def world():
    return commlib.get_rank(), commlib.get_world_size()


def hosts():
    """Host name of every world rank (all alike without RESHARD_TEST_HOSTS)."""
    n = commlib.get_world_size()
    return _LAYOUT.split(",") if _LAYOUT else ["h"] * n


# ----- the oracle --------------------------------------------------------------------------------








def expected(full, ranks, placements, rank):
    """``rank``'s piece under a Shard/Replicate layout, None outside it."""
    if rank not in flat(ranks):
        return None
    return chunk_piece(full, shape_of(ranks), placements, coords(ranks, rank))


def make_full(seed, shape, dtype, exact):
    """The full tensor: integers when ``exact`` (sums stay exact in bfloat16), else random
    normals; int64 spans 2^40 (a 32-bit truncation shows)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-2 ** 40, 2 ** 40, shape, generator=g)
    if exact:
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def source_shard(full, ranks, placements, rank, seed):
    """``rank``'s source shard: along Partial mesh dims, one of P random addends summing to
    ``full`` (P = product of the Partial dims' sizes; addend k on the rank whose Partial
    coordinates have row-major index k); None outside the layout."""
    if rank not in flat(ranks):
        return None
    mesh, c = shape_of(ranks), coords(ranks, rank)
    pdims = [md for md, p in enumerate(placements) if isinstance(p, Partial)]
    value = full
    if pdims:
        count = math.prod(mesh[md] for md in pdims)
        index = 0
        for md in pdims:
            index = index * mesh[md] + c[md]
        g = torch.Generator().manual_seed(seed + 17)
        wide = full.dtype == torch.int64
        addends = [torch.randint(*((-2 ** 40, 2 ** 40) if wide else (-8, 9)), full.shape,
                                 generator=g).to(full.dtype) for _ in range(count - 1)]
        last = full.to(torch.float64 if not wide else torch.int64)
        for a in addends:
            last = last - a.to(last.dtype)
        addends.append(last.to(full.dtype))
        assert torch.equal(sum(a.to(torch.float64 if not wide else torch.int64)
                               for a in addends).to(full.dtype), full)
        value = addends[index]
    return chunk_piece(value, mesh, placements, c).contiguous().clone()


def check_out(what, out, want):
    if want is None:
        assert out is None, (what, "a rank outside dst got", out)
        return
    assert isinstance(out, torch.Tensor), (what, out)
    assert out.dtype == want.dtype and tuple(out.shape) == tuple(want.shape), \
        (what, out.dtype, tuple(out.shape), want.dtype, tuple(want.shape))
    assert torch.equal(out, want), (what, commlib.get_rank(), out, want)


# ----- random layouts ----------------------------------------------------------------------------


def random_meshes(rng, n, relation):
    """(src ranks, dst ranks) as nested lists: identical, disjoint, overlapping or any subsets."""
    if relation == "disjoint" and n > 1:
        src = rng.sample(range(n), rng.randint(1, n - 1))
        rest = [r for r in range(n) if r not in src]
        dst = rng.sample(rest, rng.randint(1, len(rest)))
    elif relation == "identical":
        src = rng.sample(range(n), rng.randint(1, n))
        dst = list(src)
    elif relation == "overlap" and n > 1:
        src = rng.sample(range(n), rng.randint(1, n))
        keep = rng.sample(src, rng.randint(1, len(src)))
        rest = [r for r in range(n) if r not in src]
        dst = keep + rng.sample(rest, rng.randint(0, len(rest)))
        rng.shuffle(dst)
    else:
        src = rng.sample(range(n), rng.randint(1, n))
        dst = rng.sample(range(n), rng.randint(1, n))
    return random_mesh(rng, src), random_mesh(rng, dst)




def random_shape(rng):
    while True:
        shape = tuple(rng.choice([1, 1, 2, 2, 3, 4, 5, 7]) for _ in range(rng.randint(1, 4)))
        if math.prod(shape) <= 200:
            return shape


def run_one(what, seed, shape, dtype, src_ranks, src_pl, dst_ranks, dst_pl, *, strategy="auto",
            async_op=False, given=True, junk=False, strided=False, group=None):
    """One reshard on every rank of ``group`` (default world), checked exactly; returns
    (plan, the bytes this rank counted by kind)."""
    rank, _ = world()
    exact = any(isinstance(p, Partial) for p in src_pl)
    full = make_full(seed, shape, dtype, exact)
    local = source_shard(full, src_ranks, src_pl, rank, seed)
    if local is None and junk:
        local = torch.full((3,), 7.0)  # ignored outside the source mesh
    if local is not None and strided and local.dim() == 2:
        local = local.t().contiguous().t()  # same values, column-major strides
    src, dst = Layout(src_ranks, src_pl), Layout(dst_ranks, dst_pl)
    # given: True / False (both or neither of global_shape and dtype), "shape" or "dtype"
    kw = {k: v for k, v in (("global_shape", shape), ("dtype", dtype))
          if given is True or given == k.split("_")[-1]}
    with traffic() as t:
        out = reshard(local, src, dst, strategy=strategy, async_op=async_op, group=group, **kw)
        if async_op:
            assert not isinstance(out, torch.Tensor) and out is not None, (what, out)
            out = out.wait()
    check_out(what, out, expected(full, dst_ranks, dst_pl, rank))
    p = plan(shape, dtype, src, dst, strategy=strategy, group=group)
    assert set(t.by_kind) <= KINDS, (what, t.by_kind)
    assert t.sent == p.sent.get(rank, 0), (what, rank, t.sent, p.sent, t.by_kind, str(p))
    return p, t.by_kind


def sum_over_ranks(rows):
    """Element-wise sum over the world of a list of [cross, intra] rows."""
    t = torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)
    commlib.all_reduce(t)
    return t.tolist()


def check_links(what, plans, counted):
    """The bytes of every rank, per link class, summed: each plan's bytes_by_link."""
    total = sum_over_ranks([[c.get("reshard.cross", 0), c.get("reshard.intra", 0)]
                            for c in counted])
    for (p, label), (cross, intra) in zip(zip(plans, what), total):
        assert p.bytes_by_link == {"cross": cross, "intra": intra}, (label, p.bytes_by_link,
                                                                     cross, intra, str(p))


# ----- cases -------------------------------------------------------------------------------------
def case_random():
    """Dozens of random layouts (seeded): meshes identical, disjoint, overlapping or any, 1-D and
    2-D; Shard/Replicate/Partial sources, Shard/Replicate destinations; 1-4 tensor dims, sizes
    down to 1 (empty shards); every strategy and dtype; async; global_shape/dtype omitted on some."""
    rank, n = world()
    count = 40
    plans, counted, labels = [], [], []
    relations = ("identical", "disjoint", "overlap", "any")
    strategies_seen, empty_seen, partial_seen = set(), 0, 0
    my_hosts = hosts()
    for i in range(count):
        rng = random.Random(1000 * n + i)
        relation = relations[(i // 4) % 4]
        strategy, dtype = STRATEGIES[i % 4], DTYPES[i % 3]
        src_ranks, dst_ranks = random_meshes(rng, n, relation)
        shape = random_shape(rng)
        src_pl = random_placements(rng, len(shape_of(src_ranks)), len(shape), True)
        dst_pl = random_placements(rng, len(shape_of(dst_ranks)), len(shape), False)
        async_op = rng.random() < 0.3
        given = rng.choice([True, True, True, False, "shape", "dtype"])
        junk, strided = rng.random() < 0.3, rng.random() < 0.2
        what = (f"random case {i}: {shape} {dtype} src {src_ranks} {src_pl} -> dst {dst_ranks} "
                f"{dst_pl} strategy={strategy} async={async_op} given={given} strided={strided}")
        p, by_kind = run_one(what, 7 * i + n, shape, dtype, src_ranks, src_pl, dst_ranks, dst_pl,
                             strategy=strategy, async_op=async_op, given=given, junk=junk,
                             strided=strided)
        plans.append(p)
        counted.append(by_kind)
        labels.append(what)
        strategies_seen |= {t.mode for t in p.tasks}
        partial_seen += any(isinstance(x, Partial) for x in src_pl)
        empty_seen += any(0 in source_shard(torch.zeros(shape), ranks, pl, r, 0).shape
                          for ranks, pl in ((src_ranks, src_pl), (dst_ranks, dst_pl))
                          for r in flat(ranks))
        # the group's host layout is what the planner found on its own
        ids = {h: k for k, h in enumerate(dict.fromkeys(my_hosts))}
        again = plan(shape, dtype, Layout(src_ranks, src_pl), Layout(dst_ranks, dst_pl),
                     strategy=strategy, group=commlib.get_world_group(),
                     hosts=[ids[h] for h in my_hosts])
        assert again.tasks == p.tasks and again.sent == p.sent, (what, str(again), str(p))
        assert again.bytes_by_link == p.bytes_by_link, what
    check_links(labels, plans, counted)
    assert partial_seen >= 5 and empty_seen >= 4, (partial_seen, empty_seen)
    assert "sendrecv" in strategies_seen, strategies_seen


def case_strategies_dtypes():
    """Fixed layouts x every strategy x float32/bfloat16/int64, global_shape given or not."""
    rank, n = world()
    everyone = list(range(n))
    layouts = [
        ((5, 7), [0], [Replicate()], everyone[::-1], [Replicate()]),          # one to many
        ((5, 7), everyone, [Shard(1)], everyone, [Shard(0)]),                 # all-to-all
        ((9, 2), everyone[: max(n - 1, 1)], [Shard(0)], [n - 1], [Replicate()]),  # gather
        ((3, 4, 2), [everyone], [Replicate(), Partial()], everyone[::-1], [Shard(2)]),  # sum
    ]
    if n >= 4:
        layouts.append(((6, 5), [[0, 1], [2, 3]], [Shard(0), Partial()],
                        [[3, 2], [1, 0]], [Shard(1), Shard(1)]))
        layouts.append(((6, 5), [[0, 1], [2, 3]], [Replicate(), Shard(1)],
                        everyone[1:], [Replicate()]))
    plans, counted, labels = [], [], []
    for li, (shape, sr, sp, dr, dp) in enumerate(layouts):
        for strategy in STRATEGIES:
            for dtype in DTYPES:
                for given in (True, False):
                    what = f"layout {li} {strategy} {dtype} given={given}"
                    p, by_kind = run_one(what, 100 + li, shape, dtype, sr, sp, dr, dp,
                                         strategy=strategy, given=given)
                    plans.append(p)
                    counted.append(by_kind)
                    labels.append(what)
                    if strategy != "auto" and (n >= 3 or strategy == "sendrecv"):
                        # the one-to-many layout has a tile with n-1 >= 2 receivers
                        assert li or [t.mode for t in p.tasks] == [strategy], (what, str(p))
    check_links(labels, plans, counted)


def case_bytes_by_hand():
    """Counted bytes against values written out here. One tile from rank 0 to the ranks of the
    other host (or to ranks 1..n-1 on one host): send/recv costs rank 0 m copies, the broadcast
    chain (0, then the receivers in rank order: the virtual hosts are blocks of consecutive
    ranks) one copy per rank but the last, the all-gather mode the tile once plus each receiver
    its part m-1 times. A Partial source on
    every rank to rank 0: each rank sends 2(n-1)/n of its shard to its ring successor."""
    rank, n = world()
    hs = hosts()
    far = [r for r in range(n) if hs[r] != hs[0]]
    dst = far if len(far) >= 2 else list(range(1, n))
    m, e = len(dst), 16
    part = -(-e // m)
    parts = [min((i + 1) * part, e) - min(i * part, e) for i in range(m)]
    for strategy in ("sendrecv", "broadcast", "allgather"):
        _, by_kind = run_one(f"hand 1-to-{m} {strategy}", 5, (e,), torch.float32, [0],
                             [Replicate()], dst, [Replicate()], strategy=strategy)
        want = {}
        order = [0, *sorted(dst)]
        if strategy == "broadcast" and rank in order[:-1]:
            after = order[order.index(rank) + 1]
            want["reshard.intra" if hs[after] == hs[rank] else "reshard.cross"] = 4 * e
        elif rank == 0:
            link = "reshard.intra" if all(hs[r] == hs[0] for r in dst) else "reshard.cross"
            want[link] = 4 * (e if strategy == "allgather" and m > 1 else m * e)
        elif rank in dst and strategy == "allgather" and m > 1:
            mine = 4 * parts[dst.index(rank)]
            for r in dst:
                if r != rank and mine:
                    k = "reshard.intra" if hs[r] == hs[rank] else "reshard.cross"
                    want[k] = want.get(k, 0) + mine
        assert by_kind == want, (strategy, rank, dst, by_kind, want)
    if n >= 2:
        _, by_kind = run_one("hand partial", 6, (6,), torch.int64, list(range(n)), [Partial()],
                             [0], [Replicate()])
        k = "reshard.intra" if hs[rank] == hs[(rank + 1) % n] else "reshard.cross"
        assert by_kind == {k: 2 * (n - 1) * 48 // n}, (rank, by_kind)


def case_mesh_layouts():
    """Layouts over commlib.Mesh objects: the mesh's world ranks in mesh order."""
    rank, n = world()
    flat_mesh = commlib.Mesh((n,))
    lay = Layout(flat_mesh, [Shard(0)])
    assert tuple(lay.shape) == (n,) and tuple(lay.ranks) == tuple(range(n)), lay
    shapes = [(1, n), (n, 1)] + ([(2, n // 2)] if n % 2 == 0 else [])
    for shape in shapes:
        mesh = commlib.Mesh(shape)
        lay2 = Layout(mesh, [Shard(1), Shard(0)])
        ranks = [[mesh.rank_at((i, j)) for j in range(shape[1])] for i in range(shape[0])]
        assert tuple(lay2.shape) == shape and list(lay2.ranks) == flat(ranks), (lay2, ranks)
        full = make_full(3, (5, 3), torch.float32, False)
        local = source_shard(full, list(range(n)), [Shard(0)], rank, 3)
        out = reshard(local, lay, lay2)
        check_out(f"mesh {shape}", out, expected(full, ranks, [Shard(1), Shard(0)], rank))
        back = reshard(out, lay2, Layout(flat_mesh, [Replicate()]), global_shape=(5, 3))
        check_out(f"mesh {shape} back", back, full)


def case_async_and_cache():
    """Two async reshards in flight at once, waited in reverse order; the same layouts three
    times with new data (cached plan and groups); wait() twice gives the same tensor."""
    rank, n = world()
    everyone = list(range(n))
    a_src, a_dst = (everyone, [Shard(0)]), (everyone[::-1], [Replicate()])
    b_src, b_dst = ([0], [Replicate()]), (everyone, [Shard(1)])
    fa = make_full(41, (7, 3), torch.float32, False)
    fb = make_full(42, (4, 9), torch.int64, False)
    wa = reshard(source_shard(fa, *a_src, rank, 41), Layout(*a_src), Layout(*a_dst),
                 async_op=True, strategy="broadcast")
    wb = reshard(source_shard(fb, *b_src, rank, 42), Layout(*b_src), Layout(*b_dst),
                 async_op=True, strategy="allgather")
    outb = wb.wait()
    outa = wa.wait()
    check_out("async b", outb, expected(fb, *b_dst, rank))
    check_out("async a", outa, expected(fa, *a_dst, rank))
    assert wa.wait() is outa
    sent = []
    for k in range(3):
        full = make_full(50 + k, (6, 5), torch.bfloat16, False)
        with traffic() as t:
            out = reshard(source_shard(full, *a_src, rank, 50 + k), Layout(*a_src),
                          Layout(*a_dst), global_shape=(6, 5), dtype=torch.bfloat16)
        check_out(f"repeat {k}", out, expected(full, *a_dst, rank))
        sent.append(t.sent)
    assert sent[0] == sent[1] == sent[2], sent


def case_async_order():
    """Async reshards in the all-gather mode (receivers forward their parts to each other) in
    flight together: waited in reverse order, and a blocking reshard of the same layouts issued
    before the wait. Each must get its own data (on a group with a short timeout, so that a
    deadlock fails fast)."""
    rank, n = world()
    g = commlib.new_group(list(range(n)), timeout=15)
    dst = list(range(1, n)) or [0]
    fulls = [make_full(110 + k, (8, 3), torch.float32, False) for k in range(4)]

    def go(k, async_op):
        return reshard(source_shard(fulls[k], [0], [Replicate()], rank, 0),
                       Layout([0], [Replicate()]), Layout(dst, [Replicate()]),
                       global_shape=(8, 3), dtype=torch.float32, strategy="allgather",
                       async_op=async_op, group=g)

    def want(k):
        return expected(fulls[k], dst, [Replicate()], rank)

    w0, w1 = go(0, True), go(1, True)
    check_out("in flight 2, waited first", w1.wait(), want(1))
    check_out("in flight 1, waited second", w0.wait(), want(0))
    w2 = go(2, True)
    check_out("blocking while one is in flight", go(3, False), want(3))
    check_out("the one in flight", w2.wait(), want(2))


def case_small_tiles_many_receivers():
    """The all-gather mode with tiles of fewer elements than receivers (empty parts), followed by
    more transfers between the same ranks: nothing stale may be left behind."""
    rank, n = world()
    everyone = list(range(n))
    for k, shape in enumerate([(1,), (2,), (1, 1), (3,), (0, 3)]):
        for strategy in ("allgather", "broadcast", "sendrecv", "allgather"):
            run_one(f"small {shape} {strategy}", 60 + k, shape, torch.float32, [0],
                    [Replicate()], everyone[1:] or [0], [Replicate()], strategy=strategy)
            run_one(f"small {shape} {strategy} then shards", 70 + k, (2 * n + 1,),
                    torch.int64, everyone, [Shard(0)], everyone[::-1], [Replicate()],
                    strategy=strategy)


def case_group():
    """group=: a reversed world group (group ranks != world ranks) and, at 3+ ranks, a subgroup
    that only its members call; ranks outside the group are an error on every rank."""
    rank, n = world()
    rev = commlib.new_group(list(range(n))[::-1])
    full = make_full(80, (5, 2), torch.float32, False)
    run_one("reversed group", 80, (5, 2), torch.float32, [0], [Replicate()],
            list(range(n)), [Shard(0)], group=rev, strategy="sendrecv")
    run_one("reversed group allgather", 80, (5, 2), torch.float32, [0], [Replicate()],
            list(range(n)), [Replicate()], group=rev, strategy="allgather")
    if n >= 3:
        sub = commlib.new_group([2, 1])
        if rank in (1, 2):
            run_one("subgroup", 81, (5, 2), torch.float32, [2], [Replicate()], [1, 2],
                    [Shard(1)], group=sub)
            local = full if rank == 2 else None
            expect_error(lambda: reshard(local, Layout([2], [Replicate()]),
                                         Layout([0, 1], [Replicate()]), group=sub,
                                         global_shape=(5, 2), dtype=torch.float32),
                         "'dst'", "[0]", "not in the group")
            expect_error(lambda: plan((5, 2), torch.float32, Layout([0], [Replicate()]),
                                      Layout([1], [Replicate()]), group=sub),
                         "'src'", "[0]", "not in the group")
    outside = Layout([0, n], [Replicate()])
    expect_error(lambda: reshard(full, outside, Layout([0], [Replicate()]), global_shape=(5, 2),
                                 dtype=torch.float32), "'src'", f"[{n}]", "not in the group")
    expect_error(lambda: plan((5, 2), torch.float32, Layout([0], [Replicate()]), outside),
                 "'dst'", f"[{n}]", "not in the group")
    commlib.barrier()


def case_errors():
    """Bad inputs raise a typed error naming the argument and value on every rank (every rank
    passes the same bad input, or is a source rank with a bad shard), and the ranks can go on."""
    rank, n = world()
    everyone = list(range(n))
    shape = (2 * n + 1, 3)
    src = Layout(everyone, [Shard(0)])
    full = make_full(90, shape, torch.float32, False)
    good = source_shard(full, everyone, [Shard(0)], rank, 90)
    dst = Layout(everyone[::-1], [Replicate()])
    kw = dict(global_shape=shape, dtype=torch.float32)
    bad = torch.zeros(good.shape[0] + 1, 3)
    expect_error(lambda: reshard(bad, src, dst, **kw), "'local'",
                 f"shape={tuple(bad.shape)}", str(tuple(good.shape)))
    # global_shape inferred: rank r's shard has 3 + r columns, no global shape fits them all
    ragged = torch.zeros(good.shape[0], 3 + rank)
    expect_error(lambda: reshard(ragged, src, dst), "'local'", "rank 1", "does not match")
    wrong_dtype = good.to(torch.float64)
    try:
        reshard(wrong_dtype, src, dst, **kw)
    except (CommArgumentError, CommTypeError) as exc:
        assert "'local'" in str(exc) and "float64" in str(exc), str(exc)
    else:
        raise AssertionError("no error for a float64 shard of a float32 reshard")
    expect_error(lambda: reshard(None, src, dst, **kw), "'local'", "NoneType", kind=CommTypeError)
    expect_error(lambda: reshard(good, Layout(everyone, [Shard(2)]), dst, **kw), "'src'",
                 "Shard(2)", "2-dimensional")
    expect_error(lambda: reshard(good, src, Layout(everyone, [Shard(2)]), **kw), "'dst'",
                 "Shard(2)", "2-dimensional")
    expect_error(lambda: reshard(good, src, Layout(everyone, [Shard(5)])), "'dst'", "Shard(5)")
    expect_error(lambda: reshard(good, src, Layout(everyone, [Partial()]), **kw), "'dst'",
                 "Partial")
    expect_error(lambda: reshard(good, src, dst, strategy="tree", **kw), "'strategy'", "'tree'",
                 "allgather")
    expect_error(lambda: Layout(everyone, [Shard(0), Replicate()]), "'placements'", "2 entries")
    expect_error(lambda: Layout(everyone + [0], [Replicate()]), "'ranks'", "distinct")
    expect_error(lambda: reshard(good, everyone, dst, **kw), "'src'", "Layout", kind=CommTypeError)
    # still usable
    out = reshard(good, src, dst, **kw)
    check_out("after errors", out, full)


def case_debug_mismatch():
    """COMMLIB_DEBUG=1: rank 0 asks for another destination layout than the others: every rank
    gets CommMismatchError, and the group still works afterwards."""
    if os.environ.get("COMMLIB_DEBUG") != "1":
        return
    rank, n = world()
    everyone = list(range(n))
    src = Layout(everyone, [Shard(0)])
    dst = Layout(everyone, [Replicate()] if rank == 0 else [Shard(0)])
    full = make_full(95, (2 * n, 3), torch.float32, False)
    local = source_shard(full, everyone, [Shard(0)], rank, 95)
    for kw in (dict(global_shape=(2 * n, 3), dtype=torch.float32), {}):
        expect_error(lambda kw=kw: reshard(local, src, dst, **kw), "reshard",
                     kind=CommMismatchError)
    out = reshard(local, src, Layout(everyone, [Replicate()]))
    check_out("after mismatch", out, full)



def case_dtensor():
    """Where source and destination share one mesh over the world: DTensor.redistribute on gloo
    (a second oracle) equals reshard, on 1-D and (even n) 2-D meshes, float32 and int64."""
    rank, n = world()
    try:
        from torch.distributed.tensor import DeviceMesh, DTensor
        from torch.distributed.tensor import Partial as DPartial
        from torch.distributed.tensor import Replicate as DReplicate
        from torch.distributed.tensor import Shard as DShard
    except ImportError as exc:
        if rank == 0:
            print(f"dtensor skipped: torch.distributed.tensor unavailable ({exc})", flush=True)
        return
    init_gloo()

    def to_dt(p):
        return (DShard(p.dim) if isinstance(p, Shard) else
                DPartial() if isinstance(p, Partial) else DReplicate())

    meshes = [[list(range(n))]]
    if n % 2 == 0 and n >= 4:
        meshes.append([list(range(k * (n // 2), (k + 1) * (n // 2))) for k in range(2)])
    compared = 0
    for mi, ranks in enumerate(meshes):
        ranks = ranks[0] if len(ranks) == 1 else ranks
        dmesh = DeviceMesh("cpu", torch.tensor(ranks))
        rng = random.Random(500 + n + mi)
        for i in range(6):
            shape = tuple(rng.choice([2, 4, 6, 8]) for _ in range(rng.randint(1, 3)))
            src_pl = random_placements(rng, len(shape_of(ranks)), len(shape), True)
            dst_pl = random_placements(rng, len(shape_of(ranks)), len(shape), False)
            dtype = (torch.float32, torch.int64)[i % 2]
            seed = 600 + 10 * mi + i
            full = make_full(seed, shape, dtype, True)
            local = source_shard(full, ranks, src_pl, rank, seed)
            dt = DTensor.from_local(local, dmesh, [to_dt(p) for p in src_pl], run_check=False,
                                    shape=full.shape, stride=full.stride())
            theirs = dt.redistribute(dmesh, [to_dt(p) for p in dst_pl]).to_local()
            ours = reshard(local, Layout(ranks, src_pl), Layout(ranks, dst_pl),
                           global_shape=shape, dtype=dtype)
            what = f"dtensor {ranks} {shape} {dtype} {src_pl} -> {dst_pl}"
            check_out(what, ours, theirs.contiguous())
            check_out(what + " (oracle)", ours, expected(full, ranks, dst_pl, rank))
            compared += 1
    total = torch.tensor([compared], dtype=torch.int64)
    commlib.all_reduce(total)
    if rank == 0:
        print(f"dtensor compared {int(total) // n} cases on each of {n} ranks", flush=True)


if __name__ == "__main__":
    main(globals())
