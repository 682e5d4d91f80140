"""Run a :class:`~commlib.reshard.planner.ReshardPlan`: collective over a group, every unit task
issued at once.

Phases (each rank takes part in what its tasks name):

1. Partial sources all-reduce their pieces over their replica groups.
2. Every task's transfers are posted together, asynchronously, as sends and receives (user
   channel, tag = the task's index, so that the order of posting cannot mismatch two tasks between
   the same pair of ranks): send/recv's copies, the broadcast chain's first hop, the all-gather
   mode's scatter; local copies.
3. Receivers forward each chunk as it lands: down the broadcast chain to the next rank, or their
   part of the all-gather mode to the other receivers (so the all-gather runs under the scatter
   and the chain is pipelined; in ``wait()`` for ``async_op=True``).
4. Each received tile is copied into the destination shard.

Groups (the Partial replica groups) are created collectively over the
group the first time a plan runs, in the plan's order on every rank, and cached with the plan, so
a training loop that reshards the same layouts pays for them once (Alpa created its NCCL
communicators eagerly for the same reason; leaking them was one of its bugs: here they live as
long as the cache entry, one per distinct plan).
"""

from __future__ import annotations

import torch

import commlib
from commlib.api.entry import DeferredWork, checked_call
from commlib.api.traffic import count
from commlib.errors import CommArgumentError, CommTypeError, arg_error

from .layout import Layout, Shard
from .planner import CHUNK, ReshardPlan, _group_facts, _plan, check_inputs, check_layouts

__all__ = ["reshard", "ReshardWork"]

_MAX_DIMS = 16
_TAG_SPAN = 30000  # user tags 1000..30999: tasks' sends (commlib allows 0..32767)
_SEQ: dict = {}  # group name -> reshard calls so far (the same count on every rank)
_CACHE: dict = {}  # (group ranks, shape, dtype, src, dst, strategy) -> (plan, groups)
_CODES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


class ReshardWork(DeferredWork):
    """The handle of ``reshard(..., async_op=True)``: the transfers travel (commlib's progress
    engine moves them) until ``wait()``, which finishes the plan and returns this rank's
    destination shard (None outside the destination mesh)."""


def _slices(box, within) -> tuple:
    """``box`` as slices of a tensor that holds ``within``."""
    return tuple(slice(lo - wlo, hi - wlo) for (lo, hi), (wlo, _) in zip(box, within))


def _metadata(fn: str, g, local, src: Layout, dst: Layout, strategy: str, global_shape, dtype):
    """(global shape, dtype) from the source ranks' shards: one small all-gather over the group
    (the given ``global_shape`` / ``dtype`` win). A sharded dimension's size is the sum of its
    shards along the mesh dimensions that split it. Every rank then checks every source shard,
    so a wrong one raises on every rank."""
    rank = commlib.get_rank()
    row = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    if rank in src and isinstance(local, torch.Tensor) and local.dim() <= _MAX_DIMS and \
            local.dtype in _CODES:
        row[0], row[1] = local.dim(), _CODES.index(local.dtype)
        row[2:2 + local.dim()] = torch.tensor(local.shape, dtype=torch.int64)
    every = torch.empty((g.size, row.numel()), dtype=torch.int64)
    commlib.all_gather_into_tensor(every, row, group=g)
    rows = {g.ranks[i]: every[i].tolist() for i in range(g.size)}
    bad = [r for r in src.ranks if rows[r][0] < 0]
    kinds = {(rows[r][0], rows[r][1]) for r in src.ranks}
    if bad or len(kinds) != 1:
        raise arg_error(fn, "local", "<source shards>",
                        f"source ranks {bad} passed no tensor (or one of more than {_MAX_DIMS} "
                        f"dimensions or an unknown dtype)" if bad else
                        "source ranks disagree on the number of dimensions or the dtype",
                        "pass every source rank's shard, with one dtype and number of dimensions, "
                        "or pass global_shape= and dtype=")
    (ndim, code), = kinds
    if global_shape is None:
        shape = []
        for t in range(ndim):
            split = [d for d, p in enumerate(src.placements) if isinstance(p, Shard) and p.dim == t]
            shape.append(sum(rows[r][2 + t] for r in src.ranks if all(
                src.coords(r)[d] == 0 for d in range(len(src.shape)) if d not in split)))
        global_shape = tuple(shape)
    dtype = _CODES[code] if dtype is None else dtype
    shape = check_inputs(fn, global_shape, dtype, src, dst, strategy, g.ranks)
    for r in src.ranks:
        want = [hi - lo for lo, hi in src.box(r, shape)]
        if rows[r][2:2 + ndim] != want or ndim != len(shape):
            raise arg_error(fn, "local", f"<rank {r}'s shard of shape {rows[r][2:2 + ndim]}>",
                            f"does not match the source layout: rank {r} holds {want} of "
                            f"{list(shape)} under {src}",
                            "pass each rank's piece as torch.chunk cuts it (uneven shards: the "
                            "trailing ones smaller), or pass global_shape=")
    return shape, dtype


def _groups(p: ReshardPlan, g) -> dict:
    """The plan's groups, created collectively over ``g`` in the plan's order (every rank)."""
    made: dict[tuple, object] = {}

    def make(ranks) -> None:
        ranks = tuple(ranks)
        if len(ranks) > 1 and ranks not in made:
            made[ranks] = commlib.new_group(list(ranks), group=g)

    for ranks, _ in p.partial:
        make(ranks)
    return made


def _landing(out: torch.Tensor, t, dbox, landed: list) -> torch.Tensor:
    """Where task ``t``'s tile is received: straight into the destination shard when the tile is
    a contiguous block of it (a whole shard, rows of it), else a buffer copied in at the end."""
    view = out[_slices(t.box, dbox)]
    if view.is_contiguous():
        return view
    buf = torch.empty(view.shape, dtype=out.dtype)
    landed.append((t, buf))
    return buf


def _chunks(lo: int, hi: int, itemsize: int) -> list[tuple[int, int]]:
    """[lo, hi) in pieces of at most ``CHUNK`` bytes."""
    step = max(CHUNK // itemsize, 1)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def _count(hosts: dict, a: int, b: int, nbytes: int) -> None:
    count("reshard.intra" if hosts.get(a) == hosts.get(b) else "reshard.cross", nbytes)


def reshard(local, src: Layout, dst: Layout, *, global_shape=None, dtype=None, group=None,
            strategy: str = "auto", async_op: bool = False):
    """Move a tensor from layout ``src`` to layout ``dst``: collective over ``group`` (default the
    world; every rank of it calls, with the same layouts). ``local`` is this rank's source shard
    (ignored, may be None, on ranks outside ``src``). Returns this rank's destination shard, a new
    tensor (None outside ``dst``), or with ``async_op=True`` a :class:`ReshardWork` whose
    ``wait()`` returns it. ``global_shape`` and ``dtype`` may be omitted: one small all-gather
    then infers them from the source shards. ``strategy``: as :func:`~commlib.reshard.plan`'s."""
    fn = "reshard.reshard"
    rank = commlib.get_rank()
    shape = None
    with checked_call(fn, group) as (g, call):
        check_layouts(fn, src, dst, strategy, g.ranks)
        if global_shape is not None and dtype is not None:
            shape = check_inputs(fn, global_shape, dtype, src, dst, strategy, g.ranks)
            _check_local(fn, local, src, rank, shape, dtype)
        call.update(src=repr(src), dst=repr(dst), strategy=strategy,
                    global_shape=None if shape is None else shape,
                    dtype=None if dtype is None else str(dtype))
    if shape is None:  # every rank learns every source shard's shape: the checks agree
        shape, dtype = _metadata(fn, g, local, src, dst, strategy, global_shape, dtype)
        _check_local(fn, local, src, rank, shape, dtype)
    key = (g.ranks, g.name, shape, dtype, src.key(), dst.key(), strategy)
    if key not in _CACHE:
        hosts, table = _group_facts(g)
        p = _plan(shape, dtype, src, dst, strategy, hosts, table)
        _CACHE[key] = (p, _groups(p, g))
    p, groups = _CACHE[key]
    # every call of the group gets its own tags: two reshards in flight never match each
    # other's messages (their tasks' indices repeat), whatever order they are waited in
    _SEQ[g.name] = seq = _SEQ.get(g.name, 0) + 1
    finish = _start(p, groups, g, rank, local, src.box(rank, shape), seq)
    if async_op:
        return ReshardWork(finish)
    return finish()


def _check_local(fn: str, local, src: Layout, rank: int, shape, dtype) -> None:
    sbox = src.box(rank, shape)
    if sbox is None:
        return
    want = tuple(hi - lo for lo, hi in sbox)
    if isinstance(local, torch.Tensor) and tuple(local.shape) == want and local.dtype == dtype:
        return
    got = (f"<tensor shape={tuple(local.shape)} dtype={local.dtype}>"
           if isinstance(local, torch.Tensor) else type(local).__name__)
    raise arg_error(fn, "local", got,
                    f"must be rank {rank}'s source shard: shape {want}, dtype {dtype} (box "
                    f"{list(sbox)} of {list(shape)} under {src})",
                    "pass this rank's piece of the tensor under the source layout "
                    "(commlib.reshard.Layout.box gives its index range)",
                    CommTypeError if not isinstance(local, torch.Tensor) else CommArgumentError)


def _start(p: ReshardPlan, groups: dict, g, rank: int, local, sbox, seq: int):
    """Post phases 1-2 now; return the function that finishes 3-4."""
    hosts, shape = p.hosts, p.global_shape
    source = None
    if sbox is not None:
        source = local.detach()
        if p.partial:
            source = source.clone()
            for ranks, nbytes in p.partial:
                if rank in ranks:
                    k = ranks.index(rank)
                    _count(hosts, rank, ranks[(k + 1) % len(ranks)],
                           2 * (len(ranks) - 1) * nbytes // len(ranks))
                    commlib.all_reduce(source, group=groups[ranks])
    dbox = p.dst.box(rank, shape)
    out = None if dbox is None else torch.empty(tuple(hi - lo for lo, hi in dbox), dtype=p.dtype)
    works, landed, relay = [], [], []  # relay: (hops from the sender, recv, chunk, forward to, tag)
    itemsize = torch.empty((), dtype=p.dtype).element_size()
    for k, t in enumerate(p.tasks):
        tag = 1000 + (seq * len(p.tasks) + k) % _TAG_SPAN
        if rank in t.local:
            out[_slices(t.box, dbox)] = source[_slices(t.box, sbox)]
        if t.sender is None or (rank != t.sender and rank not in t.receivers):
            continue
        tile = source[_slices(t.box, sbox)].contiguous() if rank == t.sender else None
        if t.mode == "sendrecv":
            if rank == t.sender:
                for r in t.receivers:
                    _count(hosts, rank, r, t.nbytes)
                    works.append(commlib.isend(tile, dst=r, group=g, tag=tag))
            else:
                buf = _landing(out, t, dbox, landed)
                works.append(commlib.irecv(buf, src=t.sender, group=g, tag=tag))
        elif t.mode == "broadcast":  # a pipelined chain: each receiver forwards every chunk
            order = (t.sender,) + t.receivers
            at = order.index(rank)
            after = order[at + 1:at + 2]
            flat = tile.reshape(-1) if at == 0 else _landing(out, t, dbox, landed).view(-1)
            for a, b in _chunks(0, flat.numel(), itemsize):
                if at == 0:
                    _count(hosts, rank, after[0], (b - a) * itemsize)
                    works.append(commlib.isend(flat[a:b], dst=after[0], group=g, tag=tag))
                elif after:
                    relay.append((at, commlib.irecv(flat[a:b], src=order[at - 1], group=g, tag=tag),
                                  flat[a:b], after, tag))
                else:
                    works.append(commlib.irecv(flat[a:b], src=order[at - 1], group=g, tag=tag))
        else:  # allgather: the sender scatters parts, each receiver forwards its own
            flat = tile.reshape(-1) if rank == t.sender else None
            whole = None
            if rank != t.sender:
                whole = _landing(out, t, dbox, landed).view(-1)
            for i, r in enumerate(t.receivers):
                lo, hi = t.span(i)
                for a, b in _chunks(lo, hi, itemsize):
                    if rank == t.sender:
                        _count(hosts, rank, r, (b - a) * itemsize)
                        works.append(commlib.isend(flat[a:b], dst=r, group=g, tag=tag))
                    elif rank == r:
                        relay.append((1, commlib.irecv(whole[a:b], src=t.sender, group=g, tag=tag),
                                      whole[a:b], [x for x in t.receivers if x != rank], tag))
                    else:
                        works.append(commlib.irecv(whole[a:b], src=r, group=g, tag=tag))

    def finish():
        # forward each chunk as it lands, nearest the sender first: a chunk k hops down a chain
        # waits only on ranks that forward at k - 1 hops first, so no two ranks wait on each other
        relay.sort(key=lambda x: x[0])
        for _, recv, piece, others, tag in relay:
            recv.wait()
            for r in others:
                _count(hosts, rank, r, piece.numel() * itemsize)
                works.append(commlib.isend(piece, dst=r, group=g, tag=tag))
        for w in works:
            w.wait()
        for t, buf in landed:
            out[_slices(t.box, dbox)] = buf
        return out

    return finish


