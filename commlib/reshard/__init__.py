"""Cross-mesh resharding: move a sharded tensor between meshes and layouts with planned transfers.

``plan(global_shape, dtype, src, dst)`` (pure) cuts the move into unit tasks, picks a sender per
task among the source replicas (load-balanced), a mode per task (send/recv, broadcast, or one
scatter then an all-gather inside the destination mesh) from the cost model, and predicts the
bytes and the time; ``reshard(local, src, dst)`` runs it, every task at once. See docs/reshard.md.

    from commlib.reshard import Layout, Shard, Replicate, reshard
    src = Layout([0, 1], [Shard(1)])          # stage 0: columns split over ranks 0 and 1
    dst = Layout([2, 3], [Replicate()])       # stage 1: the whole tensor on ranks 2 and 3
    out = reshard(local, src, dst)            # every rank calls; None on ranks 0 and 1
"""

from .executor import ReshardWork, reshard
from .layout import Layout, Partial, Replicate, Shard
from .planner import ReshardPlan, Task, plan

__all__ = ["Layout", "Shard", "Replicate", "Partial", "plan", "ReshardPlan", "Task", "reshard",
           "ReshardWork"]
