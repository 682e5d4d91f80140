"""One rank of a fault-injection job (run by tests/test_faults.py).

``worker.py BACKEND FAULT VICTIM KINDS SEED REPORT``

* BACKEND: ``mpi`` (the MPI engine, no shared memory), ``shm`` (commlib's shared-memory
  collectives, forced with ``algorithm=``, over whichever engine the launcher gives), ``gloo``
  (the torch engine over gloo, no shared memory).
* FAULT: ``kill`` or ``stop`` (the victim sends itself SIGKILL or SIGSTOP from a timer thread
  that fires a random 0-3 ms after it entered the collective, so the signal lands inside it, or
  inside the next one), or ``raise`` (the victim's own code raises, before the collective or
  after issuing it asynchronously, and the exception is caught by its "trainer").
* VICTIM: the rank that fails. KINDS: collective kinds separated by commas, one fault round
  each (``kill`` and ``stop`` have one round: the victim is gone). SEED: every rank draws the
  same operation index and delays from it. REPORT: a file every rank appends lines to.

Every rank runs the collective of the round correctly for a random number of operations (each
result checked), then the victim fails at the next one and the survivors keep calling the
collective until it raises. Lines written (``time.time()`` stamps; one host, one clock)::

    rank R pid P start
    rank R fault FAULT kind KIND op I at T          (the victim, just before failing)
    rank R caught ERROR kind KIND op I at T: MESSAGE (a survivor; the message on one line)
    rank R restarted round K sum S at T              (raise: after destroy_process_group + init)
    rank R done

In raise mode every rank then calls ``commlib.destroy_process_group()`` and ``commlib.init()``
again in the same process and checks an all-reduce over the new world before the next round.
Under mpiexec ranks leave with ``os._exit`` once reported (no MPI_Finalize with a dead or stopped
peer, which could wait forever); a stopped victim is killed by the test.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

import torch

# The torch engine under mpiexec: torch.distributed's env:// rendezvous from the MPI launcher's
# rank (MASTER_ADDR, MASTER_PORT and WORLD_SIZE are given by the test), as a user does who starts
# a gloo program with mpiexec.
if "PMI_RANK" in os.environ and os.environ.get("COMMLIB_BACKEND") == "torch":
    os.environ.setdefault("RANK", os.environ["PMI_RANK"])
    os.environ.setdefault("LOCAL_RANK", os.environ["PMI_RANK"])

import commlib  # noqa: E402

BACKEND, FAULT, VICTIM, KINDS, SEED, REPORT = (
    sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","), int(sys.argv[5]), sys.argv[6])
NUMEL = 3 * 4 * 1024 * 16  # 768 KiB of float32 a rank: multi-chunk on shm, divisible by 1..4 ranks
SHM_KINDS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")


def say(line: str) -> None:
    fd = os.open(REPORT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def algorithm(kind: str, rng: random.Random) -> dict:
    if BACKEND != "shm":
        return {}
    if kind == "all_reduce":
        return {"algorithm": rng.choice(["shm_oneshot", "shm_twoshot"])}
    return {"algorithm": "shm"}


def collective(kind: str, r: int, n: int, i: int, algo: dict, async_op: bool = False):
    """Start operation ``i`` of ``kind``; returns (Work or None, check) where ``check()`` asserts
    the result after completion."""
    v = float(i + 1)
    root = i % n
    if kind == "all_reduce":
        t = torch.full((NUMEL,), v * (r + 1))
        w = commlib.all_reduce(t, async_op=async_op, **algo)
        want = v * n * (n + 1) / 2
        return w, lambda: _check(t, torch.full_like(t, want))
    if kind == "broadcast":
        t = torch.full((NUMEL,), v if r == root else -1.0)
        w = commlib.broadcast(t, src=root, async_op=async_op, **algo)
        return w, lambda: _check(t, torch.full_like(t, v))
    if kind == "reduce":
        t = torch.full((NUMEL,), v * (r + 1))
        w = commlib.reduce(t, dst=root, async_op=async_op)
        want = v * n * (n + 1) / 2
        return w, lambda: _check(t, torch.full_like(t, want)) if r == root else None
    if kind == "all_gather_into_tensor":
        part = NUMEL // n
        out = torch.empty(part * n)
        w = commlib.all_gather_into_tensor(out, torch.full((part,), v + r), async_op=async_op, **algo)
        return w, lambda: _check(out, (v + torch.arange(n, dtype=torch.float32)).repeat_interleave(part))
    if kind == "reduce_scatter_tensor":
        part = NUMEL // n
        out = torch.empty(part)
        w = commlib.reduce_scatter_tensor(out, torch.full((part * n,), v * (r + 1)),
                                          async_op=async_op, **algo)
        return w, lambda: _check(out, torch.full_like(out, v * n * (n + 1) / 2))
    if kind == "all_to_all_single":
        part = NUMEL // n
        out = torch.empty(part * n)
        inp = (100 * r + torch.arange(n, dtype=torch.float32)).repeat_interleave(part) + v
        w = commlib.all_to_all_single(out, inp, async_op=async_op)
        want = (100 * torch.arange(n, dtype=torch.float32) + r).repeat_interleave(part) + v
        return w, lambda: _check(out, want)
    if kind == "barrier":
        return commlib.barrier(async_op=async_op), lambda: None
    raise SystemExit(f"unknown collective kind {kind!r}")


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:3].flatten().tolist()
        raise AssertionError(f"wrong result at {bad}: {got[bad].tolist()} != {want[bad].tolist()}")


def run(kind, r, n, i, algo):
    w, check = collective(kind, r, n, i, algo)
    if w is not None:
        w.wait()
    check()


def fire(sig: int, kind: str, i: int, r: int, delay: float) -> None:
    time.sleep(delay)
    say(f"rank {r} fault {FAULT} kind {kind} op {i} at {time.time():.4f}")
    os.kill(os.getpid(), sig)


def fault_round(round_no: int, kind: str, rng: random.Random, r: int, n: int) -> bool:
    """One round; returns True when this rank survived and caught an error (or is the victim of
    a raise)."""
    algo = algorithm(kind, rng)
    first = rng.randrange(1, 6)  # correct operations before the fault
    delay = rng.uniform(0.0, 0.003)
    after_issue = rng.random() < 0.5  # raise: before the call, or after issuing it async
    for i in range(first):
        run(kind, r, n, i, algo)
    i = first
    if r == VICTIM:
        if FAULT in ("kill", "stop"):
            sig = signal.SIGKILL if FAULT == "kill" else signal.SIGSTOP
            threading.Thread(target=fire, args=(sig, kind, i, r, delay), daemon=True).start()
            while True:  # the signal lands inside this collective or the next
                run(kind, r, n, i, algo)
                i += 1
        try:  # raise: the trainer's step fails on this rank only
            if after_issue:
                collective(kind, r, n, i, algo, async_op=True)  # issued, never waited for
            say(f"rank {r} fault raise kind {kind} op {i} at {time.time():.4f}")
            raise RuntimeError(f"injected failure on rank {r}")
        except RuntimeError:
            return True
    start = time.time()
    try:
        for i in range(first, first + 200):
            run(kind, r, n, i, algo)
    except Exception as exc:  # noqa: BLE001 -- any exception is reported; the test judges its type
        text = " ".join(str(exc).split())
        say(f"rank {r} caught {type(exc).__name__} kind {kind} op {i} at {time.time():.4f} "
            f"(entered {start:.4f}): {text}")
        return True
    say(f"rank {r} completed kind {kind}: 200 operations after the fault without an error")
    return False


def restart(round_no: int, r: int, n: int) -> None:
    """The trainer's recovery: release everything, rendezvous again, check the new world."""
    commlib.destroy_process_group()
    commlib.init()
    assert commlib.get_world_size() == n and commlib.get_rank() == r
    t = torch.full((1000,), float(r + 1))
    commlib.all_reduce(t)
    _check(t, torch.full_like(t, n * (n + 1) / 2))
    say(f"rank {r} restarted round {round_no} sum {t[0].item():g} at {time.time():.4f}")


def main() -> None:
    commlib.init()
    r, n = commlib.get_rank(), commlib.get_world_size()
    say(f"rank {r} pid {os.getpid()} start")
    world = commlib.get_world_group()
    engine = commlib.get_backend()
    want = {"mpi": "mpi", "gloo": "torch"}.get(BACKEND)
    assert want is None or engine == want, f"backend {BACKEND}: running on engine {engine}"
    assert (world.shm is not None) == (BACKEND == "shm"), f"backend {BACKEND}: segment {world.shm}"
    rng = random.Random(SEED)
    for round_no, kind in enumerate(KINDS):
        if BACKEND == "shm":
            assert kind in SHM_KINDS, f"{kind} has no shared-memory algorithm"
        ok = fault_round(round_no, kind, rng, r, n)
        if FAULT != "raise" or not ok:
            break
        restart(round_no, r, n)
    say(f"rank {r} done")
    sys.stdout.flush()
    sys.stderr.flush()
    # No clean shutdown after a peer died or stopped (MPI_Finalize or a destroyed gloo group could
    # wait for it); in raise mode the world is whole again and finalizes normally.
    if FAULT != "raise":
        if FAULT == "stop":
            # the other survivor may still be inside its timeout: under mpiexec, hydra kills the
            # job's ranks once one leaves without MPI_Finalize, so leaving first could end the
            # other before it reports (seen once in CI: rank 0 reported and left, rank 2 never did)
            time.sleep(float(os.environ.get("COMMLIB_TIMEOUT", "3")) + 1)
        os._exit(0)
    commlib.destroy_process_group()


if __name__ == "__main__":
    main()
