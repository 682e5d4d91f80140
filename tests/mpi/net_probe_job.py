"""One job on two virtual hosts (tests/test_autotune.py): prints, on rank 0, the world's model
source and link between hosts, those of the subgroup of rank 0 and the last rank (one on each
host), the job's own ping-pong times between these two, and the bucket size ``ddp_bucket_mb``
proposes."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import commlib
import commlib.torch_backend
from commlib.tuning.model import DEFAULT_LINKS
from commlib.tuning.probe import NET_SIZES

commlib.init()
world = commlib.get_world_group()
last = world.size - 1  # on the other host than rank 0
sub = commlib.new_group([0, last])


def one_way(nbytes: int) -> float:
    """The fastest of 20 round trips between ranks 0 and ``last``, halved: the test's own
    timing."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for k in range(21):
        start = time.perf_counter()
        if world.rank == 0:
            commlib.send(buf, last)
            commlib.recv(buf, last)
        else:
            commlib.recv(buf, 0)
            commlib.send(buf, 0)
        if k:
            best = min(best, time.perf_counter() - start)
    return best / 2


times = {n: one_way(n) for n in NET_SIZES} if world.rank in (0, last) else {}
t = torch.arange(1000, dtype=torch.float32) + world.rank
commlib.all_reduce(t)
assert torch.equal(t, world.size * torch.arange(1000, dtype=torch.float32)
                   + sum(range(world.size))), t[:4]
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
commlib.torch_backend.mpi_environment()
dist.init_process_group("commlib")
model = torch.nn.Linear(512, 512)
bucket = commlib.torch_backend.ddp_bucket_mb(model)
if world.rank == 0:
    inter = world.model.table.inter
    print(json.dumps({"source": world.model.source, "sub": sub.model.source,
                      "inter": [inter.alpha, inter.beta],
                      "shard": [world.model.table.shard_inter.alpha,
                                world.model.table.shard_inter.beta],
                      "sub_inter": [sub.model.table.inter.alpha, sub.model.table.inter.beta],
                      "default": [DEFAULT_LINKS["net"].alpha, DEFAULT_LINKS["net"].beta],
                      "times": {str(n): s for n, s in times.items()}, "bucket_mb": bucket}))
dist.destroy_process_group()
commlib.finalize()
sys.exit(0)
