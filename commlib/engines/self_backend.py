"""A world of one process: no engine, every collective is a local copy.

``commlib.init()`` in a plain process (no launcher, no torch.distributed) uses it, so that code
written for many ranks runs unchanged on one.
"""

from __future__ import annotations

import threading
from collections import deque

from ..errors import CommStateError
from . import register_backend
from .base import Backend


class _Done:
    __slots__ = ()


_DONE = _Done()


class _Recv:
    __slots__ = ("buf", "tag", "user", "done")

    def __init__(self, buf, tag, user):
        self.buf, self.tag, self.user, self.done = buf, tag, user, False


@register_backend("self")
class SelfBackend(Backend):
    devices = frozenset({"cpu", "cuda"})
    # Every operation completes when posted or never (a receive with no send in this one
    # process): the poll loop asks ``wait`` rather than polling until the timeout.
    local_only = True

    def __init__(self):
        self.rank, self.size = 0, 1
        self._sent: dict[tuple[bool, int], deque] = {}
        self._posted: list[_Recv] = []
        # matched by the caller's thread and by commlib's progress thread
        self._lock = threading.Lock()

    @classmethod
    def create_world(cls, **options) -> "SelfBackend":
        return cls()

    def new_subgroup(self, ranks):
        return SelfBackend() if 0 in ranks else None

    def member_subgroup(self, ranks, key):
        return SelfBackend()

    def global_ranks(self):
        return [0]

    # A message to oneself: the send is buffered (copied), the receive matches in order by tag.
    def _match(self):
        with self._lock:
            for r in self._posted:
                if not r.done:
                    queue = self._sent.get((r.user, r.tag))
                    if queue:
                        r.buf.copy_(queue.popleft().view(r.buf.dtype).reshape(r.buf.shape))
                        r.done = True
            self._posted = [r for r in self._posted if not r.done]

    def test(self, handles):
        self._match()
        return all(h is _DONE or h.done for h in handles)

    def wait(self, handles):
        if not self.test(handles):
            raise CommStateError(
                "commlib: a receive in a world of one process has no matching send. "
                "Fix: post the matching commlib.isend to rank 0 first."
            )

    def source_of(self, handle):
        return 0

    def isend(self, buf, peer, tag, user=False):
        copy = buf.clone()
        with self._lock:
            self._sent.setdefault((user, tag), deque()).append(copy)
        return _DONE

    def irecv(self, buf, peer, tag, user=False):
        r = _Recv(buf, tag, user)
        with self._lock:
            self._posted.append(r)
        self._match()
        return r

    def all_reduce(self, buf, op, blocking=False):
        return _DONE

    def broadcast(self, buf, root, blocking=False):
        return _DONE

    def reduce(self, buf, op, root, blocking=False):
        return _DONE

    # Buffers are contiguous but of any shape (an (n, k) output, a flat input): copy elements.
    def all_gather(self, out, inp, blocking=False):
        out.view(-1).copy_(inp.view(-1))
        return _DONE

    def reduce_scatter(self, out, inp, op, blocking=False):
        out.view(-1).copy_(inp.view(-1))
        return _DONE

    def all_to_all(self, out, inp, out_counts, in_counts, blocking=False):
        out.view(-1).copy_(inp.view(-1))
        return _DONE

    def barrier(self, blocking=False):
        return _DONE
