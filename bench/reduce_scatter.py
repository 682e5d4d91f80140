"""reduce_scatter (``reduce_scatter_tensor``): rank i ends with block i of the reduction.

Sizes are the input total (S = n x per-rank output bytes); the count column is per rank, as in
nccl-tests. busbw = algbw * (n-1)/n. In place: the output is this rank's block of the input for
commlib and gloo; raw MPI's in-place form (MPI_IN_PLACE) leaves the result in block 0 instead.
"""

from _harness import MPI, Collective, block, partial, run


class ReduceScatter(Collective):
    name = "reduce_scatter"
    algo_name = "reduce_scatter"
    reduces = True
    per_rank = True
    compare_in_place = False

    def factor(self, n):
        return (n - 1) / n

    def alloc(self, b, count, in_place):
        inp = b.empty(count * b.size)
        return {"inp": inp, "out": block(inp, b.rank, b.size) if in_place else b.empty(count)}

    def init(self, b, bufs, in_place):
        if not in_place:
            b.poison(bufs["out"])
        b.fill(bufs["inp"], b.rank)

    def expected(self, b, count):
        return b.reduced(count, start=b.rank * count)

    def result(self, b, bufs, in_place, impl):
        if in_place and impl == "mpi4py":
            return block(bufs["inp"], 0, b.size)
        return bufs["out"]

    def commlib(self, b, bufs, in_place):
        import commlib

        return partial(commlib.reduce_scatter_tensor, bufs["out"], bufs["inp"], b.op, **b.ckw)

    def mpi4py(self, b, bufs, in_place):
        inp = b.np(bufs["inp"])
        if in_place:
            return partial(b.comm.Reduce_scatter_block, MPI.IN_PLACE, inp, b.mpi_op)
        return partial(b.comm.Reduce_scatter_block, inp, b.np(bufs["out"]), b.mpi_op)

    def gloo(self, b, bufs, in_place):
        fn = getattr(b.dist, "reduce_scatter_single", None) or b.dist.reduce_scatter_tensor
        return partial(fn, bufs["out"], bufs["inp"], b.dist_op)


if __name__ == "__main__":
    run(ReduceScatter())
