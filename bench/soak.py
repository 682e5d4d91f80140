"""soak: thousands of random collectives, every result checked against a reference.

Every rank draws the same sequence of operations from one seed (kind, group, dtype, op, size,
root, blocking or asynchronous), fills its inputs from (seed, operation index, rank), and computes
what every output must be from those same seeds, locally: the reference never comes from the code
under test. The run is bounded by time per backend, and it also watches the process: resident
memory and open file descriptors after a warm-up against the end of the run.

    mpiexec -n 3 .venv/bin/python bench/soak.py --seconds 60            # every backend, 60 s each
    mpiexec -n 4 .venv/bin/python bench/soak.py --backends shm --seconds 1800

Backends (one after the other in the same processes, commlib finalized in between):

| name  | commlib engine                       | COMMLIB_SHM |
|-------|--------------------------------------|-------------|
| mpi   | mpi (mpi4py)                         | 0           |
| shm   | mpi, shared-memory transport on top  | 1           |
| gloo  | torch (gloo process groups)          | 0           |

Exactness. Inputs of reductions are integer-valued and small (SUM/AVG: -8..8, PRODUCT: +-1, +-2,
unsigned types their absolute values) so that every partial result of any summation order is
exactly representable in the dtype, even bfloat16 (|sum| <= 32 at 4 ranks), and the reference is
computed in the dtype itself and compared exactly. AVG is the exact sum divided once: compared
within one unit in the last place (``rtol = eps``), since the division's rounding may go through
float32. MIN/MAX/bitwise inputs use the dtype's range. Data movement (gather, scatter, broadcast,
all-to-all, send/recv) moves random bytes and is compared bit for bit.

Inputs are slices of a random pool (17 MiB per value domain, from the seed) at offsets hashed from
(seed, index, rank, part), so filling a buffer costs one copy and any rank can rebuild any other's.

Output, rank 0 (one line per backend): ops, ops/s, bytes moved (the bytes the operations'
definitions deliver into outputs, summed over ranks: an all-reduce of B bytes on n ranks moves
n*B, a broadcast (n-1)*B, an all-gather of n blocks of b to n ranks n*n*b, a send B), #wrong
(operations whose result was wrong on at least one rank), and the growth of RSS and open file
descriptors from the end of the warm-up to the end of the run. RSS is read from /proc/self/statm
after ``gc.collect()`` and glibc's ``malloc_trim(0)`` (freed heap returned to the system, so the
figure is live memory, not the allocator's cache); the largest growth over ranks is printed.
glibc's mmap threshold is pinned at 128 KiB first (see ``_pin_malloc``): otherwise the freed tail
of each thread's arena stays resident, which ``malloc_trim`` does not return.
Exit status 1 if any result was wrong or a growth exceeds ``--rss-tolerance`` /
``--fd-tolerance``, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

# UCX (MPICH's ch4:ucx netmod) queues a registration-cache invalidation entry for every munmap in
# the process, in memory of its own, and frees the queue only when UCX next registers memory,
# which never happens while every rank is on one host: RSS then grows ~135 bytes per freed
# buffer, with or without commlib (docs/reliability.md: a plain torch loop after
# `from mpi4py import MPI` grows 135 B/op; with the cache off, 0). The soak measures commlib's
# memory, so it turns UCX's cache off before MPI starts, unless --ucx-rcache keeps it.
if "--ucx-rcache" not in sys.argv:
    os.environ.setdefault("UCX_RCACHE_ENABLE", "no")

from mpi4py import MPI  # noqa: E402

import commlib  # noqa: E402
from commlib import ReduceOp  # noqa: E402

MiB = 1 << 20
POOL_BYTES = 17 * MiB
MAX_BYTES = 16 * MiB

# ----- dtypes and ops, with the special cases next to them ------------------------------------
DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32,
    "int64": torch.int64, "bool": torch.bool,
}
FLOAT_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
INT_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
           ReduceOp.BOR, ReduceOp.BXOR)
# bool: commlib's documented rule (ProcessGroupNCCL's): SUM and MAX are OR, PRODUCT and MIN AND.
# AVG is rejected on integers and bool, bitwise ops on floats.
BOOL_AS = {ReduceOp.SUM: ReduceOp.BOR, ReduceOp.MAX: ReduceOp.BOR, ReduceOp.BOR: ReduceOp.BOR,
           ReduceOp.PRODUCT: ReduceOp.BAND, ReduceOp.MIN: ReduceOp.BAND,
           ReduceOp.BAND: ReduceOp.BAND, ReduceOp.BXOR: ReduceOp.BXOR}
COMBINE: dict[ReduceOp, Callable] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum, ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor,
}
# The value domain of each op's inputs (see the module docstring for why).
DOMAIN = {ReduceOp.SUM: "small", ReduceOp.AVG: "small", ReduceOp.PRODUCT: "prod"}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ops_for(dtype: torch.dtype) -> tuple:
    return FLOAT_OPS if dtype.is_floating_point else INT_OPS


# ----- the seeded inputs ------------------------------------------------------------------------
class Pools:
    """Random bytes from the seed, in three domains: ``raw`` (any bits), ``small`` (int8 -8..8),
    ``prod`` (int8 -2, -1, 1, 2). An input is a slice at an offset hashed from its key."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.raw = torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, generator=g)
        self.small = torch.randint(-8, 9, (POOL_BYTES,), dtype=torch.int8, generator=g)
        self.prod = torch.tensor([-2, -1, 1, 2], dtype=torch.int8)[
            torch.randint(0, 4, (POOL_BYTES,), generator=g)]
        self.seed = seed

    def _offset(self, key: tuple, nbytes: int) -> int:
        # hash() of a tuple of ints is the same in every process (only str/bytes are salted)
        return (hash((self.seed, *key)) % (POOL_BYTES - nbytes + 1)) & ~7

    def values(self, key: tuple, count: int, dtype: torch.dtype, rop: ReduceOp | None) -> torch.Tensor:
        """A read-only tensor of ``count`` elements of ``dtype``: rank ``key[1]``'s input ``key``
        for reduction ``rop`` (None: data movement, any bits)."""
        if count * dtype.itemsize > POOL_BYTES - 8:
            raise ValueError(f"soak: an input of {count} x {dtype} is larger than the pool")
        if dtype is torch.bool:
            src = self.raw[self._offset(key, count):][:count]
            return (src & 1).bool()
        domain = DOMAIN.get(rop) if rop is not None else None
        if domain is None and (rop is None or not dtype.is_floating_point):
            item = dtype.itemsize
            off = self._offset(key, count * item)
            return self.raw[off:off + count * item].view(dtype)
        # small integers (or, for float MIN/MAX, int8's range): exact in every float dtype
        pool = self.raw.view(torch.int8) if domain is None else getattr(self, domain)
        v = pool[self._offset(key, count):][:count]
        if dtype is torch.uint8:
            v = v.abs()
        return v.to(dtype)


# ----- groups: subgroups of the world and mesh dimensions ---------------------------------------
@dataclass
class GroupChoice:
    """A communicator every rank agrees on by index: a ``new_group`` (members only take part) or
    a mesh dimension (every rank takes part, in its own line)."""
    name: str
    size: int                            # ranks in the (each) group
    group: commlib.Group | None          # this rank's group, None if not a member
    ranks: list[int]                     # world ranks of this rank's group


def make_groups(world_size: int, rank: int) -> list[GroupChoice]:
    """The world, every subset of 1..n ranks (ranks in a shuffled order too, for n > 2), and the
    dimensions of the meshes the world size allows. Collective over the world."""
    out = [GroupChoice("world", world_size, commlib.get_world_group(), list(range(world_size)))]
    subsets = []
    for mask in range(1, 1 << world_size):
        ranks = [r for r in range(world_size) if mask >> r & 1]
        if len(ranks) < world_size:
            subsets.append(ranks)
    if world_size > 2:
        subsets.append(list(range(world_size))[::-1])  # the world, reversed
    for ranks in subsets:
        g = commlib.new_group(ranks)
        member = rank in ranks
        out.append(GroupChoice(f"new_group{ranks}", len(ranks), g if member else None, ranks))
    shapes = [(1, world_size), (world_size, 1)]
    if world_size == 4:
        shapes.append((2, 2))
    for shape in shapes:
        mesh = commlib.Mesh(shape, ("a", "b"))
        for d, dim in enumerate(("a", "b")):
            g = mesh.group(dim)
            out.append(GroupChoice(f"mesh{shape[0]}x{shape[1]}.{dim}", shape[d], g, list(g.ranks)))
    return out


# ----- one operation ------------------------------------------------------------------------------
@dataclass
class Op:
    """Everything every rank draws in the same order from the shared random stream."""
    index: int
    kind: str
    gi: int
    dtype: torch.dtype
    rop: ReduceOp | None
    nbytes: int
    root: int           # group rank of the root (rooted kinds), of the sender (send_recv)
    peer: int           # group rank of the receiver (send_recv)
    by_group_rank: bool  # give the root as group_src/group_dst instead of a world rank
    async_op: bool
    variant: int        # a kind's own choice (alias, in place, equal splits, ...)
    splits: list[list[int]] = field(default_factory=list)  # [i][j]: rank i sends j (all-to-all)
    width: int = 1


@dataclass
class Pending:
    """A posted operation: its Works (empty when blocking) and the check to run after them."""
    op: Op
    works: list
    check: Callable[[], tuple[int, int, str]]  # -> (wrong elements, bytes moved here, detail)
    outputs: list          # the tensors the check reads (--inject-error corrupts the first)
    keep: object = None    # inputs, alive until the operation completes

    def corrupt(self) -> bool:
        """Flip the lowest bit of one element of the first non-empty output (--inject-error)."""
        for t in self.outputs:
            if t.numel():
                flat = t.view(-1)
                iv = _INT_VIEW[t.element_size()]
                flat[:1].view(iv).bitwise_xor_(1)
                return True
        return False


def compare(got: torch.Tensor, exp: torch.Tensor, approx: bool, bitwise: bool) -> tuple[int, str]:
    """(wrong elements, first difference) of ``got`` against ``exp``."""
    got, exp = got.reshape(-1), exp.reshape(-1)
    if got.numel() != exp.numel():
        return max(got.numel(), exp.numel()), f"{got.numel()} elements, expected {exp.numel()}"
    if got.numel() == 0:
        return 0, ""
    if approx:
        eps = torch.finfo(exp.dtype).eps
        bad = ~torch.isclose(got.double(), exp.double(), rtol=eps, atol=0.0)
    elif bitwise and got.dtype is not torch.bool:
        iv = _INT_VIEW[got.element_size()]
        bad = got.view(iv) != exp.view(iv)
    else:
        bad = got != exp
    n = int(bad.sum())
    if not n:
        return 0, ""
    i = int(bad.nonzero()[0])
    return n, f"element {i}: got {got[i].item()!r}, expected {exp[i].item()!r}"


@dataclass
class Tally:
    """What one rank counted over a backend's run."""
    ops: int = 0
    batches: int = 0
    moved: int = 0
    wrong_ops: list = field(default_factory=list)
    details: list = field(default_factory=list)  # the first wrong results, described
    slow: list = field(default_factory=list)  # steps longer than --slow seconds, described
    kinds: dict = field(default_factory=dict)
    kind_seconds: dict = field(default_factory=dict)  # a batch's time shared by its operations


class Soak:
    """The random stream, the inputs, the references and the calls, for one backend."""

    KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
             "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
             "gather", "scatter", "send_recv", "ring_shift", "all_reduce_coalesced", "barrier")

    def __init__(self, args, groups: list[GroupChoice], rank: int):
        self.args, self.groups, self.rank = args, groups, rank
        self.pools = Pools(args.seed)
        self.rng = random.Random(args.seed)
        self.kinds = [k for k in self.KINDS if k not in args.skip]
        self.index = 0

    # -- drawing -----------------------------------------------------------------------------
    def draw(self, async_op: bool) -> Op:
        r = self.rng
        self.index += 1
        kind = r.choice(self.kinds)
        gchoices = [i for i, g in enumerate(self.groups)
                    if g.size >= 2 or kind not in ("send_recv", "ring_shift")]
        gi = r.choice(gchoices)
        n = self.groups[gi].size
        dtype = DTYPES[r.choice(self.args.dtypes)]
        reduces = kind in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                           "all_reduce_coalesced")
        rop = r.choice(ops_for(dtype)) if reduces else None
        # sizes: 0 B now and then, else log-uniform from 1 B to --max-bytes
        nbytes = 0 if r.random() < 0.04 else int(2 ** r.uniform(0, math.log2(self.args.max_bytes)))
        root = r.randrange(n)
        peer = r.choice([p for p in range(n) if p != root]) if n > 1 else root
        op = Op(self.index, kind, gi, dtype, rop, nbytes, root, peer, r.random() < 0.5,
                async_op, r.randrange(4), width=r.choice((1, 1, 2, 3)))
        if kind in ("all_to_all", "all_to_all_single"):
            rows = max(1, nbytes // dtype.itemsize // op.width // n)
            if op.variant == 0 and kind == "all_to_all_single":  # equal splits (None)
                per = rows // n if rows >= n else 0
                op.splits = [[per] * n for _ in range(n)]
            else:  # uneven, zeros included: n - 1 random cuts of each rank's rows
                op.splits = []
                for _ in range(n):
                    cuts = [0, *sorted(r.randrange(rows + 1) for _ in range(n - 1)), rows]
                    op.splits.append([b - a for a, b in zip(cuts, cuts[1:])])
        return op

    def describe(self, op: Op) -> str:
        return (f"#{op.index} {op.kind} {self.groups[op.gi].name} {str(op.dtype)[6:]} "
                f"{op.rop.name if op.rop else '-'} {op.nbytes} B root {op.root} "
                f"{'async' if op.async_op else 'blocking'} variant {op.variant}")

    def run_batch(self, tally: Tally) -> None:
        """One blocking operation, or 1-4 asynchronous ones waited in a random order (this
        rank's own); then every result checked."""
        if self.rng.random() < self.args.async_share:
            batch = [self.draw(True) for _ in range(self.rng.randint(1, 4))]
        else:
            batch = [self.draw(False)]
        t0 = time.monotonic()
        pending = [p for p in (self.post(op) for op in batch) if p is not None]
        works = [w for p in pending for w in p.works]
        random.Random(hash((self.args.seed, batch[0].index, self.rank))).shuffle(works)
        for w in works:
            w.wait()
        for p in pending:
            if self.args.inject_error and self.rank == 0 and p.op.index % 10 == 0:
                p.corrupt()
            bad, nbytes, why = p.check()
            tally.moved += nbytes
            if bad:
                tally.wrong_ops.append(p.op.index)
                if len(tally.details) < 10:
                    tally.details.append(f"rank {self.rank} {self.describe(p.op)}: {bad} wrong, {why}")
        took = time.monotonic() - t0
        if took > self.args.slow:
            tally.slow.append(f"rank {self.rank}: {took:.1f} s in the step of ops "
                              + ", ".join(self.describe(op) for op in batch))
        spent = took / len(batch)
        tally.ops += len(batch)
        tally.batches += 1
        for op in batch:
            tally.kinds[op.kind] = tally.kinds.get(op.kind, 0) + 1
            tally.kind_seconds[op.kind] = tally.kind_seconds.get(op.kind, 0.0) + spent

    # -- inputs --------------------------------------------------------------------------------
    def data(self, op: Op, r: int, count: int, part: int = 0, rop=None) -> torch.Tensor:
        """Group rank ``r``'s input ``part`` of ``op`` (read-only view or fresh tensor)."""
        return self.pools.values((op.index, r, part), count, op.dtype, rop)

    def reference(self, op: Op, n: int, count: int, part: int = 0, lo: int = 0,
                  hi: int | None = None) -> torch.Tensor:
        """The reduction over the group's ranks of their input ``part`` (elements lo:hi)."""
        rop = op.rop
        if op.dtype is torch.bool:
            rop = BOOL_AS[rop]
        fn = COMBINE[rop]
        acc = None
        for r in range(n):
            x = self.data(op, r, count, part, op.rop)[lo:hi]
            acc = x.clone() if acc is None else fn(acc, x)
        if op.rop is ReduceOp.AVG:
            wide = torch.float32 if op.dtype.itemsize < 4 else op.dtype
            acc = (acc.to(wide) / n).to(op.dtype)
        return acc

    # -- the kinds: each posts its call and returns the check ------------------------------------
    def post(self, op: Op) -> Pending | None:
        gc_ = self.groups[op.gi]
        if gc_.group is None:
            return None
        return getattr(self, "_" + op.kind)(op, gc_.group, gc_.size, gc_.group.rank, gc_.ranks)

    def _root_kw(self, op: Op, ranks: list[int], arg: str) -> dict:
        if op.by_group_rank:
            return {f"group_{arg}": op.root}
        return {arg: ranks[op.root]}

    @staticmethod
    def _works(w) -> list:
        if isinstance(w, list):
            return w
        return [w] if isinstance(w, commlib.Work) else []

    def _count(self, op: Op, per: int = 1) -> int:
        return op.nbytes // op.dtype.itemsize // per

    def _all_reduce(self, op, g, n, me, ranks):
        count = self._count(op)
        t = self.data(op, me, count, rop=op.rop).clone()
        w = commlib.all_reduce(t, op.rop, group=g, async_op=op.async_op)

        def check():
            bad, why = compare(t, self.reference(op, n, count), op.rop is ReduceOp.AVG, False)
            return bad, t.nbytes, why
        return Pending(op, self._works(w), check, [t])

    def _all_reduce_coalesced(self, op, g, n, me, ranks):
        count = self._count(op)
        cuts = sorted(random.Random(op.index).randrange(count + 1) for _ in range(2))
        flat = self.data(op, me, count, rop=op.rop).clone()
        parts = [flat[:cuts[0]].clone(), flat[cuts[0]:cuts[1]].clone().view(-1, 1),
                 flat[cuts[1]:].clone()]
        w = commlib.all_reduce_coalesced(parts, op.rop, group=g, async_op=op.async_op)

        def check():
            got = torch.cat([p.reshape(-1) for p in parts])
            bad, why = compare(got, self.reference(op, n, count), op.rop is ReduceOp.AVG, False)
            return bad, got.nbytes, why
        return Pending(op, self._works(w), check, parts)

    def _reduce(self, op, g, n, me, ranks):
        count = self._count(op)
        mine = self.data(op, me, count, rop=op.rop)
        t = mine.clone()
        w = commlib.reduce(t, op=op.rop, group=g, async_op=op.async_op,
                           **self._root_kw(op, ranks, "dst"))

        def check():
            if me != op.root:  # documented: other ranks' tensors are left unchanged
                bad, why = compare(t, mine, False, True)
                return bad, 0, "non-root changed: " + why if bad else ""
            bad, why = compare(t, self.reference(op, n, count), op.rop is ReduceOp.AVG, False)
            return bad, t.nbytes, why
        return Pending(op, self._works(w), check, [t] if me == op.root else [])

    def _broadcast(self, op, g, n, me, ranks):
        count = self._count(op)
        t = self.data(op, me, count).clone()
        w = commlib.broadcast(t, group=g, async_op=op.async_op, **self._root_kw(op, ranks, "src"))

        def check():
            bad, why = compare(t, self.data(op, op.root, count), False, True)
            return bad, 0 if me == op.root else t.nbytes, why
        return Pending(op, self._works(w), check, [t])

    def _all_gather(self, op, g, n, me, ranks):
        count = self._count(op, n)
        inp = self.data(op, me, count).clone()
        outs = [torch.empty(count, dtype=op.dtype) for _ in range(n)]
        w = commlib.all_gather(outs, inp, group=g, async_op=op.async_op)

        def check():
            got = torch.cat(outs) if outs else torch.empty(0, dtype=op.dtype)
            bad, why = compare(got, torch.cat([self.data(op, r, count) for r in range(n)]), False,
                               True)
            return bad, got.nbytes, why
        return Pending(op, self._works(w), check, outs, inp)

    def _all_gather_into_tensor(self, op, g, n, me, ranks):
        count = self._count(op, n)
        out = torch.empty(n * count, dtype=op.dtype)
        if op.variant == 0:  # in place: the input is this rank's block of the output
            inp = out[me * count:(me + 1) * count]
            inp.copy_(self.data(op, me, count))
        else:
            inp = self.data(op, me, count).clone()
        fn = commlib.all_gather_single if op.variant == 1 else commlib.all_gather_into_tensor
        w = fn(out, inp, group=g, async_op=op.async_op)

        def check():
            exp = torch.cat([self.data(op, r, count) for r in range(n)])
            bad, why = compare(out, exp, False, True)
            return bad, out.nbytes, why
        return Pending(op, self._works(w), check, [out], inp)

    def _reduce_scatter(self, op, g, n, me, ranks):
        count = self._count(op, n)
        ins = [self.data(op, me, count, part=j, rop=op.rop).clone() for j in range(n)]
        out = torch.empty(count, dtype=op.dtype)
        w = commlib.reduce_scatter(out, ins, op.rop, group=g, async_op=op.async_op)

        def check():
            bad, why = compare(out, self.reference(op, n, count, part=me),
                               op.rop is ReduceOp.AVG, False)
            return bad, out.nbytes, why
        return Pending(op, self._works(w), check, [out], ins)

    def _reduce_scatter_tensor(self, op, g, n, me, ranks):
        count = self._count(op, n)
        inp = self.data(op, me, n * count, rop=op.rop).clone()
        out = torch.empty(count, dtype=op.dtype)
        fn = commlib.reduce_scatter_single if op.variant == 1 else commlib.reduce_scatter_tensor
        w = fn(out, inp, op.rop, group=g, async_op=op.async_op)

        def check():
            exp = self.reference(op, n, n * count, lo=me * count, hi=(me + 1) * count)
            bad, why = compare(out, exp, op.rop is ReduceOp.AVG, False)
            return bad, out.nbytes, why
        return Pending(op, self._works(w), check, [out], inp)

    def _all_to_all_single(self, op, g, n, me, ranks):
        k, s = op.width, op.splits
        send_rows = [s[me][j] for j in range(n)]
        recv_rows = [s[i][me] for i in range(n)]
        inp = self.data(op, me, sum(send_rows) * k).clone().view(-1, k)
        out = torch.empty(sum(recv_rows), k, dtype=op.dtype)
        splits = {} if op.variant == 0 else {"output_split_sizes": recv_rows,
                                             "input_split_sizes": send_rows}
        w = commlib.all_to_all_single(out, inp, group=g, async_op=op.async_op, **splits)

        def check():
            exp = []
            for i in range(n):
                src = self.data(op, i, sum(s[i]) * k)
                start = sum(s[i][:me]) * k
                exp.append(src[start:start + s[i][me] * k])
            bad, why = compare(out, torch.cat(exp), False, True)
            return bad, out.nbytes, why
        return Pending(op, self._works(w), check, [out], inp)

    def _all_to_all(self, op, g, n, me, ranks):
        k, s = op.width, op.splits
        ins = [self.data(op, me, s[me][j] * k, part=j).clone().view(-1, k) for j in range(n)]
        outs = [torch.empty(s[i][me], k, dtype=op.dtype) for i in range(n)]
        w = commlib.all_to_all(outs, ins, group=g, async_op=op.async_op)

        def check():
            bad, why, moved = 0, "", 0
            for i in range(n):
                b, y = compare(outs[i], self.data(op, i, s[i][me] * k, part=me), False, True)
                bad, why, moved = bad + b, why or (y and f"from rank {i}: {y}"), moved + outs[i].nbytes
            return bad, moved, why
        return Pending(op, self._works(w), check, outs, ins)

    def _gather(self, op, g, n, me, ranks):
        count = self._count(op, n)
        inp = self.data(op, me, count).clone()
        outs = [torch.empty(count, dtype=op.dtype) for _ in range(n)] if me == op.root else None
        w = commlib.gather(inp, outs, group=g, async_op=op.async_op,
                           **self._root_kw(op, ranks, "dst"))

        def check():
            if outs is None:
                return 0, 0, ""
            got = torch.cat(outs)
            exp = torch.cat([self.data(op, r, count) for r in range(n)])
            bad, why = compare(got, exp, False, True)
            return bad, got.nbytes, why
        return Pending(op, self._works(w), check, outs or [], inp)

    def _scatter(self, op, g, n, me, ranks):
        count = self._count(op, n)
        ins = ([self.data(op, me, count, part=j).clone() for j in range(n)]
               if me == op.root else None)
        out = torch.empty(count, dtype=op.dtype)
        w = commlib.scatter(out, ins, group=g, async_op=op.async_op,
                            **self._root_kw(op, ranks, "src"))

        def check():
            bad, why = compare(out, self.data(op, op.root, count, part=me), False, True)
            return bad, out.nbytes, why
        return Pending(op, self._works(w), check, [out], ins)

    def _send_recv(self, op, g, n, me, ranks):
        """One message from group rank ``root`` to ``peer`` (send/recv, or isend/irecv)."""
        count = self._count(op)
        tag = op.index % 97
        peer_kw = ({"group_dst": op.peer} if op.by_group_rank else {"dst": ranks[op.peer]})
        src_kw = ({"group_src": op.root} if op.by_group_rank else {"src": ranks[op.root]})
        if me == op.root:
            t = self.data(op, me, count).clone()
            fn = commlib.isend if op.async_op else commlib.send
            w = fn(t, group=g, tag=tag, **peer_kw)
            return Pending(op, self._works(w), lambda: (0, 0, ""), [], t)
        if me != op.peer:
            return None
        t = torch.empty(count, dtype=op.dtype)
        fn = commlib.irecv if op.async_op else commlib.recv
        w = fn(t, group=g, tag=tag, **src_kw)

        def check():
            bad, why = compare(t, self.data(op, op.root, count), False, True)
            if not op.async_op and w != ranks[op.root]:  # recv returns the sender's world rank
                bad, why = bad + 1, f"recv returned sender {w}, expected {ranks[op.root]}"
            return bad, t.nbytes, why
        return Pending(op, self._works(w), check, [t])

    def _ring_shift(self, op, g, n, me, ranks):
        """Every rank sends to the next and receives from the previous, posted at once
        (``batch_isend_irecv`` or isend/irecv in a random order); always asynchronous."""
        count = self._count(op)
        nxt, prv = (me + 1) % n, (me - 1) % n
        t = self.data(op, me, count).clone()
        got = torch.empty(count, dtype=op.dtype)
        if op.variant < 2:
            works = commlib.batch_isend_irecv([commlib.P2POp(commlib.isend, t, ranks[nxt], g),
                                               commlib.P2POp(commlib.irecv, got, ranks[prv], g)])
        elif op.variant == 2:
            works = [commlib.irecv(got, group=g, group_src=prv), commlib.isend(t, group=g, group_dst=nxt)]
        else:
            works = [commlib.isend(t, ranks[nxt], g), commlib.irecv(got, ranks[prv], g)]

        def check():
            bad, why = compare(got, self.data(op, prv, count), False, True)
            return bad, got.nbytes, why
        return Pending(op, works, check, [got], t)

    def _barrier(self, op, g, n, me, ranks):
        w = commlib.barrier(group=g, async_op=op.async_op)
        return Pending(op, self._works(w), lambda: (0, 0, ""), [])


# ----- process health -------------------------------------------------------------------------------
try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: RSS then includes the allocator's free memory
    _LIBC = None

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def _pin_malloc() -> None:
    """Blocks of 128 KiB or more mmapped and unmapped on free, whatever thread allocates them.

    gloo allocates its collectives' temporaries on its own worker threads, so in their glibc
    arenas. glibc raises its mmap threshold to the largest block freed (up to 32 MiB) and the
    trim threshold to twice that, and ``malloc_trim(0)`` returns the free top of the main arena
    only: each worker arena then keeps up to 64 MiB of freed memory resident, taken as growth
    (measured on gloo at 3 ranks: +50 MiB in 60 s, malloc's in-use bytes flat at 92 MiB, its
    free bytes 43 -> 183 MiB, all of the growth in thread-arena heaps; with the thresholds
    pinned, +3 to +14 MiB in 90 s with no trend: the samples stay within 324-336 MiB over 9,000
    operations). Pinning them stops the adjustment, so RSS after ``malloc_trim`` is live memory
    on every backend, and a block kept per operation still shows."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
        _LIBC.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)


def health() -> tuple[int, int, dict]:
    """(resident bytes, open file descriptors, the resident bytes by kind: anonymous, file,
    shared memory) of this process, after a collection and, with glibc, ``malloc_trim(0)``."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile", "RssShmem")):
                key, value = line.split(":")
                parts[key] = int(value.split()[0]) * 1024
    return rss, len(os.listdir("/proc/self/fd")), parts


def prime(groups: list[GroupChoice]) -> None:
    """Touch every group's shared-memory segment once, whole, before the warm-up: a one-shot
    all-reduce of two regions' bytes writes both of this rank's regions and reads every peer's
    (docs/shm.md). Segments are mapped at group creation but enter RSS page by page as they are
    first used, which a short run would otherwise count as growth. Groups without a segment run
    the engine's all-reduce instead. Collective over the world (in the groups' order)."""
    slot = commlib.config.get("shm_slot_bytes")
    for choice in groups:
        if choice.group is not None and choice.size > 1:
            t = torch.zeros(2 * slot // 4, dtype=torch.float32)
            commlib.all_reduce(t, group=choice.group, algorithm="shm_oneshot")


# ----- one backend ------------------------------------------------------------------------------------
BACKENDS = {  # name -> (commlib engine, COMMLIB_SHM)
    "mpi": ("mpi", "0"),
    "shm": ("mpi", "1"),
    "gloo": ("torch", "0"),
}


def torch_rendezvous(comm) -> None:
    """torch.distributed's variables from MPI (rank 0's address and a free port), for commlib's
    torch engine under mpiexec. Set once: torch's default group stays for the process's life."""
    if "MASTER_PORT" in os.environ and os.environ.get("WORLD_SIZE") == str(comm.size):
        return
    host = MPI.Get_processor_name()
    hosts = comm.allgather(host)
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    one_host = len(set(hosts)) == 1
    addr = "127.0.0.1" if one_host else socket.gethostbyname(hosts[0])
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    local = sum(1 for h in hosts[:comm.rank] if h == host)
    os.environ.update(RANK=str(comm.rank), WORLD_SIZE=str(comm.size), LOCAL_RANK=str(local),
                      MASTER_ADDR=addr, MASTER_PORT=str(port))


def run_backend(name: str, args, comm) -> dict:
    engine, shm = BACKENDS[name]
    os.environ["COMMLIB_SHM"] = shm
    if engine == "torch":
        torch_rendezvous(comm)
    comm.Barrier()
    commlib.init(backend=engine)
    rank, n = comm.rank, comm.size
    soak = Soak(args, make_groups(n, rank), rank)
    prime(soak.groups)
    comm.Barrier()
    tally = Tally()
    samples: list[tuple] = []
    next_sample = 0.0
    base = None
    t0 = time.monotonic()
    stop = False
    while not stop:
        soak.run_batch(tally)  # its tensors are freed when it returns
        if tally.batches % args.sync_every == 0:
            now = time.monotonic() - t0
            # rank 0's clock decides, so that every rank ends the warm-up (a barrier) and the run
            # after the same operation: with each rank's own clock, one rank could enter the
            # warm-up's barrier while the others went on to the next collective (a hang, seen
            # in CI at 3 ranks on a loaded machine)
            stop, warm = comm.bcast((now >= args.seconds, now >= args.warmup) if rank == 0 else None)
            if base is None and (warm or stop):
                comm.Barrier()
                base = (health(), tally.ops, time.monotonic())
            if now >= next_sample:  # the RSS curve, for the JSON (this rank's own clock)
                samples.append((round(now, 2), tally.ops, health()[0]))
                next_sample = now + args.sample_every
    comm.Barrier()
    elapsed = time.monotonic() - t0
    end = health()
    (rss0, fd0, parts0), ops0, tb = base
    rss_growth = end[0] - rss0
    fd_growth = end[1] - fd0
    commlib.finalize()
    all_wrong = comm.allgather(tally.wrong_ops)
    all_details = [d for ds in comm.gather(tally.details) or [] for d in ds]
    ops = tally.ops
    return {
        "backend": name, "ranks": n, "ops": ops, "seconds": elapsed, "ops_per_s": ops / elapsed,
        "bytes_moved": comm.allreduce(tally.moved), "wrong": len(set().union(*map(set, all_wrong))),
        "rss_growth": comm.allreduce(rss_growth, op=MPI.MAX),
        "fd_growth": comm.allreduce(fd_growth, op=MPI.MAX),
        "rss_end": comm.allreduce(end[0], op=MPI.MAX),
        "rss_parts_growth": comm.allgather({k: end[2][k] - parts0.get(k, 0) for k in end[2]}),
        "measured_ops": ops - ops0, "measured_s": time.monotonic() - tb,
        "rss_samples": comm.gather(samples) if rank == 0 else comm.gather(samples),
        "slow": [x for xs in comm.allgather(tally.slow) for x in xs],
        "kinds": tally.kinds, "kind_seconds": tally.kind_seconds, "details": all_details if rank == 0 else [],
    }


# ----- output -------------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def verdict(row: dict, args) -> list[str]:
    why = []
    if row["wrong"]:
        why.append(f"{row['wrong']} wrong")
    if row["rss_growth"] > args.rss_tolerance * MiB:
        why.append(f"RSS grew {fmt_bytes(row['rss_growth'])} > {args.rss_tolerance} MiB")
    if row["fd_growth"] > args.fd_tolerance:
        why.append(f"{row['fd_growth']} more fds > {args.fd_tolerance}")
    return why


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(t[:-1]) * mult[t[-1]]) if t and t[-1] in mult else int(t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="run time per backend (default 60)")
    p.add_argument("--backends", default="mpi,shm,gloo",
                   help=f"comma-separated, run in this order: {', '.join(BACKENDS)}")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-bytes", type=parse_size, default=MAX_BYTES,
                   help="largest buffer of one rank (default 16M, the largest allowed)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated dtypes to draw")
    p.add_argument("--skip", default="", help="comma-separated kinds not to draw: "
                                              + ", ".join(Soak.KINDS))
    p.add_argument("--async-share", type=float, default=0.4,
                   help="share of batches that are asynchronous (default 0.4)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before the RSS/fd baseline (default: a quarter of --seconds, "
                        "at most 60)")
    p.add_argument("--rss-tolerance", type=float, default=16.0,
                   help="MiB of RSS growth allowed after the warm-up (default 16)")
    p.add_argument("--fd-tolerance", type=int, default=0,
                   help="open file descriptors allowed to appear after the warm-up (default 0)")
    p.add_argument("--sync-every", type=int, default=16,
                   help="batches between the ranks' stop-time checks (default 16)")
    p.add_argument("--slow", type=float, default=10.0,
                   help="report steps that take longer than this many seconds (default 10)")
    p.add_argument("--sample-every", type=float, default=5.0,
                   help="seconds between RSS samples written to the JSON (default 5)")
    p.add_argument("--json", help="write the rows as JSON to this file (rank 0)")
    p.add_argument("--ucx-rcache", action="store_true",
                   help="keep UCX's registration cache on (UCX_RCACHE_ENABLE unset): RSS then "
                        "includes UCX's invalidation queue, ~135 B per freed buffer on one host")
    # for testing the checker: rank 0 corrupts one element of every 10th operation's result
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD
    args = build_parser().parse_args(argv)
    names = [b for b in args.backends.split(",") if b]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.skip = {k for k in args.skip.split(",") if k}
    bad = ([f"--backends: unknown {b!r} (use {', '.join(BACKENDS)})" for b in names
            if b not in BACKENDS]
           + [f"--dtypes: unknown {d!r} (use {', '.join(DTYPES)})" for d in args.dtypes
              if d not in DTYPES]
           + [f"--skip: unknown kind {k!r}" for k in args.skip if k not in Soak.KINDS])
    if not 0 <= args.max_bytes <= MAX_BYTES:
        bad.append(f"--max-bytes must be 0..{MAX_BYTES}")
    if not names or not args.dtypes or args.seconds <= 0 or args.sync_every < 1:
        bad.append("need a backend, a dtype, --seconds > 0 and --sync-every >= 1")
    if bad:
        if comm.rank == 0:
            print("soak.py: " + "; ".join(bad), file=sys.stderr)
        return 2
    if args.warmup is None:
        args.warmup = min(args.seconds / 4, 60.0)
    os.environ.setdefault("COMMLIB_TIMEOUT", "120")  # a hang becomes an error, not a stuck job
    _pin_malloc()
    out = (lambda s: print(s, flush=True)) if comm.rank == 0 else (lambda s: None)
    out(f"# soak: {comm.size} ranks, seed {args.seed}, {args.seconds:g} s per backend "
        f"(warm-up {args.warmup:g} s), sizes 0 B..{fmt_bytes(args.max_bytes)}, "
        f"{args.async_share:.0%} of batches asynchronous")
    out(f"# tolerance: RSS growth <= {args.rss_tolerance:g} MiB, fd growth <= {args.fd_tolerance} "
        f"(max over ranks, end of warm-up to end of run)")
    header = (f"# {'backend':8} {'ranks':>5} {'ops':>8} {'ops/s':>8} {'bytes moved':>12} "
              f"{'GB/s':>6} {'#wrong':>7} {'RSS growth':>11} {'fd growth':>9}  result")
    out(header)
    rows, failed = [], False
    for name in names:
        row = run_backend(name, args, comm)
        why = verdict(row, args)
        failed |= bool(why)
        rows.append({**row, "failures": why})
        out(f"  {name:8} {row['ranks']:>5} {row['ops']:>8} {row['ops_per_s']:>8.1f} "
            f"{fmt_bytes(row['bytes_moved']):>12} {row['bytes_moved'] / row['seconds'] / 1e9:>6.2f} "
            f"{row['wrong']:>7} {('+' if row['rss_growth'] >= 0 else '-') + fmt_bytes(abs(row['rss_growth'])):>11} "
            f"{row['fd_growth']:>+9}  {'OK' if not why else 'FAILED: ' + '; '.join(why)}")
        for d in row["details"]:
            out(f"#   {d}")
        for d in row["slow"][:10]:
            out(f"#   slow: {d}")
    out(f"# {'FAILED' if failed else 'OK'}")
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"nranks": comm.size, "options": {k: (sorted(v) if isinstance(v, set) else v)
                                                        for k, v in vars(args).items()},
                       "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
