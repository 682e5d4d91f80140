"""SUMMA's pipeline depth: one rule for the 2D layers (``_summa.py``) and the planner
(``tp_plan.py``)."""

from __future__ import annotations

import math

__all__ = ["MIN_PANELS", "summa_panels"]

#: The layers' default pipeline depth: the first panel's broadcasts are exposed, the rest hide
#: behind the GEMMs.
MIN_PANELS = 4


def summa_panels(r: int, c: int, fan_in: int, panels: int | None = None) -> int:
    """The SUMMA panels of a Linear2D(fan_in, ·) on an (r, c) mesh: ``panels`` if given, else the
    smallest multiple of lcm(r, c) that is at least :data:`MIN_PANELS` and divides ``fan_in``,
    else lcm(r, c)."""
    if panels is not None:
        return panels
    base = math.lcm(r, c)
    k = -(-MIN_PANELS // base)
    while k > 1 and fan_in % (base * k):
        k -= 1
    return base * k
