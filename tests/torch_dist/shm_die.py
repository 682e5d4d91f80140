"""A rank killed in the middle of a shared-memory collective (run by tests/test_shm.py).

Ranks are started by the test itself with torchrun's variables, not by mpiexec: hydra answers a
rank killed by a signal by killing the others too, in some runs, even with -disable-auto-cleanup
(seen on a loaded machine), which would hide what the survivors do. The last rank starts a
multi-chunk all-reduce and SIGKILLs itself inside it; the others must raise CommBackendError
naming it, within seconds, and every later call on the group must raise the same at once. Each
survivor writes what happened to the file SHM_DIE_REPORT.
"""

import os
import signal
import time

import torch

import commlib


def say(line: str) -> None:
    with open(os.environ["SHM_DIE_REPORT"], "a") as f:
        f.write(line + "\n")


def main() -> None:
    commlib.init()
    r, n = commlib.get_rank(), commlib.get_world_size()
    assert commlib.get_world_group().shm is not None, "the test needs a shared-memory segment"
    t = torch.ones(200_000)
    commlib.all_reduce(t)  # everyone is in step and the segment works
    if os.environ.get("SHM_DIE_SHARED") == "1":
        # The survivors gather from a shared input (read in place), which they may not hand
        # back before every peer has read it; the last rank publishes its block and dies before
        # reading: they must not wait forever for it to finish reading.
        src = commlib.shared_empty(1000)
        src.fill_(float(r))
        out = torch.empty(n * 1000)
        if r == n - 1:
            work = commlib.all_gather_into_tensor(out, torch.ones(1000), async_op=True)
            work.is_completed()  # one chunk: publishes its block (the others are not there yet)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1.0)

        def collective():
            commlib.all_gather_into_tensor(out, src)
    else:
        if r == n - 1:  # posts its first chunk, then dies
            commlib.all_reduce(torch.ones(200_000), async_op=True)
            os.kill(os.getpid(), signal.SIGKILL)

        def collective():
            if os.environ.get("SHM_DIE_ASYNC") != "1":
                commlib.all_reduce(torch.ones(200_000))
                return
            # asynchronous, then compute: the progress thread meets the dead peer meanwhile,
            # stores the error, and wait() raises it
            work = commlib.all_reduce(torch.ones(200_000), async_op=True)
            a, end = torch.randn(128, 128), time.monotonic() + 1.0
            while time.monotonic() < end:
                a = torch.tanh(a @ a)
            if work.exception() is None:
                say(f"rank {r}: the failure was not found while computing")
            work.wait()
    start = time.monotonic()
    try:
        collective()
        say(f"rank {r} completed the collective without its peer")
    except commlib.CommBackendError as exc:
        took = time.monotonic() - start
        say(f"rank {r} caught CommBackendError after {took:.2f} s: {exc}")
        try:  # the group is unusable from now on, with the same error, at once
            commlib.all_reduce(torch.ones(4))
            say(f"rank {r} ran another all-reduce on the broken group")
        except commlib.CommBackendError:
            say(f"rank {r} unusable afterwards")
        except BaseException as again:
            say(f"rank {r} raised {again!r} afterwards")
    except BaseException as exc:
        say(f"rank {r} raised {exc!r}")
    # Stay until every survivor has reported: a survivor that exits early is itself a dead peer,
    # and one still waiting could name it instead of the killed rank.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(os.environ["SHM_DIE_REPORT"]) as f:
            if f.read().count(" afterwards") >= n - 1:
                break
        time.sleep(0.05)
    os._exit(0)  # no clean shutdown: a peer is gone


if __name__ == "__main__":
    main()
