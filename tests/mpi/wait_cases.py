"""A caller waiting on a group across hosts sleeps between polls (commlib.runtime.progress).

Run by tests/test_progress.py on two virtual hosts (COMMLIB_TEST_HOST a and b, one rank each):
rank 1 joins each all-reduce ``LATE_S`` late, so rank 0 waits that long in it. Past
``WAIT_SPIN_S`` its thread naps between polls and uses a small share of a core; with the spin
made endless (the negative control, as before) it uses most of one. Both get the exact sum.
"""

import time

import torch
from _harness import main

import commlib
from commlib.runtime import progress

LATE_S = 1.0
COUNT = 1 << 16


def data(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank + 1)
    return torch.randint(0, 8, (COUNT,), generator=g).float()  # exact sums


def _late_all_reduce(async_op: bool) -> tuple[float, float]:
    """One all-reduce that rank 1 joins LATE_S late; (thread CPU s, wall s) of the call and
    wait."""
    r = commlib.get_rank()
    x, want = data(r), data(0) + data(1)
    commlib.barrier()
    if r == 1:
        time.sleep(LATE_S)
    cpu, wall = time.thread_time(), time.monotonic()
    work = commlib.all_reduce(x, algorithm="ring", async_op=async_op)
    if async_op:
        work.wait()
    cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
    assert torch.equal(x, want), (x[:4], want[:4])
    return cpu, wall


def case_a_wait_across_hosts_naps():
    group = commlib.get_world_group()
    assert progress.wait_nap(group) == 1e-6 * commlib.config.get("progress_remote_fast_us")
    for async_op in (False, True):
        cpu, wall = _late_all_reduce(async_op)
        if commlib.get_rank() == 0:
            assert wall > 0.8 * LATE_S, (async_op, wall)
            assert cpu < 0.2 * wall, (async_op, cpu, wall)  # naps: about 5% measured


def case_b_endless_spin_takes_the_core():
    """The negative control: the same wait spinning (and yielding) throughout."""
    spin, progress.WAIT_SPIN_S = progress.WAIT_SPIN_S, float("inf")
    try:
        cpu, wall = _late_all_reduce(False)
    finally:
        progress.WAIT_SPIN_S = spin
    if commlib.get_rank() == 0:
        assert cpu > 0.4 * wall, (cpu, wall)  # rank 1 sleeps: nothing else wants this core


if __name__ == "__main__":
    main(globals())
