"""Non-power-of-two world sizes for the doubling algorithms (Thakur, Rabenseifner & Gropp 2005).

With p = p2 + rem (p2 the largest power of two <= p), the first 2*rem ranks pair up: each even
rank sends its whole buffer to the odd rank above it and sits out; the odd rank reduces. The p2
remaining ranks run the power-of-two algorithm under "new ranks", and at the end each odd rank
sends the result back to its even partner.

Pairing neighbours keeps the ranks a core rank stands for contiguous (new rank k stands for ranks
``first_rank(k)`` to ``real_rank(k)``), which is what lets all-gather and reduce-scatter fold too.
"""

from __future__ import annotations

import torch

from ..kernels import reduce_


def shape(p: int) -> tuple[int, int]:
    p2 = 1 << (p.bit_length() - 1)
    return p2, p - p2


def new_rank(rank: int, rem: int) -> int:
    """This rank's rank among the p2 active ranks, or -1 if it sits out."""
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else -1
    return rank - rem


def real_rank(new: int, rem: int) -> int:
    return new * 2 + 1 if new < rem else new + rem


def first_rank(new: int, rem: int) -> int:
    """The lowest rank new rank ``new`` stands for (``first_rank(p2, rem) == p``)."""
    return new + min(new, rem)


def fold_in(ctx, flat, rem):
    """Even ranks below 2*rem hand their data to rank+1, which reduces it."""
    r = ctx.rank
    if r >= 2 * rem:
        return
    if r % 2 == 0:
        yield [ctx.isend(flat, r + 1)]
    else:
        tmp = torch.empty_like(flat)
        yield [ctx.irecv(tmp, r - 1)]
        reduce_(flat, tmp, ctx.op)


def fold_out(ctx, flat, rem):
    """Odd ranks below 2*rem send the result back to the even rank below."""
    r = ctx.rank
    if r >= 2 * rem:
        return
    if r % 2 == 0:
        yield [ctx.irecv(flat, r + 1)]
    else:
        yield [ctx.isend(flat, r - 1)]
