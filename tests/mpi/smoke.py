"""The README's first multi-rank example, as a case."""

import torch
from _harness import main

import commlib


def case_sum_of_ranks():
    n = commlib.get_world_size()
    t = torch.full((5,), float(commlib.get_rank() + 1))
    commlib.all_reduce(t)
    assert torch.equal(t, torch.full((5,), n * (n + 1) / 2)), t


if __name__ == "__main__":
    main(globals())
