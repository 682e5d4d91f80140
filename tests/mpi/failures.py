"""Ranks that disagree or stall: one scenario per run, chosen by argv[1]. Under COMMLIB_DEBUG=1 or
COMMLIB_TIMEOUT_MODE=raise each rank catches its error, checks the message and prints
"caught <kind> rank R"; the pytest side counts those lines, so every rank must have raised."""

import sys
import time

import torch

import commlib

commlib.init()
r, n = commlib.get_rank(), commlib.get_world_size()
scenario = sys.argv[1]


def expect(exc_type, *fragments):
    class Catch:
        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            assert kind is not None, f"rank {r}: {scenario} raised nothing"
            assert issubclass(kind, exc_type), f"rank {r}: {kind.__name__}: {exc}"
            for fragment in fragments:
                assert fragment in str(exc), f"rank {r}: {fragment!r} not in {exc}"
            print(f"caught {kind.__name__} rank {r}", flush=True)
            return True

    return Catch()


if scenario == "debug_shape":
    with expect(commlib.CommMismatchError, "all_reduce", "differ from rank 0", "shape=(4,)",
                "shape=(5,)"):
        commlib.all_reduce(torch.ones(4 if r == 0 else 5))
elif scenario == "debug_dtype_op_root":
    with expect(commlib.CommMismatchError, "dtype=float64"):
        commlib.all_reduce(torch.ones(3, dtype=torch.float64 if r == n - 1 else torch.float32))
    with expect(commlib.CommMismatchError, "op=MAX"):
        commlib.all_reduce(torch.ones(3), op="max" if r == 1 else "sum")
    with expect(commlib.CommMismatchError, "root="):
        commlib.broadcast(torch.ones(3), src=r % 2)
elif scenario == "debug_collective":
    with expect(commlib.CommMismatchError, "broadcast(", "all_reduce("):
        if r == 0:
            commlib.broadcast(torch.ones(2), src=0)
        else:
            commlib.all_reduce(torch.ones(2))
elif scenario == "debug_local_error":
    if r == 1:  # this rank's own arguments are bad: it raises its own error...
        with expect(commlib.CommArgumentError, "AVG is defined on floating dtypes"):
            commlib.all_reduce(torch.ones(2, dtype=torch.int32), op="avg")
    else:  # ...and the others learn of it instead of waiting
        with expect(commlib.CommMismatchError, "ranks [1] failed their argument checks"):
            commlib.all_reduce(torch.ones(2, dtype=torch.int32))
elif scenario == "timeout_raise":  # rank 0 skips a collective
    if r != 0:
        t0 = time.monotonic()
        with expect(commlib.CommTimeoutError, "all_reduce", "operation #1", "'world'",
                    "did not complete within 2 s"):
            commlib.all_reduce(torch.ones(2))
        assert time.monotonic() - t0 < 10
        with expect(commlib.CommStateError, "unusable after an earlier failure"):
            commlib.all_reduce(torch.ones(2))
    else:
        print(f"caught skipped rank {r}", flush=True)
    time.sleep(0.5)
elif scenario == "work_wait_timeout":
    w = commlib.all_reduce(torch.ones(2), async_op=True, algorithm="ring") if r else None
    if r:
        with expect(commlib.CommTimeoutError, "operation #1", "within 1 s"):
            w.wait(timeout=1)
    else:
        print(f"caught skipped rank {r}", flush=True)
    time.sleep(0.5)
elif scenario == "timeout_abort":  # the watchdog ends the job
    if r != 0:
        commlib.all_reduce(torch.ones(2))
    time.sleep(60)
elif scenario == "uncaught":
    if r == n - 1:
        raise RuntimeError(f"boom on rank {r}")
    commlib.all_reduce(torch.ones(2))  # the others would wait here forever
    time.sleep(60)
else:
    raise SystemExit(f"unknown scenario {scenario}")
