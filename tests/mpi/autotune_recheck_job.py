"""A job whose probe runs slowed and whose check finds it out (tests/test_autotune.py): rank 0
starts CPU hogs (busy processes, two per core) before ``commlib.init``, so the probe times every
algorithm on a crowded host, and stops them after; the job's all-reduces then reach the check
(``COMMLIB_AUTOTUNE_RECHECK``), which times the probed sizes again, finds the host faster and
probes again.
Every all-reduce is checked against its definition, across the model's change (a planned call on
the same tensor before and after it). Prints, on rank 0, what the test asserts."""

import json
import os
import subprocess
import sys
import time

import torch

HOG = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"
hogs = []
if os.environ.get("PMI_RANK", "0") == "0":
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2 * (os.cpu_count() or 1))]

import commlib  # noqa: E402
from commlib.tuning.calibration import load  # noqa: E402

try:
    commlib.init()
finally:
    for h in hogs:
        h.kill()
        h.wait()
world = commlib.get_world_group()
before = world.model.source
commlib.barrier()
t = torch.empty(1 << 20)  # 4 MiB: a check of the clock every 15 pairs of calls
base = torch.arange(1 << 20, dtype=torch.float32)
expected = world.size * base + sum(range(world.size))
a = torch.empty(1000)
calls, start = 0, time.perf_counter()
while world.model.probed < 2 and calls < 20000:  # the model changes at the same call everywhere
    t.copy_(base + world.rank)
    a.fill_(world.rank + 1.0)
    # a check may come in either call: in the blocking one, with the async one pending
    work = commlib.all_reduce(a, async_op=True)
    commlib.all_reduce(t)
    work.wait()
    assert torch.equal(t, expected), (calls, t[:4], expected[:4])
    assert torch.equal(a, torch.full((1000,), world.size * (world.size + 1) / 2)), (calls, a[:4])
    calls += 2
waited = time.perf_counter() - start
for _ in range(3):  # after the change: the plan of the old choice is gone, results still right
    t.copy_(base + world.rank)
    commlib.all_reduce(t)
    assert torch.equal(t, expected), t[:4]
if world.rank == 0:
    doc = load() or {"groups": {}}
    print(json.dumps({"before": before, "after": world.model.source, "probed": world.model.probed,
                      "calls": calls, "waited": waited, "hook": world.on_all_reduce is not None,
                      "groups": doc["groups"]}))
commlib.finalize()
sys.exit(0)
