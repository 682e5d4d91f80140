"""Algorithm records on real ranks: a toy algorithm registered from a test file is chosen,
explained and run by ``commlib.all_reduce``; the CUDA IPC records are selected for CUDA
all-reduces of a one-host group where the kernels' rule names them, and NCCL otherwise, saying
why (host-side: no GPU here, so the transport is built from real group checks without buffers)."""

import logging

import torch
from _harness import main

import commlib
from commlib.algorithms import unregister_algorithm
from commlib.ops import ReduceOp
from commlib.runtime.resources import _facts
from commlib.transports import cuda_ipc as ipc
from commlib.tuning import explain_call, select


def case_toy_algorithm_is_chosen_explained_and_run():
    import toy_algorithm  # registers it (the CUDA case, before this one, runs without it)

    g = commlib.get_world_group()
    n, r = g.size, g.rank
    before = len(toy_algorithm.RUNS)
    text = str(commlib.explain("all_reduce", 4000))
    t = torch.arange(1000, dtype=torch.float32) * (r + 1)
    commlib.all_reduce(t)
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32) * (n * (n + 1) // 2)), t[:4]
    if n <= toy_algorithm.MAX_RANKS:
        assert "toy_pairwise" in text and "<- chosen" in text.split("toy_pairwise")[1].split("\n")[0], text
        assert len(toy_algorithm.RUNS) == before + 1  # it really ran
    else:  # its eligibility refused the group: explained, not run
        assert f"not eligible: toy_pairwise: {n} ranks: the toy handles at most 3" in text, text
        assert len(toy_algorithm.RUNS) == before
    # every dtype path of the API reaches it: bfloat16 upcast, AVG division, non-contiguous
    x = torch.full((6, 4), float(r + 1), dtype=torch.bfloat16)[:, ::2]
    commlib.all_reduce(x, op=ReduceOp.AVG)
    assert torch.equal(x.float(), torch.full((6, 2), (n + 1) / 2)), x
    unregister_algorithm("toy_pairwise")
    assert "toy_pairwise" not in str(commlib.explain("all_reduce", 4000))
    runs = len(toy_algorithm.RUNS)
    commlib.all_reduce(torch.ones(1000))
    assert len(toy_algorithm.RUNS) == runs  # the memoized choice was made again without it


def _usable_transport(n):
    """The CUDA IPC transport of ``n`` GPUs of one host, all NVLinked, from the records every
    rank would publish (the group check is the real one; only the buffers are missing)."""
    full = (1 << n) - 1
    records = [ipc.PeerRecord(7, 100 + j, f"gpu{j}", full, full) for j in range(n)]
    return ipc.CudaIpcTransport(ipc.check_group(records), n)


def case_cuda_ipc_selection_without_gpu():
    g = commlib.get_world_group()
    n, res = g.size, g.resources
    # the attach path, for real, over the engine: no CUDA here, the same reason on every rank
    assert "cuda_ipc" not in res.transports
    assert res.why_not["cuda_ipc"] == "rank 0 has no CUDA device (CUDA is absent there)", res.why_not
    facts = _facts(g.backend)._replace(cuda_devices=(1,) * n)
    why = ipc.CudaIpcTransport.attach(g.backend, g.name, facts)  # every rank claims a GPU: runs
    expect = ("rank 0 has no CUDA device (CUDA is absent there)" if n in ipc.WORLD_SIZES
              else f"world size {n} is not one of {ipc.WORLD_SIZES}")
    assert why == expect, why
    if n not in ipc.WORLD_SIZES:
        return
    # selection: the group as it would be with the kernels usable
    res.transports["cuda_ipc"] = _usable_transport(n)
    records = logging.getLogger("commlib")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    records.addHandler(handler)
    level = records.level
    records.setLevel(logging.INFO)
    try:
        small = select("all_reduce", 4096, g, None, "all_reduce", torch.float32, "cuda", ReduceOp.SUM)
        assert small.name == "cuda_ipc_oneshot", small.name
        big = select("all_reduce", 4 << 20, g, None, "all_reduce", torch.bfloat16, "cuda", ReduceOp.AVG)
        assert big.name == ("cuda_ipc_oneshot" if n == 2 else "cuda_ipc_twoshot"), big.name
        # the kernels' rule refuses: NCCL (the engine's own), with the reason logged
        for nbytes, dtype, op, reason in [
                (4096, torch.int32, ReduceOp.SUM, "dtype torch.int32 is not float32/float16/bfloat16"),
                (4100, torch.float32, ReduceOp.SUM, "4100 bytes is not a multiple of 16"),
                (4096, torch.float32, ReduceOp.BXOR, "op BXOR has no kernel"),
                (64 << 20, torch.float32, ReduceOp.SUM, "exceeds the registered buffer")]:
            pick = select("all_reduce", nbytes, g, None, "all_reduce", dtype, "cuda", op)
            assert pick.name == "native", (nbytes, dtype, op, pick.name)
            assert any("algorithm native" in m and reason in m for m in seen), (reason, seen[-3:])
        text = str(explain_call("all_reduce", 4096, g, torch.float32, "cuda", ReduceOp.SUM))
        assert "cuda_ipc_oneshot" in text and "<- chosen" in text.split("cuda_ipc_oneshot")[1].split("\n")[0], text
        assert "not eligible: cuda_ipc_twoshot" in text, text
        # CPU tensors never see the CUDA records, and keep their choice
        cpu = select("all_reduce", 4096, g, None, "all_reduce", torch.float32, "cpu", ReduceOp.SUM)
        assert not cpu.name.startswith("cuda_ipc"), cpu.name
        t = torch.full((1024,), 1.0)
        commlib.all_reduce(t)
        assert torch.equal(t, torch.full((1024,), float(n)))
        # a forced CUDA IPC algorithm on a CPU tensor runs the engine's own all-reduce
        commlib.all_reduce(t, algorithm="cuda_ipc_oneshot")
        assert torch.equal(t, torch.full((1024,), float(n * n)))
    finally:
        records.removeHandler(handler)
        records.setLevel(level)
        del res.transports["cuda_ipc"]
        commlib.tuning.clear_cache()


if __name__ == "__main__":
    main(globals())
