"""``COMMLIB_DEBUG=1``: before each collective, ranks exchange a fingerprint of the call
(collective, shape, dtype, op, root, and whether the rank's own argument checks failed). One
all-gather of a few integers finds a disagreement; a second all-gather of the ranks' descriptions
names it, and every rank raises ``CommMismatchError`` (the message of
commlib/runtime/mismatch.py, which the shared-memory path raises without debug mode too).
"""

from __future__ import annotations

import zlib

import torch

from .mismatch import mismatch_error
from .progress import Work, unusable

__all__ = ["agree"]

_FIELDS = 2  # crc32 of the description, error flag
_TEXT = 400  # bytes of description exchanged on a mismatch


def _gather(group, fn: str, local: torch.Tensor) -> torch.Tensor:
    out = torch.empty(group.size * local.numel(), dtype=local.dtype)

    def gen():
        yield [group.backend.all_gather(out, local)]

    # A rank that skipped the call times this out: name the call and its number.
    Work(gen(), None, (out, local), group, f"{fn} (debug check)", group.seq + 1,
         group.timeout).wait()
    return out.view(group.size, -1)


def agree(group, fn: str, description: str, error: BaseException | None = None) -> None:
    """Raise on every rank of ``group`` unless all ranks describe the same call."""
    if group.broken is not None:  # an exchange on it would wait on a stale engine state
        unusable(group, fn)
    if group.size == 1:
        return
    text = description if error is None else f"{fn}: failed its argument checks: {error}"
    mine = torch.tensor([zlib.crc32(text.encode()), int(error is not None)], dtype=torch.int64)
    table = _gather(group, fn, mine)
    if bool((table == table[0]).all()) and not bool(table[:, 1].any()):
        return
    raw = text.encode()[:_TEXT]
    buf = torch.zeros(_TEXT, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    texts = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")
             for row in _gather(group, fn, buf)]
    if error is not None:
        return  # this rank raises its own argument error; the others name it below
    failed = [r for r in range(group.size) if table[r, 1]]
    raise mismatch_error(group, fn, group.seq + 1, texts, failed)
