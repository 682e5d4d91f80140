"""The hierarchical all-reduce on ranks split into virtual hosts (COMMLIB_TEST_HOST per rank).
argv[1]: the hosts of ranks 0..n-1, comma-separated (what the test launched)."""

import sys

import torch
from _harness import main
from algorithms import close, counts, data, reference

import commlib
from commlib.algorithms.hierarchical import communicators

HOSTS = sys.argv.pop(1).split(",")


def expected_hosts():
    order = {}
    for rank, h in enumerate(HOSTS):
        order.setdefault(h, []).append(rank)
    return list(order.values())


def case_layout():
    res = commlib.get_world_group().resources
    layout = res.layout
    assert [list(h) for h in layout.hosts] == expected_hosts(), (layout.hosts, HOSTS)
    local, cross = communicators(res)
    me = commlib.get_rank()
    mine = [h for h in layout.hosts if me in h][0]
    assert local.size == len(mine) and local.rank == mine.index(me)
    # my rail: the ranks with my index on every host that has that many ranks
    i = mine.index(me)
    rail = [h[i] for h in layout.hosts if len(h) > i]
    assert cross.size == len(rail) and cross.rank == rail.index(me)


def case_all_reduce():
    n, rank = commlib.get_world_size(), commlib.get_rank()
    for dtype, ops in [(torch.float32, ["SUM", "AVG", "MAX"]), (torch.float64, ["PRODUCT"]),
                       (torch.int32, ["SUM", "MIN", "BXOR"]), (torch.bfloat16, ["SUM"]),
                       (torch.float16, ["AVG"]), (torch.uint8, ["MAX"]), (torch.bool, ["SUM"])]:
        for op in ops:
            for count in counts(n):
                t = data(rank, count, dtype, op)
                want = reference([data(r, count, dtype, op) for r in range(n)], op, dtype)
                commlib.all_reduce(t, getattr(commlib.ReduceOp, op), algorithm="hierarchical")
                assert close(t, want), (dtype, op, count, t[:8], want[:8])


def case_async_and_shaped():
    n = commlib.get_world_size()
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6) + commlib.get_rank()
    work = commlib.all_reduce(t, async_op=True, algorithm="hierarchical")
    work.wait()
    want = (torch.arange(24, dtype=torch.float32) * n + n * (n - 1) / 2).reshape(4, 6)
    assert torch.equal(t, want)
    nc = torch.ones(8, 3)[:, 0]  # non-contiguous
    commlib.all_reduce(nc, algorithm="hierarchical")
    assert torch.equal(nc, torch.full((8,), float(n)))


if __name__ == "__main__":
    main(globals())
