"""Asynchronous operations advance while the caller computes (commlib's progress thread).

Run by tests/test_progress.py on real ranks: under mpiexec (the mpi engine: collectives through
the shared-memory segment, the engine's own, and commlib's point-to-point algorithms) and with
torchrun's variables (the torch engine on gloo).

Causality, not speed: rank 0 issues an operation, then computes for ``COMPUTE_S`` seconds (a
hundred times the operation's length) without calling commlib, while the other ranks wait for it.
A multi-step algorithm (ring, the shared-memory two-shot) cannot finish before rank 0 has posted
its later steps, which only the progress thread can do while rank 0 computes. So with the thread
the waiting ranks finish before rank 0's compute ends and rank 0 finds the operation completed
(``is_completed()``) right after its compute; without it (``COMMLIB_PROGRESS=wait``, the negative
control) they finish only after. The ranks share one host, hence one monotonic clock.
"""

import math
import time

import torch
from _harness import main

import commlib
from commlib.runtime.progress import lane_of, set_progress
from commlib.topology.affinity import host_cpu_count

# The computing rank's one-host progress thread is niced (19): while the other ranks wait by
# polling on cores they outnumber, it gets ~1.5% of a core and each of its wake-ups may wait tens
# of ms (0.6 s was once not enough for a 1 MiB ring at 3 ranks on gloo). 2 s leaves room.
COMPUTE_S = 2.0
# While every algorithm's operations are in flight at once (five or six), per core's worth of
# ranks: where the ranks outnumber the cores, the waiting ranks poll on the cores and the
# niced thread is starved harder. At 4 ranks on 2 cores they finished 0.6-1.0 s after the issue
# in a quiet phase of the host, and once not within 4 s (a CI run in a slow phase): 8 s there.
COMPUTE_ALL_S = 4.0
COUNT = 1 << 18  # 1 MiB of float32


def compute(seconds: float) -> float:
    """Matmuls until ``seconds`` have passed (no commlib call); the time it ended."""
    a = torch.randn(128, 128)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
    return time.monotonic()


def data(rank: int, count: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank + 1)
    return torch.randint(0, 8, (count,), generator=g).float()  # exact sums


def algorithms() -> list[str]:
    names = ["ring", "native"]
    if commlib.get_world_group().shm is not None:
        names.append("shm_twoshot")
    return names


def _issue(kind: str, algo: str):
    """Start ``kind`` with ``algo``; return (work, check) where check() asserts the result."""
    r, n = commlib.get_rank(), commlib.get_world_size()
    if kind == "all_reduce":
        x = data(r, COUNT)
        want = sum(data(k, COUNT) for k in range(n))
        return commlib.all_reduce(x, algorithm=algo, async_op=True), lambda: torch.equal(x, want)
    out = torch.empty(n * COUNT // 4)
    want = torch.cat([data(k, COUNT // 4) for k in range(n)])
    w = commlib.all_gather_into_tensor(out, data(r, COUNT // 4), algorithm=algo, async_op=True)
    return w, lambda: torch.equal(out, want)


def _race(ops, seconds: float = COMPUTE_S, nap: bool = False):
    """The operations ``ops`` ((kind, algorithm) pairs) issued together, then rank 0 computes for
    ``seconds`` while the others wait for them; returns (for each, whether rank 0 found it
    completed right after its compute; rank 0's compute end; the other ranks' wait ends), the
    same on every rank. ``nap`` (their own progress threads advance them): the others wait
    asleep, checking every 2 ms, instead of polling in ``wait()``, so that where the ranks
    outnumber the cores their polls do not starve rank 0's niced thread, whose progress is what
    the race tests."""
    r, k = commlib.get_rank(), len(ops)
    commlib.barrier()
    issued = [_issue(kind, algo) for kind, algo in ops]
    completed, ended = [True] * k, 0.0
    if r == 0:
        ended = compute(seconds)
        completed = [work.is_completed() for work, _ in issued]
    elif nap:
        while not all(work.is_completed() for work, _ in issued):
            time.sleep(0.002)
    for work, _ in issued:
        work.wait()
    waited = time.monotonic()
    for (kind, algo), (_, check) in zip(ops, issued):
        assert check(), f"{kind} {algo}: wrong result on rank {r}"
    times = torch.tensor([*map(float, completed), ended, waited], dtype=torch.float64)
    rows = torch.empty(commlib.get_world_size() * (k + 2), dtype=torch.float64)
    commlib.all_gather_into_tensor(rows, times)
    rows = rows.view(-1, k + 2)
    return [bool(x) for x in rows[0, :k]], float(rows[0, k]), rows[1:, k + 1].tolist()


def case_progress_while_computing():
    """Every algorithm, all-reduce and all-gather, all in flight at once: complete when rank 0's
    compute ends, and the other ranks were not held up by it."""
    set_progress("thread")
    ops = [(kind, "shm" if kind == "all_gather" and algo == "shm_twoshot" else algo)
           for kind in ("all_reduce", "all_gather") for algo in algorithms()]
    crowded = math.ceil(commlib.get_world_size() / host_cpu_count())  # the ranks share one host
    completed, ended, waits = _race(ops, COMPUTE_ALL_S * crowded, nap=True)
    missed = [op for op, done in zip(ops, completed) if not done]
    assert not missed, f"{missed}: not completed by the end of rank 0's compute"
    late = [w - ended for w in waits if w > ended]
    assert not late, (f"{ops}: ranks waited {late} s past rank 0's compute: nothing advanced "
                      f"rank 0's side meanwhile")


def case_no_progress_without_the_thread():
    """The negative control: with COMMLIB_PROGRESS=wait, a multi-step operation waits for rank 0
    to finish computing (so the test above can fail)."""
    if commlib.get_world_size() < 2:
        return
    previous = set_progress("wait")
    try:
        algos = ("ring",) + (("shm_twoshot",) if "shm_twoshot" in algorithms() else ())
        _, ended, waits = _race([("all_reduce", algo) for algo in algos])
        assert all(w >= ended for w in waits), (algos, ended, waits)
    finally:
        set_progress(previous)


def case_auto_thread_only_where_a_core_is_free():
    """COMMLIB_PROGRESS=auto (the default) on one host: the world's operations get the (local)
    progress thread only when the host has more cores than ranks. Where it has not (2 to 4 ranks
    on this 2-core machine), a multi-step all-reduce waits for rank 0's compute, as with wait;
    where it has, it completes during it."""
    n = commlib.get_world_size()
    previous = set_progress("auto")
    try:
        free = n < host_cpu_count()  # the host's CPUs, not the share commlib bound this rank to
        lane = lane_of(commlib.get_world_group())
        assert lane == ("local" if free else None), (lane, n, host_cpu_count())
        if n < 2:
            return
        (completed,), ended, waits = _race([("all_reduce", "ring")])
        if free:
            assert completed and all(w <= ended for w in waits), (ended, waits)
        else:
            assert all(w >= ended for w in waits), (ended, waits)
    finally:
        set_progress(previous)


def case_async_beside_blocking():
    """Asynchronous operations in flight (advanced by the progress thread) interleaved with
    blocking ones on the same group and engine, many times: results stay exact (the shared-
    memory segment and each Work are advanced by one thread at a time)."""
    set_progress("thread")
    r, n = commlib.get_rank(), commlib.get_world_size()
    algos = algorithms()
    for i in range(40):
        a = data(r + i, 5000)
        w1 = commlib.all_reduce(a, algorithm=algos[i % len(algos)], async_op=True)
        out = torch.empty(n * 3000)
        w2 = commlib.all_gather_into_tensor(out, data(r + i, 3000), async_op=True)
        b = data(r + 2 * i, 7000)
        commlib.all_reduce(b)  # blocking, while w1 and w2 may be in the progress thread
        compute(0.002 * (i % 3))
        if i % 2:
            w1.wait()
            w2.wait()
        else:
            w2.wait()
            w1.wait()
        assert torch.equal(a, sum(data(k + i, 5000) for k in range(n))), i
        assert torch.equal(b, sum(data(k + 2 * i, 7000) for k in range(n))), i
        assert torch.equal(out, torch.cat([data(k + i, 3000) for k in range(n)])), i
        assert w1.exception() is None and w2.exception() is None


if __name__ == "__main__":
    main(globals())
