"""reduce: the root ends with the reduction of all ranks' buffers (others' are not checked).

busbw = algbw * 1. commlib's reduce is in place (torch.distributed semantics): its out-of-place
column times ``out.copy_(inp)`` then the in-place call on every rank; raw MPI has a true
out-of-place Reduce.
"""

from _harness import MPI, Collective, partial, run


class Reduce(Collective):
    name = "reduce"
    algo_name = "reduce"
    reduces = True
    has_root = True

    def factor(self, n):
        return 1.0

    def alloc(self, b, count, in_place):
        out = b.empty(count)
        return {"inp": out if in_place else b.empty(count), "out": out}

    def init(self, b, bufs, in_place):
        if not in_place:
            b.poison(bufs["out"])
        b.fill(bufs["inp"], b.rank)

    def expected(self, b, count):
        return b.reduced(count) if b.rank == b.root else None

    def commlib(self, b, bufs, in_place):
        import commlib

        inp, out = bufs["inp"], bufs["out"]
        call = partial(commlib.reduce, out, b.root, b.op, **b.ckw)
        if in_place:
            return call
        return lambda: (out.copy_(inp), call())

    def mpi4py(self, b, bufs, in_place):
        inp, out = b.np(bufs["inp"]), b.np(bufs["out"])
        if in_place:
            send = MPI.IN_PLACE if b.rank == b.root else out
        else:
            send = inp
        return partial(b.comm.Reduce, send, out, b.mpi_op, b.root)

    def gloo(self, b, bufs, in_place):
        inp, out = bufs["inp"], bufs["out"]
        call = partial(b.dist.reduce, out, b.root, b.dist_op)
        if in_place:
            return call
        return lambda: (out.copy_(inp), call())


if __name__ == "__main__":
    run(Reduce())
