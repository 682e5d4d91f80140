"""alltoall (``all_to_all_single``, equal splits): rank i sends block j of its input to rank j,
which stores it as block i of its output.

Sizes are the per-rank total (S = n x block bytes); the count column is per block, as in
nccl-tests. busbw = algbw * (n-1)/n. In place: input and output are one buffer (commlib copies
the input first; MPI uses MPI_IN_PLACE; gloo has no in-place form: n/a).
"""

from _harness import MPI, Collective, partial, run


class AllToAll(Collective):
    name = "alltoall"
    algo_name = "all_to_all"
    per_rank = True
    compare_in_place = False

    def factor(self, n):
        return (n - 1) / n

    def alloc(self, b, count, in_place):
        out = b.empty(count * b.size)
        return {"inp": out if in_place else b.empty(count * b.size), "out": out}

    def init(self, b, bufs, in_place):
        if not in_place:
            b.poison(bufs["out"])
        b.fill(bufs["inp"], b.rank)

    def expected(self, b, count):
        import torch

        return torch.cat([b.pattern(q, count, start=b.rank * count) for q in range(b.size)])

    def commlib(self, b, bufs, in_place):
        import commlib

        return partial(commlib.all_to_all_single, bufs["out"], bufs["inp"], **b.ckw)

    def mpi4py(self, b, bufs, in_place):
        out = b.np(bufs["out"])
        return partial(b.comm.Alltoall, MPI.IN_PLACE if in_place else b.np(bufs["inp"]), out)

    def gloo(self, b, bufs, in_place):
        if in_place:
            return None
        return partial(b.dist.all_to_all_single, bufs["out"], bufs["inp"])


if __name__ == "__main__":
    run(AllToAll())
