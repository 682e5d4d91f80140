"""Pipelined recursive doubling: recursive doubling whose every exchange is cut into chunks.

All chunks of an exchange are posted at once; each is reduced as soon as it has arrived and this
rank's copy of it has left, while the later chunks are still on the wire. So only the last
chunk's reduction is not hidden behind the transfer, where plain recursive doubling reduces the
whole buffer after it. At 2 ranks (and between two hosts' leaders) this is the bandwidth optimum in
one phase: each rank sends its whole buffer once, the bytes of the ring's two halves, without the
ring's stop between them. Measured on 2 hosts x 1 rank at 1 Gb/s for DDP's last bucket (11.05
MiB, bench/all_reduce.py --compare): this algorithm 96.9-97.3 ms, gloo 97.0-97.8, recursive
doubling 100.6-102.0, the ring 101.4, MPI's own 99.8-104.0
(bench/results/all_reduce_11MiB_vcluster_2x1.txt). Beyond 2 ranks each rank sends log2(p) whole
buffers, and the cost model prefers the ring there for large messages.

Results are bitwise those of ``recursive_doubling``: the same operands meet in the same order,
chunk by chunk. Non-power-of-two sizes fold as recursive doubling does (``_fold``).
"""

from __future__ import annotations

from .costs import doubling_shape
from .recursive_doubling import all_reduce_steps
from .registry import register_algorithm

# An exchange is cut into chunks of at least CHUNK_BYTES, at most MAX_CHUNKS of them: a chunk's
# reduction (about 0.2 ms per MiB here) then hides behind the next one's transfer, and each extra
# message costs the link's latency once.
CHUNK_BYTES = 1 << 20
MAX_CHUNKS = 16


def chunk_count(nbytes: int) -> int:
    return max(1, min(MAX_CHUNKS, nbytes // CHUNK_BYTES))


def _all_reduce_cost(p, n, link):
    """Per doubling step: one latency per chunk, the whole buffer on the wire, the last chunk's
    reduction; plus the fold's two steps."""
    p2, k, f = doubling_shape(p)
    c = chunk_count(int(n))
    step = c * link.alpha + link.step(n) - link.alpha + n / c * link.gamma
    return k * step + f * (2 * link.step(n) + n * link.gamma)


@register_algorithm("pipelined_doubling", "all_reduce", cost=_all_reduce_cost,
                    shares_host_link=True)
def all_reduce(ctx, buf):
    yield from all_reduce_steps(ctx, buf, chunk_count(buf.numel() * buf.element_size()))
