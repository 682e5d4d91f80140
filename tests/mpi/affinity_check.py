"""One rank of an affinity check (tests/test_affinity.py): prints, on rank 0, one JSON line with
every rank's CPU mask before ``commlib.init``, after it, after ``commlib.finalize``, its
torch thread counts at those points and its host."""

import json
import os
import socket

import torch

import commlib

before = sorted(os.sched_getaffinity(0))
threads_before = torch.get_num_threads()
commlib.init()
during = sorted(os.sched_getaffinity(0))
# every thread of the process, not only the caller's
threads_bound = sorted({tuple(sorted(os.sched_getaffinity(int(t))))
                        for t in os.listdir("/proc/self/task")})
row = dict(rank=commlib.get_rank(), host=socket.gethostname(), before=before, during=during,
           all_threads=[list(t) for t in threads_bound], threads_before=threads_before,
           threads_during=torch.get_num_threads())
rows = [None] * commlib.get_world_size()
commlib.all_gather_object(rows, row)
commlib.finalize()
row_after = dict(after=sorted(os.sched_getaffinity(0)), threads_after=torch.get_num_threads())
commlib.init()
rows_after = [None] * commlib.get_world_size()
commlib.all_gather_object(rows_after, row_after)
if commlib.get_rank() == 0:
    print("ROWS " + json.dumps([{**a, **b} for a, b in zip(rows, rows_after)]), flush=True)
commlib.finalize()
