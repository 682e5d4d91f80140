"""A typical data-parallel training loop written for torch.distributed, run by
tests/test_dropin.py as it is (plain torch.distributed over gloo, the reference) and as a copy in
which the one line ``import torch.distributed as dist`` reads ``import commlib as dist`` (under
torchrun's variables and under mpiexec). Nothing else in this file may change between the two:
it is the drop-in claim itself.

Rank 0 prints the final parameters as one line, ``PARAMS <json>``.
"""

import json

import torch
import torch.distributed as dist

STEPS = 6
BATCH = 8


def model_for(rank: int) -> torch.nn.Module:
    torch.manual_seed(1234 + rank)  # every rank starts from other weights: the broadcast fixes it
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def main():
    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = model_for(rank)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size
        opt.step()
    dist.barrier()
    if rank == 0:
        params = [p.detach().reshape(-1).tolist() for p in model.parameters()]
        print("PARAMS " + json.dumps(params), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
