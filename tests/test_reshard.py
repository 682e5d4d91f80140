"""commlib.reshard: layouts, the pure planner and (through tests/mpi/reshard_cases.py) the executor.

Part (a) needs no MPI: ``plan(..., hosts=[...])`` is pure. Every expected value is computed here,
independently of the code under test: a rank's box by cutting ``torch.arange`` / the tensor itself
with ``torch.chunk`` in mesh-dimension order (the DTensor rule), the coverage of the destination by
counting, and the bytes of a plan by the logical convention (a send costs the sender n, the
broadcast chain each of its ranks but the last n, the all-gather mode the tile once plus each receiver its own part
m-1 times, a Partial all-reduce 2(g-1)/g·n per rank, floored), or by hand for small cases.

Part (b) runs tests/mpi/reshard_cases.py under mpiexec at 2, 3, 4 and 5 ranks (one job each; at 3
ranks under COMMLIB_DEBUG=1, where the layout-mismatch case runs; at 4 and 5 ranks on virtual
hosts, so that bytes split into cross-host and intra-host ones).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import commlib
from commlib.reshard import Layout, Partial, Replicate, Shard, plan
from commlib.tuning.model import LinkCost, Table
from conftest import ROOT, base_env, run_mpi

sys.path.insert(0, str(ROOT / "tests" / "mpi"))
from _reshard import chunk_piece, coords, flat, random_mesh, random_placements  # noqa: E402,I001

F32, I64 = torch.float32, torch.int64
STRATEGIES = ("auto", "sendrecv", "broadcast", "allgather")


# ----- the oracle (independent of commlib.reshard) -----------------------------------------------








def oracle_box(global_shape, ranks, placements, rank):
    """(lo, hi) per dim: non-empty ranges from torch.chunk of index vectors; an empty piece at
    [min(i*cs, n), min((i+1)*cs, n)) of its parent range (SPEC's rule, cs = ceil(n/k))."""
    mesh_shape, c = np.asarray(ranks).shape, coords(ranks, rank)
    box = [(0, n) for n in global_shape]
    for md, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        lo, hi = box[p.dim]
        k, i = mesh_shape[md], c[md]
        pieces = torch.arange(lo, hi).chunk(k)
        if i < len(pieces) and len(pieces[i]):
            box[p.dim] = (int(pieces[i][0]), int(pieces[i][-1]) + 1)
        else:
            cs = -(-(hi - lo) // k)
            box[p.dim] = (lo + min(i * cs, hi - lo),) * 2
    return tuple(box)


def numel(box):
    return math.prod(hi - lo for lo, hi in box)


def contains(outer, inner):
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


def convention_bytes(p, shape, dtype, src_ranks, src_pl, hosts):
    """(sent per rank without zeros, {"cross", "intra"}) from the plan's choices (sender, mode,
    receivers per task) and the logical convention, computed here."""
    sent, link = {}, {"cross": 0, "intra": 0}
    host = (lambda r: hosts[r]) if hosts is not None else (lambda r: 0)

    def add(a, b, n):
        sent[a] = sent.get(a, 0) + n
        link["intra" if host(a) == host(b) else "cross"] += n

    size = itemsize(dtype)
    pdims = [md for md, pl in enumerate(src_pl) if isinstance(pl, Partial)]
    if pdims:
        groups = {}
        for r in flat(src_ranks):
            c = coords(src_ranks, r)
            groups.setdefault(tuple(x for md, x in enumerate(c) if md not in pdims), []).append(r)
        for group in groups.values():
            g = len(group)
            n = numel(oracle_box(shape, src_ranks, src_pl, group[0])) * size
            for k, r in enumerate(group):
                if g > 1:
                    add(r, group[(k + 1) % g], 2 * (g - 1) * n // g)
    for t in p.tasks:
        m, e = len(t.receivers), numel(t.box)
        if t.mode == "sendrecv":
            for r in t.receivers:
                add(t.sender, r, e * size)
        elif t.mode == "broadcast":  # a chain: each rank sends the tile to the next
            order = (t.sender, *t.receivers)
            for a, b in zip(order, order[1:]):
                add(a, b, e * size)
        elif t.mode == "allgather":
            part = -(-e // m)
            for i, r in enumerate(t.receivers):
                mine = (min((i + 1) * part, e) - min(i * part, e)) * size
                add(t.sender, r, mine)
                for b in t.receivers:
                    if b != r:
                        add(r, b, mine)
    return {r: n for r, n in sent.items() if n}, link


def nonzero(d):
    return {r: n for r, n in d.items() if n}


# ----- random layouts ----------------------------------------------------------------------------




def random_case(rng, world):
    shape = tuple(rng.choice([1, 2, 3, 4, 5, 7, 9]) for _ in range(rng.randint(1, 4)))
    src_ranks = random_mesh(rng, rng.sample(range(world), rng.randint(1, world)))
    dst_ranks = random_mesh(rng, rng.sample(range(world), rng.randint(1, world)))
    src_pl = random_placements(rng, np.asarray(src_ranks).ndim, len(shape), True)
    dst_pl = random_placements(rng, np.asarray(dst_ranks).ndim, len(shape), False)
    hosts = [rng.randint(0, 2) for _ in range(world)]
    dtype = rng.choice([F32, I64, torch.bfloat16])
    return shape, dtype, src_ranks, src_pl, dst_ranks, dst_pl, hosts


def random_cases(seed, count):
    rng = random.Random(seed)
    return [random_case(rng, rng.randint(1, 6)) for _ in range(count)]


# ----- (a) layouts -------------------------------------------------------------------------------
BOX_CASES = [
    ((5,), [0, 1, 2, 3], [Shard(0)]),                      # 2, 2, 1, 0: uneven, empty trailing
    ((3,), [4, 0, 2, 1, 3], [Shard(0)]),                   # 1, 1, 1, 0, 0; ranks out of order
    ((6,), [0, 1, 2, 3], [Shard(0)]),                      # 2, 2, 2, 0 (tensor_split: 2, 2, 1, 1)
    ((7, 3), [[0, 1, 2], [3, 4, 5]], [Shard(0), Shard(0)]),  # nested: dim 0 by both mesh dims
    ((7, 3), [[0, 1, 2], [3, 4, 5]], [Shard(1), Shard(1)]),  # nested, pieces of 3 cut by 2 then 3
    ((7, 3), [[0, 1, 2], [3, 4, 5]], [Shard(0), Shard(1)]),
    ((7, 3), [[0, 1, 2], [3, 4, 5]], [Shard(1), Shard(0)]),
    ((7, 3), [[0, 1, 2], [3, 4, 5]], [Replicate(), Shard(1)]),
    ((7, 3), [[0, 1, 2], [3, 4, 5]], [Shard(0), Partial()]),
    ((3, 4, 5), [[0, 1], [2, 3]], [Shard(2), Shard(2)]),
    ((3, 4, 5, 2), [[0, 1], [2, 3]], [Shard(3), Shard(2)]),
    ((3, 4, 5, 2), [[5], [6], [7]], [Shard(0), Shard(3)]),
    ((2, 1, 1, 9), [[0, 1, 2], [3, 4, 5]], [Shard(3), Shard(3)]),  # 9 -> 5, 4 -> 2, 2, 1 / 2, 2, 0
]


@pytest.mark.parametrize("shape,ranks,placements", BOX_CASES)
def test_box_follows_torch_chunk(shape, ranks, placements):
    """Layout.box of every rank against torch.chunk (nested in mesh-dimension order), and the
    piece it names against chunking the tensor itself."""
    lay = Layout(ranks, placements)
    full = torch.arange(math.prod(shape)).reshape(shape)
    mesh_shape = np.asarray(ranks).shape
    for r in flat(ranks):
        box = lay.box(r, shape)
        assert box == oracle_box(shape, ranks, placements, r), (r, box)
        piece = chunk_piece(full, mesh_shape, placements, coords(ranks, r))
        assert tuple(hi - lo for lo, hi in box) == tuple(piece.shape), (r, box, piece.shape)
        assert torch.equal(full[tuple(slice(lo, hi) for lo, hi in box)], piece), r


def test_box_hand_values():
    """The rule written out: chunks of ceil(n/k), trailing smaller or empty (not tensor_split's)."""
    lay = Layout([0, 1, 2, 3], [Shard(0)])
    assert [lay.box(r, (5,)) for r in range(4)] == [((0, 2),), ((2, 4),), ((4, 5),), ((5, 5),)]
    assert [lay.box(r, (6,))[0][1] - lay.box(r, (6,))[0][0] for r in range(4)] == [2, 2, 2, 0]
    assert [len(x) for x in torch.arange(6).tensor_split(4)] == [2, 2, 1, 1]  # not this rule
    nested = Layout([[0, 1, 2], [3, 4, 5]], [Shard(0), Shard(0)])
    # 7 -> [0, 4) and [4, 7); [0, 4) by 3 -> [0,2) [2,4) [4,4); [4, 7) by 3 -> one each
    assert [nested.box(r, (7, 3))[0] for r in range(6)] == [(0, 2), (2, 4), (4, 4), (4, 5),
                                                            (5, 6), (6, 7)]
    assert all(nested.box(r, (7, 3))[1] == (0, 3) for r in range(6))
    assert lay.box(9, (5,)) is None


def test_box_random_sweep():
    """300 random layouts (1-D and 2-D meshes, 1-4 tensor dims, sizes down to 1) against the
    torch.chunk oracle."""
    rng = random.Random(11)
    for _ in range(300):
        shape, _, ranks, pl, _, _, _ = random_case(rng, rng.randint(1, 6))
        lay = Layout(ranks, pl)
        full = torch.arange(math.prod(shape)).reshape(shape)
        for r in flat(ranks):
            box = lay.box(r, shape)
            assert box == oracle_box(shape, ranks, pl, r), (shape, ranks, pl, r, box)
            piece = chunk_piece(full, np.asarray(ranks).shape, pl, coords(ranks, r))
            assert torch.equal(full[tuple(slice(lo, hi) for lo, hi in box)], piece)


def test_layout_shape_ranks_and_array_inputs():
    nested = [[3, 1, 4], [0, 5, 2]]
    for ranks in (nested, np.array(nested), torch.tensor(nested)):
        lay = Layout(ranks, [Shard(0), Replicate()])
        assert tuple(lay.shape) == (2, 3)
        assert tuple(lay.ranks) == (3, 1, 4, 0, 5, 2)
        assert lay.box(5, (4, 6)) == ((2, 4), (0, 6))
        assert lay.box(6, (4, 6)) is None
    one = Layout([7], [Replicate()])
    assert tuple(one.shape) == (1,) and tuple(one.ranks) == (7,)
    assert one.box(7, (2, 3)) == ((0, 2), (0, 3))


def test_placements_are_frozen_values():
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0)
    assert Replicate() == Replicate() and Partial() == Partial("sum")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Shard(1).dim = 2


def test_layout_shard_helper():
    """Layout.shard: the box of the full tensor (a copy); along Partial mesh dims the full value
    on coordinate 0 and zeros elsewhere, so the pieces sum to the tensor."""
    full = torch.arange(35, dtype=F32).reshape(7, 5)
    ranks = [[0, 1, 2], [3, 4, 5]]
    for pl in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Shard(1)]):
        lay = Layout(ranks, pl)
        for r in range(6):
            piece = lay.shard(full, r)
            assert torch.equal(piece, chunk_piece(full, (2, 3), pl, coords(ranks, r))), (pl, r)
            piece.fill_(-1)
        assert full.min() >= 0, "shard() must return a copy"
    lay = Layout(ranks, [Partial(), Shard(1)])
    total = torch.zeros_like(full)
    for r in range(6):
        c = coords(ranks, r)
        piece = lay.shard(full, r)
        want = chunk_piece(full, (2, 3), [Replicate(), Shard(1)], c)
        assert torch.equal(piece, want if c[0] == 0 else torch.zeros_like(want)), r
        lo, hi = lay.box(r, full.shape)[1]
        total[:, lo:hi] += piece
    assert torch.equal(total, full)
    assert lay.shard(full, 9) is None


# ----- (a) the planner ---------------------------------------------------------------------------
def _plan_of(case, strategy="auto"):
    shape, dtype, sr, sp, dr, dp, hosts = case
    return plan(shape, dtype, Layout(sr, sp), Layout(dr, dp), strategy=strategy, hosts=hosts)


def _task_tuple(t):
    return (tuple(map(tuple, t.box)), t.nbytes, tuple(t.senders), t.sender, tuple(t.receivers),
            tuple(t.local), t.mode)


def _summary(p):
    return {"tasks": [_task_tuple(t) for t in p.tasks], "sent": sorted(nonzero(p.sent).items()),
            "links": p.bytes_by_link, "str": str(p), "predicted": p.predicted_s}


def test_plan_covers_every_destination_element_once():
    """120 random plans (1-6 ranks, meshes overlapping or not, Partial sources, random hosts,
    every strategy): per destination rank the tasks naming it tile its box exactly once; every
    task is non-empty, its senders are exactly the source ranks holding it, its chosen sender one
    of them, its local receivers hold it, its network receivers do not; bytes by the convention."""
    for i, case in enumerate(random_cases(5, 120)):
        shape, dtype, sr, sp, dr, dp, hosts = case
        strategy = STRATEGIES[i % 4]
        p = _plan_of(case, strategy)
        what = (i, case, strategy)
        assert p.strategy == strategy and tuple(p.global_shape) == shape and p.dtype == dtype
        src_boxes = {r: oracle_box(shape, sr, sp, r) for r in flat(sr)}
        count = {r: torch.zeros(shape, dtype=torch.int32) for r in flat(dr)}
        for t in p.tasks:
            box = tuple(map(tuple, t.box))
            assert numel(box) > 0 and t.nbytes == numel(box) * itemsize(dtype), (what, t)
            holders = {r for r, b in src_boxes.items() if contains(b, box)}
            assert set(t.senders) == holders, (what, t)
            assert set(t.local) <= holders and not set(t.receivers) & holders, (what, t)
            if t.mode == "local":
                assert not t.receivers and t.sender is None and t.local, (what, t)
            else:
                assert t.receivers and t.sender in holders, (what, t)
                assert t.mode in ("sendrecv", "broadcast", "allgather"), (what, t)
                if strategy != "auto" and len(t.receivers) > 1:
                    assert t.mode == strategy, (what, t)
                if len(t.receivers) == 1:
                    assert t.mode == "sendrecv", (what, t)
            for r in (*t.receivers, *t.local):
                assert r in count, (what, t)
                count[r][tuple(slice(lo, hi) for lo, hi in box)] += 1
        for r, c in count.items():
            want = torch.zeros(shape, dtype=torch.int32)
            want[tuple(slice(lo, hi) for lo, hi in oracle_box(shape, dr, dp, r))] = 1
            assert torch.equal(c, want), (what, r)
        sent, link = convention_bytes(p, shape, dtype, sr, sp, hosts)
        assert nonzero(p.sent) == sent, (what, p.sent, sent)
        assert p.bytes_by_link == link, (what, p.bytes_by_link, link)
        assert sum(p.sent.values()) == link["cross"] + link["intra"]
        assert math.isfinite(p.predicted_s) and p.predicted_s >= 0
        assert (p.predicted_s > 0) == (sum(link.values()) > 0), (what, p.predicted_s)


def test_plan_is_deterministic_in_and_across_processes():
    """The same plan from the same inputs: twice here, from array-typed ranks, and in two fresh
    interpreters with different hash seeds (every rank must compute the same plan)."""
    cases = random_cases(21, 25)
    here = []
    for i, case in enumerate(cases):
        a, b = _plan_of(case, STRATEGIES[i % 4]), _plan_of(case, STRATEGIES[i % 4])
        assert _summary(a) == _summary(b), i
        shape, dtype, sr, sp, dr, dp, hosts = case
        c = plan(shape, dtype, Layout(np.array(sr), sp), Layout(torch.tensor(dr), dp),
                 strategy=STRATEGIES[i % 4], hosts=np.array(hosts).tolist())
        assert _summary(a) == _summary(c), i
        here.append(json.loads(json.dumps({k: v for k, v in _summary(a).items() if k != "str"})))
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_reshard as T; "
            "print(json.dumps([{k: v for k, v in T._summary(T._plan_of(c, T.STRATEGIES[i % 4]))"
            ".items() if k != 'str'} for i, c in enumerate(T.random_cases(21, 25))]))")
    for seed in ("1", "2"):
        env = base_env(PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                             capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1]) == here, seed


L8 = 8 * 4  # bytes of an (8,) float32 tensor


@pytest.mark.parametrize("strategy,sent,links", [
    ("allgather", {0: L8, 1: L8 // 2, 2: L8 // 2}, {"cross": L8, "intra": L8}),
    ("sendrecv", {0: 2 * L8}, {"cross": 2 * L8, "intra": 0}),
    ("broadcast", {0: L8, 1: L8}, {"cross": L8, "intra": L8}),
])
def test_bytes_one_to_two_across_hosts(strategy, sent, links):
    """Rank 0 (host 0) to ranks 1 and 2 (host 1), replicated: all-gather mode sends each byte
    across once (then the halves swap inside host 1), so does the broadcast chain (0 -> 1 -> 2);
    send/recv sends it twice."""
    p = plan((8,), F32, Layout([0], [Replicate()]), Layout([1, 2], [Replicate()]),
             strategy=strategy, hosts=[0, 1, 1])
    assert nonzero(p.sent) == sent
    assert p.bytes_by_link == links
    assert [(t.sender, tuple(t.receivers), t.mode) for t in p.tasks] == [(0, (1, 2), strategy)]


def test_broadcast_chain_enters_each_host_once():
    """The chain runs through the sender's host-mates first, then host by host: rank 0 (host 0)
    to 1 (host 0), then 2 (host 1) -> 4 (host 1) -> 3 (host 2): two crossings, n each."""
    n = 4 * 4 * 4
    p = plan((4, 4), F32, Layout([0], [Replicate()]), Layout([3, 4, 2, 1], [Replicate()]),
             strategy="broadcast", hosts=[0, 0, 1, 2, 1])
    assert [(t.sender, t.receivers) for t in p.tasks] == [(0, (1, 2, 4, 3))]
    assert nonzero(p.sent) == {0: n, 1: n, 2: n, 4: n}
    assert p.bytes_by_link == {"cross": 2 * n, "intra": 2 * n}


def test_bytes_allgather_uneven_parts():
    """7 int64 elements to 3 receivers: parts of ceil(7/3) = 3, the last smaller; the sender
    sends 3+3+1 elements (the tile once), each receiver its own part to the 2 others. (SPEC.md
    said padded parts; the planner's docstring: the last parts smaller or empty.)"""
    p = plan((7,), I64, Layout([0], [Replicate()]), Layout([1, 2, 3], [Replicate()]),
             strategy="allgather", hosts=[0, 1, 1, 1])
    assert nonzero(p.sent) == {0: 56, 1: 48, 2: 48, 3: 16}
    assert p.bytes_by_link == {"cross": 56, "intra": 112}
    # 2 elements to 3 receivers: parts 1, 1, 0 -- the third receiver forwards nothing
    p = plan((2,), I64, Layout([0], [Replicate()]), Layout([1, 2, 3], [Replicate()]),
             strategy="allgather", hosts=[0, 0, 0, 0])
    assert nonzero(p.sent) == {0: 16, 1: 16, 2: 16}


def test_bytes_partial_source():
    """Partial over ranks 0, 1 (host 0) to rank 2 (host 1): a 2-rank all-reduce (n each, intra),
    then the sum from one of them across (n)."""
    p = plan((8,), F32, Layout([0, 1], [Partial()]), Layout([2], [Replicate()]), hosts=[0, 0, 1])
    (t,) = p.tasks
    assert set(t.senders) == {0, 1} and tuple(t.receivers) == (2,)
    assert nonzero(p.sent) == {t.sender: 2 * L8, 1 - t.sender: L8}
    assert p.bytes_by_link == {"cross": L8, "intra": 2 * L8}
    # 3 ranks, 5 int64 (40 bytes): 2*2/3*40 = 53.3 -> 53 each; the sums are already in place
    p = plan((5,), I64, Layout([0, 1, 2], [Partial()]), Layout([2, 0, 1], [Replicate()]),
             hosts=[0, 0, 0])
    assert nonzero(p.sent) == {0: 53, 1: 53, 2: 53}
    assert p.bytes_by_link == {"cross": 0, "intra": 159}
    assert all(t.mode == "local" for t in p.tasks)
    # 2x2, rows sharded, columns partial; ring successors 0->1, 1->0 on different hosts
    p = plan((6,), F32, Layout([[0, 1], [2, 3]], [Shard(0), Partial()]),
             Layout([[0, 1], [2, 3]], [Shard(0), Replicate()]), hosts=[0, 1, 0, 1])
    assert nonzero(p.sent) == {0: 12, 1: 12, 2: 12, 3: 12}
    assert p.bytes_by_link == {"cross": 48, "intra": 0}


def test_bytes_shard_to_replicate_and_identity():
    p = plan((6, 2), F32, Layout([0, 1], [Shard(0)]), Layout([0, 1], [Replicate()]),
             hosts=[0, 1])
    assert nonzero(p.sent) == {0: 24, 1: 24}
    assert p.bytes_by_link == {"cross": 48, "intra": 0}
    # two tiles, each copied by its holder and sent to the other rank
    assert sorted((t.sender, tuple(t.receivers), tuple(t.local), t.mode) for t in p.tasks) == \
        [(0, (1,), (0,), "sendrecv"), (1, (0,), (1,), "sendrecv")]
    same = Layout([[0, 1], [2, 3]], [Shard(1), Shard(0)])
    p = plan((5, 3), F32, same, Layout([[0, 1], [2, 3]], [Shard(1), Shard(0)]), hosts=[0, 1, 0, 1])
    assert nonzero(p.sent) == {} and p.bytes_by_link == {"cross": 0, "intra": 0}
    assert all(t.mode == "local" and t.sender is None for t in p.tasks)
    assert p.predicted_s == 0


def test_sender_load_balancing():
    """A source replicated on ranks 0 and 1 feeding ranks 2 and 3 that want different halves:
    each sender gets one task; with four quarters, two each."""
    for strategy in STRATEGIES:
        p = plan((8,), F32, Layout([0, 1], [Replicate()]), Layout([2, 3], [Shard(0)]),
                 strategy=strategy, hosts=[0, 0, 0, 0])
        assert len(p.tasks) == 2 and sorted(t.sender for t in p.tasks) == [0, 1], strategy
        assert nonzero(p.sent) == {0: 16, 1: 16}, strategy
    p = plan((8, 4), F32, Layout([0, 1], [Replicate()]), Layout([[2, 3], [4, 5]],
             [Shard(0), Shard(1)]), hosts=[0, 0, 1, 1, 1, 1])
    assert len(p.tasks) == 4 and sorted(t.sender for t in p.tasks) == [0, 0, 1, 1]
    assert nonzero(p.sent) == {0: 64, 1: 64}


def test_strategy_forcing():
    """One tile to three receivers: the forced mode is the task's mode, and its bytes follow."""
    n = 6 * 4 * 4
    want = {"sendrecv": {0: 3 * n}, "broadcast": {0: n, 1: n, 2: n},
            "allgather": {0: n, 1: 2 * n // 3, 2: 2 * n // 3, 3: 2 * n // 3}}
    for strategy, sent in want.items():
        p = plan((6, 4), F32, Layout([0], [Replicate()]), Layout([1, 2, 3], [Replicate()]),
                 strategy=strategy, hosts=[0, 1, 1, 1])
        assert p.strategy == strategy
        assert [t.mode for t in p.tasks] == [strategy]
        assert nonzero(p.sent) == sent, strategy
    auto = plan((6, 4), F32, Layout([0], [Replicate()]), Layout([1, 2, 3], [Replicate()]),
                hosts=[0, 1, 1, 1])
    assert auto.strategy == "auto" and auto.tasks[0].mode in want
    # single-receiver tasks are sends whatever is forced
    for strategy in STRATEGIES:
        p = plan((4,), F32, Layout([0, 1], [Shard(0)]), Layout([0, 1], [Replicate()]),
                 strategy=strategy, hosts=[0, 0])
        assert [(t.mode, t.sender, tuple(t.receivers), tuple(t.local)) for t in p.tasks] == \
            [("sendrecv", 0, (1,), (0,)), ("sendrecv", 1, (0,), (1,))]


def test_auto_sends_each_byte_across_once_on_a_slow_link():
    """A 4 MiB tensor from host 0 to two ranks of host 1 over a slow host link (100 MB/s, fast
    links inside hosts): auto takes a mode that crosses once (the all-gather mode or the
    broadcast chain), cross bytes == the tensor's bytes, and the predicted time is at least the
    link bound (bytes that must cross / link rate)."""
    fast = LinkCost.from_bandwidth(1.0, 10.0)
    slow = LinkCost.from_bandwidth(50.0, 0.1)
    table = Table(fast, local=2, inter=slow, shm=fast)
    n = (1 << 20) * 4
    p = plan((1 << 20,), F32, Layout([0], [Replicate()]), Layout([2, 3], [Replicate()]),
             hosts=[0, 0, 1, 1], table=table)
    assert p.tasks[0].mode in ("allgather", "broadcast")
    assert p.bytes_by_link["cross"] == n
    assert p.predicted_s >= n / 0.1e9
    forced = plan((1 << 20,), F32, Layout([0], [Replicate()]), Layout([2, 3], [Replicate()]),
                  hosts=[0, 0, 1, 1], table=table, strategy="sendrecv")
    assert forced.bytes_by_link["cross"] == 2 * n
    assert forced.predicted_s > p.predicted_s
    # the table prices the plan: a 10x slower host link, a slower prediction
    slower = Table(fast, local=2, inter=LinkCost.from_bandwidth(50.0, 0.01), shm=fast)
    p10 = plan((1 << 20,), F32, Layout([0], [Replicate()]), Layout([2, 3], [Replicate()]),
               hosts=[0, 0, 1, 1], table=slower)
    assert p10.predicted_s > 5 * p.predicted_s


def test_default_hosts_one_host_without_init():
    if commlib.is_initialized():
        pytest.skip("commlib is initialized in this process (another test's fixture)")
    p = plan((8,), F32, Layout([0], [Replicate()]), Layout([1, 2], [Replicate()]))
    assert p.bytes_by_link["cross"] == 0 and p.bytes_by_link["intra"] > 0


def test_plan_checks_ranks_against_the_initialized_group():
    """Once commlib is initialized (here one process, backend 'self'), plan() checks the
    layouts' ranks against the world group."""
    if commlib.is_initialized():
        pytest.skip("commlib is initialized in this process (another test's fixture)")
    commlib.init(backend="self")
    try:
        p = plan((4,), F32, Layout([0], [Shard(0)]), Layout([0], [Replicate()]))
        assert nonzero(p.sent) == {} and [t.mode for t in p.tasks] == ["local"]
        _raises(commlib.CommArgumentError,
                lambda: plan((4,), F32, Layout([0], [Shard(0)]), Layout([0, 1], [Replicate()])),
                "'dst'", "[1]", "not in the group")
        _raises(commlib.CommArgumentError,
                lambda: plan((4,), F32, Layout([2], [Shard(0)]), Layout([0], [Replicate()]),
                             group=commlib.get_world_group()), "'src'", "[2]", "not in the group")
    finally:
        commlib.finalize()


def test_str_has_one_line_per_task():
    p = plan((7, 5), F32, Layout([[0, 1], [2, 3]], [Shard(0), Partial()]),
             Layout([4, 1, 5], [Shard(1)]), hosts=[0, 0, 1, 1, 2, 2])
    text = str(p)
    lines = text.splitlines()
    assert len(p.tasks) >= 3
    for t in p.tasks:
        tile = "[" + ", ".join(f"{lo}:{hi}" for lo, hi in t.box) + "]"
        rows = [line for line in lines if tile in line]
        assert len(rows) == 1 and t.mode in rows[0], (tile, text)
    assert len(lines) > len(p.tasks)


# ----- (a) errors --------------------------------------------------------------------------------
def _raises(kind, fn, *words):
    with pytest.raises(kind) as info:
        fn()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert "Fix:" in str(info.value), str(info.value)


def test_errors_layout():
    A, T = commlib.CommArgumentError, commlib.CommTypeError
    _raises(A, lambda: Layout([0, 1, 0], [Replicate()]), "'ranks'", "[0, 1, 0]", "distinct")
    _raises(A, lambda: Layout([[0, 1], [1, 2]], [Replicate(), Replicate()]), "'ranks'", "distinct")
    _raises(A, lambda: Layout([0, -1], [Replicate()]), "'ranks'", "-1")
    _raises(A, lambda: Layout([[0, 1], [2, 3]], [Shard(0)]), "'placements'", "Shard(0)",
            "1 entries", "2-dimensional", "(2, 2)")
    _raises(A, lambda: Layout([0, 1], [Shard(0), Replicate()]), "'placements'", "2 entries",
            "1-dimensional")
    _raises(A, lambda: Layout([0, 1], [Partial("max")]), "'placements'", "max", '"sum"')
    _raises(A, lambda: Layout([0, 1], [Shard(-1)]), "'placements'", "Shard(-1)")
    _raises(T, lambda: Layout([0, 1], ["S0"]), "'placements'", "'S0'")
    # a mesh whose rows differ in length has no shape
    _raises((A, T), lambda: Layout([[0, 1], [2]], [Replicate(), Replicate()]), "'ranks'",
            "[[0, 1], [2]]", "regular shape")
    _raises(T, lambda: Layout("01", [Replicate()]), "'ranks'")


def test_errors_plan():
    A, T = commlib.CommArgumentError, commlib.CommTypeError
    src, dst = Layout([0, 1], [Shard(0)]), Layout([2], [Replicate()])
    h = [0, 0, 0, 0]
    _raises(A, lambda: plan((4,), F32, Layout([0, 1], [Shard(1)]), dst, hosts=h), "'src'",
            "Shard(1)", "dimension 1", "1-dimensional")
    _raises(A, lambda: plan((4, 2), F32, src, Layout([[0], [1]], [Replicate(), Shard(2)]),
                            hosts=h), "'dst'", "Shard(2)", "2-dimensional")
    _raises(A, lambda: plan((4,), F32, src, Layout([2, 3], [Partial()]), hosts=h), "'dst'",
            "Partial")
    _raises(A, lambda: plan((4,), F32, src, dst, strategy="ring", hosts=h), "'strategy'",
            "'ring'", "allgather", "broadcast", "sendrecv")
    _raises(T, lambda: plan((4,), "float32", src, dst, hosts=h), "'dtype'")
    _raises(T, lambda: plan((4,), F32, [0, 1], dst, hosts=h), "'src'", "Layout")


# ----- (b) on real ranks -------------------------------------------------------------------------
CASES = ["case_random", "case_strategies_dtypes", "case_bytes_by_hand", "case_mesh_layouts",
         "case_async_and_cache", "case_small_tiles_many_receivers", "case_group", "case_dtensor",
         "case_async_order", "case_errors"]
# world size -> (virtual hosts of the ranks, COMMLIB_DEBUG)
JOBS = {2: ("", False), 3: ("", True), 4: ("a,a,b,b", False), 5: ("a,b,a,b,a", False)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", sorted(JOBS))
def test_reshard_mpi(n):
    """The cases of tests/mpi/reshard_cases.py at n ranks: random layouts exact against the
    sliced full tensor, every strategy, float32/bfloat16/int64, async, bytes counted against the
    plan, errors on every rank, DTensor.redistribute on gloo as a second oracle; at 3 ranks under
    COMMLIB_DEBUG=1 (plus the layout-mismatch case); at 4 and 5 on two virtual hosts."""
    hosts, debug = JOBS[n]
    env = {"RESHARD_TEST_HOSTS": hosts} if hosts else {}
    if debug:
        env["COMMLIB_DEBUG"] = "1"
    cases = CASES + (["case_debug_mismatch"] if debug else [])
    out = run_mpi(n, "reshard_cases.py", *cases, timeout=190, **env).stdout
    for case in cases:
        assert f"ok {case} (world size {n})" in out, out
    assert "dtensor compared" in out or "dtensor skipped" in out, out


def test_case_list_is_complete():
    """Every case of the MPI file runs in some job."""
    text = (ROOT / "tests" / "mpi" / "reshard_cases.py").read_text()
    defined = {line.split("(")[0][4:] for line in text.splitlines() if line.startswith("def case_")}
    assert defined == set(CASES) | {"case_debug_mismatch"}, defined
    assert os.path.exists(ROOT / "tests" / "mpi" / "_harness.py")
