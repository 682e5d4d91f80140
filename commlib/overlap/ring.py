"""The executors: walk an :class:`~commlib.overlap.plan.OverlapPlan` around the group's ring.

Both post every message with ``commlib.isend``/``commlib.irecv`` (non-blocking; ``Work``
handles), one per piece of a block, on the tags ``TAG_* + piece``: each piece index is its own
stream, in order between a pair of ranks (the engines keep one tag's messages in order), so
pieces of different blocks never match each other's receives. Between two piece matmuls they test
what is in flight (``Work.is_completed``): that lets a single-threaded engine move the data while
the next piece computes, and here it also forwards every piece that has arrived at once.

``all_gather_matmul`` (rank r of p, ring r-1 -> r -> r+1): step s multiplies the shard of rank
``(r - s) % p`` (its own at step 0), piece by piece; each piece of shard ``(r - s) % p`` arrived
from r-1 is forwarded to r+1 unless it has reached its last rank (s = p-1). Sends per rank:
``c`` of its own shard plus ``(p-2)·c`` forwarded = ``(p-1)·c``, and as many receives.

``matmul_reduce_scatter``: step s computes, piece by piece, the partial product of the block of
rank ``(r - s - 1) % p``, adds the accumulator of that block that came from r-1 (which computed
it at step s-1) and sends the sum to r+1; the last step's block is rank r's own, complete.
``(p-1)·c`` sends and receives per rank.
"""

from __future__ import annotations

import torch

import commlib

from ..ops import accumulation_dtype
from .plan import OverlapPlan

__all__ = ["gather_matmul", "gather_then_matmul", "matmul_scatter", "matmul_then_scatter",
           "TAG_GATHER", "TAG_SCATTER"]

# User-channel tags of the pieces (+ the piece index, below MAX_CHUNKS = 64): high in the
# 0..32767 range every engine allows, away from the small tags programs use for their own
# messages.
TAG_GATHER, TAG_SCATTER = 32000, 32100


def _isend(t, group, peer, tag):
    return commlib.isend(t, group=group, tag=tag, group_dst=peer)


def _irecv(t, group, peer, tag):
    return commlib.irecv(t, group=group, tag=tag, group_src=peer)


def _drain(sends: list) -> list:
    """The sends still in flight (testing each lets the engine progress it)."""
    return [w for w in sends if not w.is_completed()]


@torch.no_grad()
def gather_matmul(group, plan: OverlapPlan, shard: torch.Tensor, b: torch.Tensor | None):
    """All-gather ``shard`` over ``group`` and multiply every shard by ``b`` as it arrives.
    Returns ``(gathered, products)``: ``(p, *shard.shape)`` and ``(p, *shard.shape[:-1], n)``,
    block j from group rank j (``products`` is None when ``b`` is None: a gather alone, as the
    backward of matmul_reduce_scatter needs when ``a`` has no gradient)."""
    p, r = group.size, group.rank
    nxt, prv = (r + 1) % p, (r - 1) % p
    rows, k = plan.rows, shard.shape[-1]
    gathered = shard.new_empty((p, *shard.shape))
    gathered[r].copy_(shard)
    blocks = gathered.view(p, rows, k)
    products = out = None
    if b is not None:
        products = shard.new_empty((p, *shard.shape[:-1], b.shape[1]))
        out = products.view(p, rows, b.shape[1])
    pieces = plan.pieces
    travels = plan.sends > 0
    got = [1] * len(pieces)  # piece i of the steps < got[i] is here (step 0: the own shard)
    pending: dict[int, object] = {}  # piece i -> the receive of its step got[i]
    sends: list = []

    def arrived(i: int, block: bool) -> bool:
        """Take piece i of step got[i] if it is here (``block``: wait for it): forward it, post
        the receive of the next step's."""
        w = pending[i]
        if block:
            w.wait()
        elif not w.is_completed():
            return False
        s, (lo, hi) = got[i], pieces[i]
        got[i] += 1
        if s < p - 1:  # not its last rank: pass it on, and take the next shard's piece
            sends.append(_isend(blocks[(r - s) % p, lo:hi], group, nxt, TAG_GATHER + i))
            pending[i] = _irecv(blocks[(r - s - 1) % p, lo:hi], group, prv, TAG_GATHER + i)
        else:
            del pending[i]
        return True

    if travels:
        for i, (lo, hi) in enumerate(pieces):
            pending[i] = _irecv(blocks[prv, lo:hi], group, prv, TAG_GATHER + i)
            sends.append(_isend(blocks[r, lo:hi], group, nxt, TAG_GATHER + i))
    for s in range(p):
        j = (r - s) % p
        for i, (lo, hi) in enumerate(pieces):
            while travels and got[i] <= s:
                arrived(i, block=True)
            if out is not None:
                torch.matmul(blocks[j, lo:hi], b, out=out[j, lo:hi])
            for m in list(pending):  # forward whatever has arrived meanwhile
                while m in pending and arrived(m, block=False):
                    pass
            sends = _drain(sends)
    for w in sends:
        w.wait()
    return gathered, products


@torch.no_grad()
def matmul_scatter(group, plan: OverlapPlan, blocks: torch.Tensor, b: torch.Tensor,
                   addend: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce-scatter (sum) of ``blocks @ b (+ addend)`` over ``group``: ``blocks`` is
    ``(p, rows, k)``, block j the rows whose product rank j gets; ``addend``, if given,
    ``(p, rows, n)``, added to the product before the reduction. Returns this rank's block,
    ``(rows, n)``, summed over the ranks, in the accumulation dtype of ``blocks``."""
    p, r = group.size, group.rank
    nxt, prv = (r + 1) % p, (r - 1) % p
    n = b.shape[1]
    acc = accumulation_dtype(blocks.dtype)
    result = blocks.new_empty((plan.rows, n), dtype=acc)
    pieces = plan.pieces
    travels = plan.sends > 0
    incoming: dict[int, tuple] = {}  # piece i -> (receive, its buffer) of the next step
    sends: list = []

    def post(i: int) -> None:
        lo, hi = pieces[i]
        t = result.new_empty((hi - lo, n))
        incoming[i] = (_irecv(t, group, prv, TAG_SCATTER + i), t)

    if travels:
        for i in range(len(pieces)):
            post(i)
    for s in range(p):
        j = (r - s - 1) % p
        last = s == p - 1
        for i, (lo, hi) in enumerate(pieces):
            part = torch.matmul(blocks[j, lo:hi], b)
            if part.dtype != acc:
                part = part.to(acc)
            if addend is not None:
                part.add_(addend[j, lo:hi])
            if s > 0 and travels:
                w, t = incoming.pop(i)
                w.wait()
                part.add_(t)
                if not last:
                    post(i)
            if last:
                result[lo:hi].copy_(part)
            elif travels:
                sends.append(_isend(part, group, nxt, TAG_SCATTER + i))
            for w, _ in incoming.values():  # let the engine move what is in flight
                w.is_completed()
            sends = _drain(sends)
    for w in sends:
        w.wait()
    return result


# ----- no decomposition (a plan of 0 chunks) ------------------------------------------------------
# Where overlap cannot pay (the transfers are copies by the cores that compute, or too small to
# hide anything), the plan runs commlib's own collective (its selection: shared memory on one
# host, hierarchical across hosts) and one matmul. Same arguments and results as above.
@torch.no_grad()
def gather_then_matmul(group, plan: OverlapPlan, shard: torch.Tensor, b: torch.Tensor | None):
    gathered = shard.new_empty((group.size, *shard.shape))
    commlib.all_gather_into_tensor(gathered.view(-1), shard.reshape(-1), group=group)
    products = None
    if b is not None:
        products = torch.matmul(gathered.view(group.size, plan.rows, shard.shape[-1]), b)
        products = products.view(group.size, *shard.shape[:-1], b.shape[1])
    return gathered, products


@torch.no_grad()
def matmul_then_scatter(group, plan: OverlapPlan, blocks: torch.Tensor, b: torch.Tensor,
                        addend: torch.Tensor | None = None) -> torch.Tensor:
    acc = accumulation_dtype(blocks.dtype)
    product = torch.matmul(blocks, b)
    if product.dtype != acc:
        product = product.to(acc)
    if addend is not None:
        product.add_(addend)
    result = product.new_empty(product.shape[1:])
    commlib.reduce_scatter_tensor(result.view(-1), product.reshape(-1), group=group)
    return result
