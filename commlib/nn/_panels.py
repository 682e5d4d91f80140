"""SUMMA's pipeline depth: one rule for the 2D layers (``_summa.py``) and the planner
(``tp_plan.py``)."""

from __future__ import annotations

import math

__all__ = ["summa_panels"]


def summa_panels(r: int, c: int, fan_in: int, panels: int | None = None) -> int:
    """The SUMMA panels of a Linear2D(fan_in, ·) on an (r, c) mesh: ``panels`` if given, else
    lcm(r, c), the fewest that rectangular meshes allow: on a square mesh every rank's block is
    one panel, broadcast in place. Deeper pipelines were measured slower on the multi-host cluster
    (docs/tensor-parallel-2d.md: each doubling added ~6 ms of posting and 7-13 ms of smaller GEMMs
    to a 250 ms step, and hid less): ``panels=`` asks for them."""
    return math.lcm(r, c) if panels is None else panels
