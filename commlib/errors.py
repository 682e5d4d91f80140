"""The exception hierarchy of commlib.

Every public entry raises a subclass of :class:`CommError`. Messages name the function, the
argument, the value, the rule that was broken and a fix, so that the user can act on them without
reading commlib's source.
"""

from __future__ import annotations

__all__ = [
    "CommError",
    "CommArgumentError",
    "CommTypeError",
    "CommConfigError",
    "CommStateError",
    "CommMismatchError",
    "CommTimeoutError",
    "CommBackendError",
    "CommUnsupportedError",
]


class CommError(RuntimeError):
    """Base class of every error commlib raises."""


class CommArgumentError(CommError, ValueError):
    """An argument has a bad value (shape, size, rank, op, split sizes, ...)."""


class CommTypeError(CommError, TypeError):
    """An argument has a bad type or dtype."""


class CommConfigError(CommError, ValueError):
    """A keyword option or ``COMMLIB_*`` environment variable is unknown or malformed."""


class CommStateError(CommError):
    """The library is in the wrong state for the call (not initialized, rank not in group, ...)."""


class CommMismatchError(CommError):
    """Ranks of a group disagree on a collective call (debug mode, ``COMMLIB_DEBUG=1``)."""


class CommTimeoutError(CommError, TimeoutError):
    """An operation did not complete within ``COMMLIB_TIMEOUT`` seconds."""


class CommBackendError(CommError):
    """A backend cannot be created or used here (missing package, no GPU, MPI not CUDA-aware)."""


class CommUnsupportedError(CommError, NotImplementedError):
    """The combination of collective, algorithm, backend, op and dtype is not supported."""


def arg_error(fn: str, arg: str, value, rule: str, fix: str, cls=CommArgumentError) -> CommError:
    """Build the standard message: ``fn(): argument 'arg' = value: rule. Fix: fix``."""
    text = repr(value)
    if len(text) > 120:
        text = text[:117] + "..."
    return cls(f"commlib.{fn}(): argument '{arg}' = {text}: {rule}. Fix: {fix}")
