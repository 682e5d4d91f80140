"""Ranks that disagree or stall. ``argv[1]`` picks a set of scenarios run one after another in one
job:

* ``debug`` (COMMLIB_DEBUG=1): ranks disagree on shape, dtype, op, root, the collective, or one
  rank's own arguments fail; every rank must raise within a few seconds, naming the ranks.
* ``always`` (no COMMLIB_DEBUG): on the shared-memory path, ranks that disagree on the count,
  dtype, op, root or the collective raise CommMismatchError on every rank, naming both calls
  (the segment compares the calls published with each step), and the group stays usable; the
  ring on the MPI engine turns a truncated message into CommMismatchError.
* ``timeout`` (COMMLIB_TIMEOUT_MODE=raise, COMMLIB_TIMEOUT=3): a rank skips a collective; the
  others raise CommTimeoutError naming op, group and sequence number, then the group is unusable.
  Each scenario runs on its own group, so the world stays usable and the skipped call is made up
  at the end (the engine is left with nothing pending).
* ``abort`` (default mode, COMMLIB_TIMEOUT=2): Work.wait(timeout=) still raises; then a skipped
  blocking collective makes the watchdog end the job.
* ``uncaught``: an exception on one rank ends the job.
* ``uncaught_torch``: the same after ``torch.distributed.init_process_group("commlib")``, whose
  excepthook captures stderr around commlib's (which ends the job): the traceback still shows.

Each rank checks its own exception and message; rank 0 gathers what every rank caught (through
mpi4py, not commlib) and prints one line per scenario: ``caught <scenario> <Error> ranks [..]``.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import commlib
import commlib.torch_backend

commlib.init()
r, n = commlib.get_rank(), commlib.get_world_size()
report: list[tuple[str, str]] = []


class expect:
    """The block must raise ``exc_type`` with every fragment in its message, within ``limit`` s
    (and, for timeouts, after at least ``at_least`` s)."""

    def __init__(self, scenario, exc_type, *fragments, limit=5.0, at_least=0.0):
        self.scenario, self.exc_type, self.fragments = scenario, exc_type, fragments
        self.limit, self.at_least = limit, at_least

    def __enter__(self):
        self.start = time.monotonic()
        return self

    def __exit__(self, kind, exc, tb):
        took = time.monotonic() - self.start
        where = f"rank {r} {self.scenario}"
        assert kind is not None, f"{where}: raised nothing"
        if not issubclass(kind, self.exc_type):
            return False  # the unexpected exception propagates and ends the job
        for fragment in self.fragments + ("Fix:",):
            assert fragment in str(exc), f"{where}: {fragment!r} not in {exc}"
        assert self.at_least <= took <= self.limit, f"{where}: raised after {took:.2f} s"
        report.append((self.scenario, kind.__name__))
        self.exc = exc
        os.write(1, f"rank {r} caught {self.scenario} {kind.__name__}\n".encode())
        return True


def summary():
    everything = MPI.COMM_WORLD.gather(report, root=0)
    if r == 0:
        caught: dict[tuple[str, str], list[int]] = {}
        for rank, items in enumerate(everything):
            for scenario, kind in items:
                caught.setdefault((scenario, kind), []).append(rank)
        lines = [f"caught {s} {k} ranks {ranks}" for (s, k), ranks in sorted(caught.items())]
        print("\n".join(lines), flush=True)


def others(*ranks):
    return [k for k in range(n) if k not in ranks]


def debug_scenarios():
    Mismatch = commlib.CommMismatchError
    last, rest = n - 1, others(n - 1)
    names = f"ranks [{last}] differ from ranks {rest}"
    with expect("shape", Mismatch, "commlib.all_reduce", names, "shape=(4,)", "shape=(5,)",
                "operation #1", "'world'"):
        commlib.all_reduce(torch.ones(5 if r == last else 4))
    with expect("dtype", Mismatch, names, "dtype=float64", "dtype=float32", "operation #1"):
        commlib.all_reduce(torch.ones(3, dtype=torch.float64 if r == last else torch.float32))
    with expect("op", Mismatch, names, "op=MAX", "op=SUM"):
        commlib.all_reduce(torch.ones(3), op="max" if r == last else "sum")
    with expect("root", Mismatch, "commlib.broadcast", names, "root=0", f"root={last}"):
        commlib.broadcast(torch.ones(3), src=last if r == last else 0)
    with expect("reduce_root", Mismatch, "commlib.reduce", names, "root=0", f"root={last}"):
        commlib.reduce(torch.ones(3), dst=last if r == last else 0)
    # rank 0 calls all_reduce, the others broadcast: rank 0 is the odd one out (at 2 ranks,
    # a tie, rank 1 is named against rank 0)
    odd = "ranks [1] differ from ranks [0]" if n == 2 else f"ranks [0] differ from ranks {others(0)}"
    with expect("collective", Mismatch, odd, "all_reduce(", "broadcast("):
        if r == 0:
            commlib.all_reduce(torch.ones(2))
        else:
            commlib.broadcast(torch.ones(2), src=0)
    with expect("barrier_vs_gather", Mismatch, "barrier(", "all_gather_into_tensor("):
        if r == last:
            commlib.barrier()
        else:
            commlib.all_gather_into_tensor(torch.empty(n), torch.ones(1))
    with expect("algorithm", Mismatch, names, "algorithm=ring", "algorithm=native"):
        commlib.all_reduce(torch.ones(8), algorithm="ring" if r == last else "native")
    with expect("reduce_scatter_op", Mismatch, names, "op=MIN", "op=SUM"):
        commlib.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n), op="min" if r == last else "sum")
    if r == last:  # this rank's own arguments are bad: it raises its own error...
        with expect("local_error", commlib.CommArgumentError, "AVG is defined on floating dtypes"):
            commlib.all_reduce(torch.ones(2, dtype=torch.int32), op="avg")
    else:  # ...and the others learn of it instead of waiting, with its message
        with expect("local_error", Mismatch, f"ranks [{last}] failed their argument checks",
                    "AVG is defined on floating dtypes"):
            commlib.all_reduce(torch.ones(2, dtype=torch.int32))
    if r == last:
        with expect("local_error_gather", commlib.CommArgumentError, "'output_tensor'", "group size"):
            commlib.all_gather_into_tensor(torch.empty(n + 1), torch.ones(1))
    else:
        with expect("local_error_gather", Mismatch, f"ranks [{last}] failed"):
            commlib.all_gather_into_tensor(torch.empty(n), torch.ones(1))
    # after all that, the world is still in step and usable
    t = torch.ones(3)
    commlib.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(n))), t


def always_scenarios():
    Mismatch = commlib.CommMismatchError
    assert "COMMLIB_DEBUG" not in os.environ and commlib.get_world_group().shm is not None
    last, rest = n - 1, others(n - 1)
    names = f"ranks [{last}] differ from ranks {rest}"
    odd = "ranks [1] differ from ranks [0]" if n == 2 else f"ranks [0] differ from ranks {others(0)}"
    cases = [
        ("count", ("commlib.all_reduce", names, "count=4", "count=5", "operation #1", "'world'"),
         lambda: commlib.all_reduce(torch.ones(5 if r == last else 4))),
        ("dtype", (names, "dtype=float64", "dtype=float32", "operation #3"),
         lambda: commlib.all_reduce(torch.ones(3, dtype=torch.float64 if r == last else torch.float32))),
        ("op", (names, "op=MAX", "op=SUM"),
         lambda: commlib.all_reduce(torch.ones(3), op="max" if r == last else "sum")),
        ("root", ("commlib.broadcast", names, "root=0", f"root={last}"),
         lambda: commlib.broadcast(torch.ones(3), src=last if r == last else 0)),
        ("collective", (odd, "all_reduce(count=2, dtype=float32", "all_gather_into_tensor(count=2"),
         lambda: commlib.all_reduce(torch.ones(2)) if r == 0
         else commlib.all_gather_into_tensor(torch.empty(2 * n), torch.ones(2))),
        ("async", (names, "count=1000", "count=1001"),  # found by Work.wait()
         lambda: commlib.all_reduce(torch.ones(1001 if r == last else 1000), async_op=True).wait()),
    ]
    for scenario, fragments, call in cases:
        with expect(scenario, Mismatch, *fragments) as e:
            call()
        if r == 0 and scenario == "count":
            # one write: print's text and its newline could reach the pipe apart, another
            # rank's line between them (seen in CI)
            os.write(1, f"message: {e.exc}\n".encode())
        t = torch.ones(3)  # the group stays in step and usable
        commlib.all_reduce(t)
        assert torch.equal(t, torch.full((3,), float(n))), (scenario, t)
    # the ring on the MPI engine: the rank whose receive is too small for the peer's chunk (4
    # vs 5 elements at 2 ranks: rank 0) has MPI's truncation error translated
    if n == 2:
        g = commlib.new_group(timeout=2)
        if r == 0:
            with expect("ring_truncated", Mismatch, "rank 0 of 2", "longer than its receive "
                        "buffer", "different sizes"):
                commlib.all_reduce(torch.ones(4), group=g, algorithm="ring")
        else:
            with expect("ring_truncated", commlib.CommTimeoutError, "commlib.all_reduce"):
                commlib.all_reduce(torch.ones(5), group=g, algorithm="ring")


def timeout_scenarios():
    Timeout, State = commlib.CommTimeoutError, commlib.CommStateError
    assert commlib.get_world_group().timeout == 3.0  # from COMMLIB_TIMEOUT
    g1 = commlib.new_group()  # inherits the world's 3 s
    g2 = commlib.new_group(timeout=2)  # the argument wins over the environment
    g3 = commlib.new_group(timeout=30)
    assert (g1.timeout, g2.timeout, g3.timeout) == (3.0, 2.0, 30.0)
    # A: rank 0 skips a blocking all_reduce
    if r != 0:
        with expect("blocking", Timeout, "commlib.all_reduce", "operation #1", f"group {g1.name!r}",
                    "within 3 s", "COMMLIB_DEBUG=1", limit=12, at_least=2.9):
            commlib.all_reduce(torch.ones(2), group=g1)
        with expect("unusable", State, "commlib.all_reduce", f"group {g1.name!r} is unusable",
                    "operation #1 (all_reduce) timed out", "restart", limit=1):
            commlib.all_reduce(torch.ones(2), group=g1)
        with expect("unusable_other_op", State, "commlib.broadcast", "is unusable", limit=1):
            commlib.broadcast(torch.ones(2), group=g1, group_src=0)
    # B: the root of a broadcast skips it, on a group with its own timeout
    if r != n - 1:
        with expect("broadcast", Timeout, "commlib.broadcast", "operation #1", f"group {g2.name!r}",
                    "within 2 s", limit=10, at_least=1.9):
            commlib.broadcast(torch.ones(2), group=g2, group_src=n - 1)
    # C: Work.wait(timeout=...) on an async operation rank 0 never joins
    if r != 0:
        w = commlib.all_reduce(torch.ones(1000), group=g3, async_op=True)
        assert not w.is_completed()
        with expect("work_wait", Timeout, "commlib.all_reduce", "operation #1", f"group {g3.name!r}",
                    "within 1 s", limit=8, at_least=0.9):
            w.wait(timeout=1)
        with expect("work_unusable", State, f"group {g3.name!r} is unusable", limit=1):
            commlib.all_reduce(torch.ones(2), group=g3)
    MPI.COMM_WORLD.Barrier()  # rank 0 waits longer than the world's timeout here
    # Make up the skipped calls so that no engine operation is left pending at exit.
    if r == 0:
        commlib.all_reduce(torch.ones(2), group=g1)
        commlib.all_reduce(torch.ones(1000), group=g3)
    if r == n - 1:
        commlib.broadcast(torch.ones(2), group=g2, group_src=n - 1)
    t = torch.ones(2)
    commlib.all_reduce(t)  # the world was never affected
    assert torch.equal(t, torch.full((2,), float(n)))


def abort_scenario():
    g = commlib.new_group()
    if r != 0:  # Work.wait(timeout=) raises in abort mode as well
        w = commlib.all_reduce(torch.ones(10), group=g, async_op=True)
        with expect("work_wait", commlib.CommTimeoutError, "operation #1", "within 1 s", limit=8):
            w.wait(timeout=1)
    commlib.barrier()
    os.write(1, f"rank {r} before the skipped all_reduce\n".encode())
    if r != 0:  # rank 0 skips: the watchdog ends the job
        commlib.all_reduce(torch.ones(2))
    time.sleep(60)
    raise SystemExit("the job was not ended")


def uncaught_scenario():
    if r == n - 1:
        raise RuntimeError(f"boom on rank {r}")
    commlib.all_reduce(torch.ones(2))  # the others would wait here forever
    time.sleep(60)
    raise SystemExit("the job was not ended")


def uncaught_torch_scenario():
    commlib.torch_backend.mpi_environment()
    dist.init_process_group("commlib")
    uncaught_scenario()


if __name__ == "__main__":
    {"debug": debug_scenarios, "always": always_scenarios, "timeout": timeout_scenarios, "abort": abort_scenario,
     "uncaught": uncaught_scenario, "uncaught_torch": uncaught_torch_scenario}[sys.argv[1]]()
    summary()
