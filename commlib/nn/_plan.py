"""The ring schedule: a pure, cached plan of which blocks each step computes.

At step i of a ring of N ranks, rank r holds the K/V block of rank ``(r - i) mod N`` (blocks travel
to rank r+1 each step). For every step the plan lists the kernel calls, each a rectangle of local
query chunks x key chunks with a mask kind:

* non-causal: every chunk pair is visible, one call per step;
* causal, the rank's own block (step 0): one causal call on the whole local block (the layouts keep
  each rank's chunks ascending, so the local lower triangle is the global causal mask);
* causal, another rank's block: a pair (query chunk a, key chunk b) is fully visible when a > b in
  global order and invisible when a < b; query chunks that see the same key chunks form one call.
  With the zigzag layout that is always a single call: all queries against the first key chunk
  (source rank before this one) or the second query chunk against all keys (source after).

Step 0 always covers every local query row (each row sees at least its own key), so the executor
assigns the first partial result and merges the later ones.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ._layout import global_chunks

__all__ = ["Call", "Step", "RingPlan", "plan_ring"]


class Call(NamedTuple):
    """One kernel call: local query chunks [q0, q1) against local key chunks [k0, k1)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


class Step(NamedTuple):
    index: int
    source: int  # group rank whose K/V block this step computes with
    calls: tuple[Call, ...]


class RingPlan(NamedTuple):
    rank: int
    size: int
    layout: str
    causal: bool
    send_to: int  # group ranks
    recv_from: int
    steps: tuple[Step, ...]

    @property
    def kv_transfers(self) -> int:
        """Forward: each step but the last passes the K/V block on."""
        return self.size - 1

    def __str__(self) -> str:
        lines = [f"RingPlan(rank {self.rank}/{self.size}, layout={self.layout}, causal={self.causal}, "
                 f"send->{self.send_to}, recv<-{self.recv_from})"]
        for s in self.steps:
            calls = ", ".join(f"q[{c.q0}:{c.q1}]xk[{c.k0}:{c.k1}]{' causal' if c.causal else ''}"
                              for c in s.calls) or "nothing"
            lines.append(f"  step {s.index}: block of rank {s.source}: {calls}")
        return "\n".join(lines)


def _calls(qc: tuple[int, ...], kc: tuple[int, ...], causal: bool) -> tuple[Call, ...]:
    if not causal:
        return (Call(0, len(qc), 0, len(kc), False),)
    if qc == kc:
        return (Call(0, len(qc), 0, len(kc), True),)
    if set(qc) & set(kc):
        raise AssertionError(f"layout gives chunks {sorted(set(qc) & set(kc))} to two ranks")
    visible = [tuple(b for b, g in enumerate(kc) if g < a) for a in qc]
    calls: list[Call] = []
    a = 0
    while a < len(qc):
        e = a + 1
        while e < len(qc) and visible[e] == visible[a]:
            e += 1
        vis = visible[a]
        if vis and list(vis) == list(range(vis[0], vis[-1] + 1)):
            calls.append(Call(a, e, vis[0], vis[-1] + 1, False))
        else:
            calls.extend(Call(a, e, b, b + 1, False) for b in vis)
        a = e
    return tuple(calls)


@functools.lru_cache(maxsize=256)
def plan_ring(rank: int, size: int, causal: bool, layout: str) -> RingPlan:
    """The schedule of ``rank`` in a ring of ``size``; every rank computes its own from the same
    inputs (deterministic, no communication)."""
    qc = global_chunks(layout, rank, size)
    steps = []
    for i in range(size):
        src = (rank - i) % size
        steps.append(Step(i, src, _calls(qc, global_chunks(layout, src, size), causal)))
    first = steps[0].calls
    assert len(first) == 1 and (first[0].q0, first[0].q1) == (0, len(qc)), "step 0 covers all rows"
    return RingPlan(rank, size, layout, causal, (rank + 1) % size, (rank - 1) % size, tuple(steps))
