"""Reduction operators and the dtype table, with the special cases written next to them."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

__all__ = ["ReduceOp", "DTYPES", "dtype_name", "accumulation_dtype", "resolve_op"]


class ReduceOp(enum.Enum):
    """Reduction operators, named as in ``torch.distributed.ReduceOp``."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    # Members are singletons: hash by identity, not enum's Python-level hash of the name (this op
    # is a dict key on every collective's hot path).
    __hash__ = object.__hash__


# dtype -> (name, is_floating). Every dtype commlib moves and reduces.
DTYPES: dict[torch.dtype, tuple[str, bool]] = {
    torch.float16: ("float16", True),
    torch.bfloat16: ("bfloat16", True),
    torch.float32: ("float32", True),
    torch.float64: ("float64", True),
    torch.int8: ("int8", False),
    torch.uint8: ("uint8", False),
    torch.int32: ("int32", False),
    torch.int64: ("int64", False),
    torch.bool: ("bool", False),
}

DTYPE_BY_NAME: dict[str, torch.dtype] = {name: dt for dt, (name, _) in DTYPES.items()}

# Half-precision reductions accumulate in float32 on every CPU engine: MPI has no bfloat16 and
# summing float16 in float16 loses digits at every step of a ring. Backends whose engine does
# better (NCCL) say so with ``Backend.native_reduce_dtypes``.
_ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

# bool has no arithmetic: follow ProcessGroupNCCL, where SUM is logical OR and PRODUCT logical AND.
# AVG on bool means nothing and is rejected.
_BOOL_OPS = {
    ReduceOp.SUM: ReduceOp.BOR,
    ReduceOp.MAX: ReduceOp.BOR,
    ReduceOp.BOR: ReduceOp.BOR,
    ReduceOp.PRODUCT: ReduceOp.BAND,
    ReduceOp.MIN: ReduceOp.BAND,
    ReduceOp.BAND: ReduceOp.BAND,
    ReduceOp.BXOR: ReduceOp.BXOR,
}

_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPES[dtype][0] if dtype in DTYPES else str(dtype).replace("torch.", "")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return _ACCUMULATE.get(dtype, dtype)


def resolve_op(op: ReduceOp, dtype: torch.dtype) -> ReduceOp | None:
    """The op actually applied to ``dtype`` (bool SUM -> BOR, ...), or None if it is not allowed.

    Rules: bitwise ops on integers and bool only; AVG on floating dtypes only (an integer mean
    would silently truncate: use SUM and divide).
    """
    if dtype is torch.bool:
        return _BOOL_OPS.get(op)
    floating = DTYPES[dtype][1]
    if op in _BITWISE and floating:
        return None
    if op is ReduceOp.AVG and not floating:
        return None
    return op


def to_reduce_op(op) -> ReduceOp | None:
    """Accept ReduceOp, torch.distributed.ReduceOp (or its RedOpType) and names like 'sum'."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        return ReduceOp.__members__.get(op.upper())
    if isinstance(op, (int, float)):  # torch's op enum compares equal to ints: 3 would be MIN,
        return None                   # True AVG; a number is not an operator
    name = getattr(op, "name", None)
    if name is None:  # torch.distributed.ReduceOp instances carry no name; compare by value
        try:
            for candidate in ReduceOp:
                if op == getattr(dist.ReduceOp, candidate.name, object()):
                    return candidate
        except (ImportError, RuntimeError, TypeError):
            return None
        return None
    return ReduceOp.__members__.get(str(name).upper())
