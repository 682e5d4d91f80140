"""broadcast: the root's buffer is copied to every rank.

busbw = algbw * 1. commlib's broadcast is in place (torch.distributed semantics), and so is
MPI_Bcast: every implementation's out-of-place column times the root's ``out.copy_(inp)`` then
the in-place call.
"""

from _harness import Collective, partial, run


class Broadcast(Collective):
    name = "broadcast"
    algo_name = "broadcast"
    has_root = True

    def factor(self, n):
        return 1.0

    def alloc(self, b, count, in_place):
        out = b.empty(count)
        return {"inp": out if in_place else b.empty(count), "out": out}

    def init(self, b, bufs, in_place):
        b.poison(bufs["out"])
        if b.rank == b.root:
            b.fill(bufs["inp"], b.root)

    def expected(self, b, count):
        return b.pattern(b.root, count)

    def _out_of_place(self, b, bufs, in_place, call):
        if in_place or b.rank != b.root:
            return call
        inp, out = bufs["inp"], bufs["out"]
        return lambda: (out.copy_(inp), call())

    def commlib(self, b, bufs, in_place):
        import commlib

        call = partial(commlib.broadcast, bufs["out"], b.root, **b.ckw)
        return self._out_of_place(b, bufs, in_place, call)

    def mpi4py(self, b, bufs, in_place):
        call = partial(b.comm.Bcast, b.np(bufs["out"]), b.root)
        return self._out_of_place(b, bufs, in_place, call)

    def gloo(self, b, bufs, in_place):
        call = partial(b.dist.broadcast, bufs["out"], b.root)
        return self._out_of_place(b, bufs, in_place, call)


if __name__ == "__main__":
    run(Broadcast())
