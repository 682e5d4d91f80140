"""``COMMLIB_DEBUG=1``: before each collective, ranks exchange a fingerprint of the call
(collective, shape, dtype, op, root, and whether the rank's own argument checks failed). One
all-gather of a few integers finds a disagreement; a second all-gather of the ranks' descriptions
names it, and every rank raises ``CommMismatchError``.
"""

from __future__ import annotations

import zlib

import torch

from ._progress import Work
from .errors import CommMismatchError

__all__ = ["agree"]

_FIELDS = 2  # crc32 of the description, error flag
_TEXT = 400  # bytes of description exchanged on a mismatch


def _gather(group, local: torch.Tensor) -> torch.Tensor:
    out = torch.empty(group.size * local.numel(), dtype=local.dtype)

    def gen():
        yield [group.backend.all_gather(out, local)]

    Work(gen(), None, (out, local), group, "debug check", group.seq, group.timeout).wait()
    return out.view(group.size, -1)


def agree(group, fn: str, description: str, error: BaseException | None = None) -> None:
    """Raise on every rank of ``group`` unless all ranks describe the same call."""
    if group.size == 1:
        return
    text = description if error is None else f"{fn}: failed its argument checks: {error}"
    mine = torch.tensor([zlib.crc32(text.encode()), int(error is not None)], dtype=torch.int64)
    table = _gather(group, mine)
    if bool((table == table[0]).all()) and not bool(table[:, 1].any()):
        return
    raw = text.encode()[:_TEXT]
    buf = torch.zeros(_TEXT, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    texts = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")
             for row in _gather(group, buf)]
    if error is not None:
        return  # this rank raises its own argument error; the others name it below
    failed = [r for r in range(group.size) if table[r, 1]]
    differ = [r for r in range(group.size) if texts[r] != texts[0]]
    lines = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(texts))
    what = (f"ranks {failed} failed their argument checks" if failed
            else f"ranks {differ} differ from rank 0")
    raise CommMismatchError(
        f"commlib.{fn}: ranks of group {group.name!r} disagree on operation #{group.seq}: "
        f"{what}.\n{lines}\nFix: make every rank of the group call the same collective with the "
        f"same shape, dtype, op and root."
    )
