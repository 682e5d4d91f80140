"""One job on a fresh or probed cache (tests/test_autotune.py): prints, on rank 0, the world's
model source and the file's entry, then checks an all-reduce against its definition and that a
3-rank subgroup of a 4-rank job probes too (its own entry)."""

import json
import sys

import torch

import commlib
from commlib.tuning.calibration import load

commlib.init()
world = commlib.get_world_group()
t = torch.arange(1000, dtype=torch.float32) + world.rank
commlib.all_reduce(t)
expected = world.size * torch.arange(1000, dtype=torch.float32) + sum(range(world.size))
assert torch.equal(t, expected), (t[:4], expected[:4])
explained = commlib.explain("all_reduce", 1 << 20)
sub = None
if world.size == 4:
    sub = commlib.new_group([0, 1, 2])
    if sub.rank >= 0:
        u = torch.full((7,), 1.0 + sub.rank)
        commlib.all_reduce(u, group=sub)
        assert torch.equal(u, torch.full((7,), 6.0)), u
if world.rank == 0:
    doc = load() or {"groups": {}}
    print(json.dumps({"source": world.model.source,
                      "sub": None if sub is None else sub.model.source,
                      "rows": [[r.algorithm, r.how] for r in explained.rows],
                      "chosen": explained.chosen, "groups": doc["groups"]}))
commlib.finalize()
sys.exit(0)
