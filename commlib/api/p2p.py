"""Point-to-point: ``send``, ``recv``, ``isend``, ``irecv`` and ``batch_isend_irecv``, with
torch.distributed's signatures. Messages go through the engine's user channel, never matching
commlib's own algorithm traffic (see commlib/engines/base.py)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from ..errors import CommTypeError, arg_error
from ..runtime.group import Group
from ..runtime.progress import Work, start, unusable
from ..runtime.tensors import as_tensor, work_view
from .collectives import root_rank
from .groups import resolve_group

__all__ = ["send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp"]

_USER_TAG_MAX = 32767  # the smallest MPI_TAG_UB the MPI standard allows


def _peer(fn: str, group: Group, arg: str, peer, group_peer, allow_any: bool = False):
    if group_peer is None and peer is None:
        if allow_any:
            return None
        raise arg_error(fn, arg, None, "is required", f"pass {arg}=<world rank> or group_{arg}=")
    r = root_rank(fn, group, arg, peer, group_peer)
    return r


def _tag(fn: str, tag) -> int:
    if not isinstance(tag, int) or not 0 <= tag <= _USER_TAG_MAX:
        raise arg_error(fn, "tag", tag, f"must be an int in 0..{_USER_TAG_MAX}",
                        "use a small non-negative tag")
    return tag


def _p2p(group, what, t, peer, tag):
    flat, copied = work_view(t, None if what == "send" else "recv")
    if what == "send":
        return [group.backend.isend(flat, peer, tag, user=True)], None, (t, flat)
    handle = group.backend.irecv(flat, peer, tag, user=True)

    def finish():
        if copied:
            t.copy_(flat)
        source = peer if peer is not None else group.backend.source_of(handle)
        return group.ranks[source]

    return [handle], finish, (t, flat)


def _post_p2p(fn: str, what: str, tensor, peer, group, tag, group_peer, async_op: bool):
    g = resolve_group(group, fn)
    if g.broken is not None:  # before anything is posted to the engine
        unusable(g, fn)
    t = as_tensor(tensor, fn, "tensor", writable=(what == "recv"))
    arg = "dst" if what == "send" else "src"
    p = _peer(fn, g, arg, peer, group_peer, allow_any=(what == "recv"))
    tag = _tag(fn, tag)
    if not async_op and p == g.rank:  # at any group size: MPI does not buffer large messages
        raise arg_error(fn, arg, peer if peer is not None else group_peer,
                        f"is this rank itself; a blocking {what} to or from oneself never completes",
                        "use isend/irecv for messages to oneself, or another rank")
    return start(*_p2p(g, what, t, p, tag), g, fn, g.seq, async_op)


def send(tensor, dst: int | None = None, group: Group | None = None, tag: int = 0, *,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to world rank ``dst`` (or ``group_dst``); returns when it may be reused."""
    _post_p2p("send", "send", tensor, dst, group, tag, group_dst, False)


def recv(tensor, src: int | None = None, group: Group | None = None, tag: int = 0, *,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from world rank ``src`` (any rank if None); returns the sender's
    world rank."""
    return _post_p2p("recv", "recv", tensor, src, group, tag, group_src, False)


def isend(tensor, dst: int | None = None, group: Group | None = None, tag: int = 0, *,
          group_dst: int | None = None) -> Work:
    """Non-blocking :func:`send`; returns a ``Work``."""
    return _post_p2p("isend", "send", tensor, dst, group, tag, group_dst, True)


def irecv(tensor, src: int | None = None, group: Group | None = None, tag: int = 0, *,
          group_src: int | None = None) -> Work:
    """Non-blocking :func:`recv`; ``work.result()`` is the sender's world rank."""
    return _post_p2p("irecv", "recv", tensor, src, group, tag, group_src, True)


class P2POp(NamedTuple):
    """One point-to-point operation for :func:`batch_isend_irecv`: ``op`` is ``commlib.isend`` or
    ``commlib.irecv`` (``torch.distributed.isend``/``irecv`` are accepted too)."""

    op: Callable
    tensor: object
    peer: int | None = None
    group: Group | None = None
    tag: int = 0
    group_peer: int | None = None


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Post every send and receive of the list at once; returns one ``Work`` per op."""
    fn = "batch_isend_irecv"
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise arg_error(fn, "p2p_op_list", p2p_op_list, "must be a non-empty list of P2POp",
                        "pass [commlib.P2POp(commlib.isend, t, peer), ...]", CommTypeError)
    works = []
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise arg_error(fn, f"p2p_op_list[{i}]", p, "must be a commlib.P2POp",
                            "build it with commlib.P2POp(commlib.isend, tensor, peer)", CommTypeError)
        kind = getattr(p.op, "__name__", "")
        if kind not in ("isend", "irecv"):
            raise arg_error(fn, f"p2p_op_list[{i}].op", p.op, "must be isend or irecv",
                            "use commlib.isend or commlib.irecv")
        what = "send" if kind == "isend" else "recv"
        if what == "recv" and p.peer is None and p.group_peer is None:
            raise arg_error(fn, f"p2p_op_list[{i}].peer", None,
                            "a batched receive needs its peer", "give the sender's rank")
        works.append(_post_p2p(fn, what, p.tensor, p.peer, p.group, p.tag, p.group_peer, True))
    return works
