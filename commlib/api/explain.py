"""``commlib.explain``: why a call would run the algorithm it runs (also ``commlib.tuning.explain``)."""

from __future__ import annotations

from ..algorithms import COLLECTIVES
from ..errors import arg_error
from ..tuning import Explanation, explain_call
from .groups import resolve_group

__all__ = ["explain"]


def explain(op: str, nbytes: int, group=None, dtype=None) -> Explanation:
    """The model's table for ``op`` (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``,
    ``"broadcast"``, ``"reduce"``, ...) of ``nbytes`` on ``group`` (default: world): every eligible
    algorithm's predicted time and how it was priced (``measured`` curve or ``formula``), the
    algorithm a call would use, and why the others cannot run here.
    ``print(commlib.explain("all_reduce", 1 << 20))``. ``dtype``: the tensor's, for reductions:
    float16/bfloat16 make the algorithms that leave the accumulation to the engine pay a float32
    copy where the engine cannot reduce them (rows marked ``x2 upcast``). Local: no
    communication."""
    if op not in COLLECTIVES:
        raise arg_error("tuning.explain", "op", op, f"is not one of {list(COLLECTIVES)}",
                        "pass a collective's name, e.g. 'all_reduce'")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise arg_error("tuning.explain", "nbytes", nbytes, "must be a non-negative int",
                        "pass the message size in bytes")
    return explain_call(op, nbytes, resolve_group(group, "tuning.explain"), dtype)
