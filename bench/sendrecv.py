"""sendrecv: every rank sends its buffer to rank+1 and receives from rank-1 (a ring shift).

busbw = algbw * 1. Out-of-place only: sending from and receiving into one buffer at once is not
a defined operation (nccl-tests reports N/A there too).
"""

from _harness import Collective, run


class SendRecv(Collective):
    name = "sendrecv"
    in_place = False
    compare_in_place = False

    def factor(self, n):
        return 1.0

    def alloc(self, b, count, in_place):
        return {"inp": b.empty(count), "out": b.empty(count)}

    def init(self, b, bufs, in_place):
        b.poison(bufs["out"])
        b.fill(bufs["inp"], b.rank)

    def expected(self, b, count):
        return b.pattern((b.rank - 1) % b.size, count)

    @staticmethod
    def peers(b):
        return (b.rank + 1) % b.size, (b.rank - 1) % b.size

    def commlib(self, b, bufs, in_place):
        import commlib

        inp, out = bufs["inp"], bufs["out"]
        dst, src = self.peers(b)
        isend, irecv = commlib.isend, commlib.irecv

        def step():
            s, r = isend(inp, dst), irecv(out, src)
            s.wait()
            r.wait()

        return step

    def mpi4py(self, b, bufs, in_place):
        inp, out = b.np(bufs["inp"]), b.np(bufs["out"])
        dst, src = self.peers(b)
        sendrecv = b.comm.Sendrecv
        return lambda: sendrecv(inp, dst, 0, out, src, 0)

    def gloo(self, b, bufs, in_place):
        if b.size == 1:
            return None  # gloo cannot send to itself
        inp, out = bufs["inp"], bufs["out"]
        dst, src = self.peers(b)
        isend, irecv = b.dist.isend, b.dist.irecv

        def step():
            s, r = isend(inp, dst), irecv(out, src)
            s.wait()
            r.wait()

        return step


if __name__ == "__main__":
    run(SendRecv())
