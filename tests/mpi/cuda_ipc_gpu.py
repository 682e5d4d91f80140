"""The real CUDA IPC path through ``commlib.all_reduce`` (needs 2+ GPUs of one host and CuPy; run
by tests/test_cuda_ipc.py only where CUDA is present): the NCCL engine's group attaches the
transport, selection picks the kernels where their rule names them, results match the
definition, and what the kernels cannot do runs on NCCL."""

import torch
from _harness import main

import commlib
from commlib.ops import ReduceOp
from commlib.tuning import select


def case_all_reduce_through_the_kernels():
    g = commlib.get_world_group()
    n, r = g.size, g.rank
    torch.cuda.set_device(r % torch.cuda.device_count())
    assert "cuda_ipc" in g.resources.transports, g.resources.why_not
    for count, dtype, op in [(1024, torch.float32, ReduceOp.SUM), (1 << 19, torch.bfloat16, ReduceOp.AVG),
                             (4096, torch.float16, ReduceOp.MAX), (1000, torch.int32, ReduceOp.SUM),
                             (1001, torch.float32, ReduceOp.SUM)]:
        size = torch.empty((), dtype=dtype).element_size() * count
        algo = select("all_reduce", size, g, None, "all_reduce", dtype, "cuda", op).name
        kernels = dtype is not torch.int32 and size % 16 == 0
        assert algo.startswith("cuda_ipc") == kernels, (count, dtype, op, algo)
        inputs = [(torch.arange(count, device="cuda") % 7 + j).to(dtype) for j in range(n)]
        t = inputs[r].clone()
        commlib.all_reduce(t, op=op)
        torch.cuda.synchronize()
        wide = torch.stack([x.double() for x in inputs])
        want = {ReduceOp.SUM: wide.sum(0), ReduceOp.AVG: wide.mean(0), ReduceOp.MAX: wide.max(0).values}[op]
        tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
        assert torch.allclose(t.double(), want.to(dtype).double(), rtol=tol, atol=tol), (count, dtype, op)


if __name__ == "__main__":
    main(globals())
