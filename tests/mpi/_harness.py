"""Runs case functions of a test script on every rank of an MPI job.

Usage inside ``tests/mpi/foo.py``::

    from _harness import main
    def case_sum(): ...
    if __name__ == "__main__":
        main(globals())

``python foo.py`` runs every ``case_*``; ``python foo.py case_sum`` runs only those named. A failing
case prints ``FAILED rank R case: traceback`` and the uncaught exception aborts the whole job
(commlib's abort-on-exception hook), so the pytest side sees a non-zero exit, not a hang.
"""

from __future__ import annotations

import faulthandler
import sys
import traceback

import torch

torch.set_num_threads(1)

STACKS_AFTER = 50  # s: under commlib's 60 s test timeout, so that a hang's stacks come first


def expect_error(fn, *words, kind=None):
    """Call ``fn`` and assert that it raises ``kind`` (default ``commlib.CommArgumentError``)
    whose message contains every one of ``words``."""
    from commlib import CommArgumentError

    kind = kind or CommArgumentError
    try:
        fn()
    except kind as exc:
        text = str(exc)
        for w in words:
            assert w in text, (w, text)
        return
    raise AssertionError(f"no {kind.__name__}; expected one mentioning {words}")


def main(namespace: dict, *modules) -> None:
    """Run the ``case_*`` functions of ``namespace`` and of ``modules`` (shared case files)."""
    import commlib

    # a crash (a signal, an abort in C++) prints every thread's Python stack to stderr
    faulthandler.enable(all_threads=True)
    commlib.init()
    rank = commlib.get_rank()
    cases = {k: v for k, v in namespace.items() if k.startswith("case_")}
    for module in modules:
        cases.update({k: v for k, v in vars(module).items() if k.startswith("case_")})
    names = sys.argv[1:] or sorted(cases)
    for name in names:
        # a case still running after STACKS_AFTER s writes every thread's stack to stderr (the
        # test prints each rank's stderr on failure): a rare hang then shows where each rank was
        faulthandler.dump_traceback_later(STACKS_AFTER, exit=False)
        try:
            cases[name]()
        except BaseException:
            sys.stderr.write(f"FAILED rank {rank} {name}:\n{traceback.format_exc()}")
            sys.stderr.flush()
            raise
        finally:
            faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            print(f"ok {name} (world size {commlib.get_world_size()})", flush=True)
    commlib.barrier()


def init_gloo() -> None:
    """torch.distributed's gloo group over the job's ranks, for a case that compares with or runs
    under it: torchrun's (commlib.init() made it) or, under mpiexec, one made here on a port
    rank 0 picks and broadcasts with commlib."""
    import os
    import socket

    import torch.distributed as dist

    import commlib

    if dist.is_initialized():
        return
    rank, p = commlib.get_rank(), commlib.get_world_size()
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    commlib.broadcast(port, src=0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port)}", rank=rank,
                            world_size=p)
