"""Communication hidden behind computation: the collective matmuls of tensor parallelism.

:func:`all_gather_matmul` (``all_gather(a_shard) @ b``) and :func:`matmul_reduce_scatter`
(``reduce_scatter(a @ b)``) run as rings of point-to-point messages in which every rank multiplies
the block it holds while the next block travels, cut into pieces chosen by a cost model (the
group's agreed link cost and matmul rate). Both are differentiable, each the other's backward.
:func:`plan_all_gather_matmul`, :func:`plan_matmul_reduce_scatter` and :func:`explain` show the
plan and why. See ``docs/overlap.md``.

Example (every rank; ``a_shard`` (m, k), ``w`` this rank's (k, n) column block)::

    import commlib.overlap as ov
    a, y = ov.all_gather_matmul(a_shard, w)          # a: (p*m, k), y: (p*m, n)
    z = ov.matmul_reduce_scatter(y, w2)              # (m, n2): this rank's rows, summed
    print(ov.explain("all_gather_matmul", a_shard.shape, w.shape))
"""

from .matmul import (
    OPS,
    all_gather_matmul,
    explain,
    matmul_reduce_scatter,
    plan_all_gather_matmul,
    plan_matmul_reduce_scatter,
)
from .plan import MAX_CHUNKS, MIN_GAIN, Candidate, MatmulRate, OverlapPlan, plan

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "plan_all_gather_matmul",
           "plan_matmul_reduce_scatter", "explain", "plan", "OverlapPlan", "Candidate",
           "MatmulRate", "MAX_CHUNKS", "MIN_GAIN", "OPS"]
