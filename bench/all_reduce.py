"""all_reduce: every rank ends with the reduction of all ranks' buffers.

busbw = algbw * 2(n-1)/n (each rank sends and receives (n-1)/n of the data twice: reduce-scatter,
then all-gather). commlib's all_reduce is in place (torch.distributed semantics): the out-of-place
column times ``out.copy_(inp)`` then the in-place call; raw MPI has a true out-of-place Allreduce.
"""

from _harness import MPI, Collective, partial, run


class AllReduce(Collective):
    name = "all_reduce"
    algo_name = "all_reduce"
    reduces = True

    def factor(self, n):
        return 2 * (n - 1) / n

    def alloc(self, b, count, in_place):
        out = b.empty(count)
        return {"inp": out if in_place else b.empty(count), "out": out}

    def init(self, b, bufs, in_place):
        if not in_place:
            b.poison(bufs["out"])
        b.fill(bufs["inp"], b.rank)

    def expected(self, b, count):
        return b.reduced(count)

    def commlib(self, b, bufs, in_place):
        import commlib

        inp, out = bufs["inp"], bufs["out"]
        call = partial(commlib.all_reduce, out, b.op, **b.ckw)
        if in_place:
            return call
        return lambda: (out.copy_(inp), call())

    def mpi4py(self, b, bufs, in_place):
        inp, out = b.np(bufs["inp"]), b.np(bufs["out"])
        return partial(b.comm.Allreduce, MPI.IN_PLACE if in_place else inp, out, b.mpi_op)

    def gloo(self, b, bufs, in_place):
        inp, out = bufs["inp"], bufs["out"]
        call = partial(b.dist.all_reduce, out, b.dist_op)
        if in_place:
            return call
        return lambda: (out.copy_(inp), call())


if __name__ == "__main__":
    run(AllReduce())
