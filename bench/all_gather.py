"""all_gather (``all_gather_into_tensor``): every rank ends with all ranks' buffers, in rank order.

Sizes are the gathered total (S = n x per-rank bytes); the count column is per rank, as in
nccl-tests. busbw = algbw * (n-1)/n. In place: the input is this rank's block of the output.
"""

from _harness import MPI, Collective, block, partial, run


class AllGather(Collective):
    name = "all_gather"
    algo_name = "all_gather"
    per_rank = True
    compare_in_place = False

    def factor(self, n):
        return (n - 1) / n

    def alloc(self, b, count, in_place):
        out = b.empty(count * b.size)
        return {"inp": block(out, b.rank, b.size) if in_place else b.empty(count), "out": out}

    def init(self, b, bufs, in_place):
        b.poison(bufs["out"])
        b.fill(bufs["inp"], b.rank)

    def expected(self, b, count):
        import torch

        return torch.cat([b.pattern(r, count) for r in range(b.size)])

    def commlib(self, b, bufs, in_place):
        import commlib

        return partial(commlib.all_gather_into_tensor, bufs["out"], bufs["inp"], **b.ckw)

    def mpi4py(self, b, bufs, in_place):
        out = b.np(bufs["out"])
        return partial(b.comm.Allgather, MPI.IN_PLACE if in_place else b.np(bufs["inp"]), out)

    def gloo(self, b, bufs, in_place):
        fn = getattr(b.dist, "all_gather_single", None) or b.dist.all_gather_into_tensor
        return partial(fn, bufs["out"], bufs["inp"])


if __name__ == "__main__":
    run(AllGather())
