"""The entry of a public call of the layers above the collectives (``commlib.nn``,
``commlib.overlap``): resolve the group, run the call's checks, and under ``COMMLIB_DEBUG=1``
compare the call across ranks, so that ranks that disagree, or a rank whose own checks failed,
raise on every rank instead of waiting in a ring for a peer that never comes."""

from __future__ import annotations

import contextlib
import sys

from ..errors import CommError
from ..runtime import debug
from ..runtime.group import state
from ..runtime.mismatch import describe
from .groups import get_world_group, resolve_group

__all__ = ["checked_call", "DeferredWork", "fail_future"]


@contextlib.contextmanager
def checked_call(fn: str, group):
    """``with checked_call("overlap.all_gather_matmul", group) as (g, call): ...``: yields the
    resolved group and a dict the checks fill with the call's description (shapes, dtype,
    options). Under ``COMMLIB_DEBUG=1`` the ranks then compare descriptions with one small
    all-gather (a rank whose checks raised takes part too, with its error)."""
    g = resolve_group(group, fn)
    call: dict = {}
    try:
        yield g, call
    except CommError as exc:
        if g.debug:
            debug.agree(g, fn, "", error=exc)
        raise
    if g.debug:
        debug.agree(g, fn, describe(fn, **call))


class DeferredWork:
    """The handle of a staged asynchronous call of the layers above the collectives (a reshard, a
    compressed all-reduce): its first transfers travel (commlib's progress engine moves them)
    until ``wait()``, which runs the rest (``finish``) once and returns its result."""

    def __init__(self, finish):
        self._finish, self._result, self._done = finish, None, False

    def wait(self, timeout=None):
        if not self._done:
            self._result, self._done = self._finish(), True
        return self._result

    def is_completed(self) -> bool:
        return self._done


def fail_future(exc: BaseException, future) -> None:
    """The operation behind a torch future failed with ``exc``. Under ``timeout_mode="raise"`` the
    future raises it. Under ``"abort"`` (the default) the process ends with it printed, as a
    blocking collective's timeout ends the job: torch's C++ consumers of futures (DDP's reducer)
    cannot take an exception raised in Python (measured: the waiting process crashed), and a
    future nobody completes would leave the rank waiting for ever."""
    if state.timeout_mode == "raise":
        future.set_exception(exc)
        return
    sys.stderr.write(f"commlib: {type(exc).__name__}: {exc}\ncommlib: the operation of a torch "
                     f"future failed; ending this process (timeout_mode 'abort'; set "
                     f"COMMLIB_TIMEOUT_MODE=raise for the future to raise instead)\n")
    sys.stderr.flush()
    get_world_group().backend.abort(1)
