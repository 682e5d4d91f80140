"""The one message of ranks that disagree on a collective, whoever finds it: debug mode's
fingerprint exchange (commlib/runtime/debug.py) or the shared-memory segment, which compares the
calls the ranks publish with every step, always (csrc/shm/protocol.c, Agreement)."""

from __future__ import annotations

import weakref

from ..errors import CommMismatchError
from ..transports.shm import decode_call

__all__ = ["describe", "mismatch_error", "shm_hook"]


def describe(fn: str, **fields) -> str:
    """A call as the message lists it: ``all_reduce(shape=(4,), dtype=float32, op=SUM, ...)``."""
    return f"{fn}(" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")"


def mismatch_error(group, fn: str, seq: int, texts: list[str],
                   failed: list[int] | None = None) -> CommMismatchError:
    """The error of operation ``seq`` of ``group``, whose ranks described their calls as
    ``texts`` (one per rank); ``failed``: the ranks whose own argument checks failed."""
    lines = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(texts))
    if failed:
        what = f"ranks {failed} failed their argument checks"
    else:  # name the ranks outside the largest set of agreeing ranks (ties: rank 0's set)
        same: dict[str, list[int]] = {}
        for r, t in enumerate(texts):
            same.setdefault(t, []).append(r)
        most = max(same.values(), key=len)
        most = most if sum(len(v) == len(most) for v in same.values()) == 1 else same[texts[0]]
        differ = [r for r in range(len(texts)) if r not in most]
        what = f"ranks {differ} differ from ranks {most}"
    return CommMismatchError(
        f"commlib.{fn}: ranks of group {group.name!r} disagree on operation #{seq}: "
        f"{what}.\n{lines}\nFix: make every rank of the group call the same collective with the "
        f"same shape, dtype, op and root.")


def shm_hook(group):
    """``Segment.on_mismatch`` for ``group``: the error from every rank's published call. (A weak
    reference: the segment belongs to the group.)"""
    ref = weakref.ref(group)

    def on_mismatch(calls):
        g = ref()
        decoded = [decode_call(*row) for row in calls]
        texts = [describe(fn, **fields) for fn, fields in decoded]
        if g is None:
            return CommMismatchError(f"commlib.{decoded[0][0]}: ranks disagree: {texts}. Fix: "
                                     f"make every rank call the same collective")
        return mismatch_error(g, decoded[g.rank][0], g.seq, texts)

    return on_mismatch
