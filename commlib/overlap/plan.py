"""The collective matmul planner: how many pieces each ring message is cut into. Pure: shapes,
dtype, group size, the link's cost and the matmul rate in, a frozen :class:`OverlapPlan` out (no
group, no clock, no communication), cached.

Both collective matmuls run a ring of ``p - 1`` hops per block (a shard of ``a`` travelling for
:func:`~commlib.overlap.all_gather_matmul`, an accumulator of the product for
:func:`~commlib.overlap.matmul_reduce_scatter`) while every rank multiplies the block it holds.
Cutting each block into ``c`` pieces of rows lets a piece travel (and be forwarded) as soon as it
is ready, so at the end only the last piece's matmul is exposed instead of the whole block's; each
piece pays the link's per-message cost and a matmul call's fixed cost. With ``t(c)`` one piece's
hop (the link's step for its bytes, :meth:`commlib.tuning.model.LinkCost.step`) and ``u(c)`` one
piece's matmul (``call_s + flops / rate``; plus the add of the accumulator, ``γ`` per byte, for
the reduce-scatter)::

    T(c) = max(u(c) + (p-1)·c·t(c),    # communication-bound: every hop of every piece on the
                                       # link in turn, then the last piece's matmul
               p·c·u(c))               # compute-bound: every piece's matmul back to back

With ``c = 1`` that is the step model of a ring that overlaps one block's transfer with one
block's matmul: ``(p-1)·max(U, T) + U``. Where transfers are copies by the same cores that
compute (CPU tensors, ranks on one host: ``serial``), nothing overlaps and the two add up:
``T(c) = p·c·u + (p-1)·c·t``, printed for ``explain``, and the plan never decomposes unless
forced (pieces only add there). Candidate ``c = 0`` is no decomposition at all: commlib's own
collective (whatever its selection runs: shared memory on one host, hierarchical across hosts),
then one matmul, ``T(0) = collective + U`` from the same cost model. The candidates are ``c = 0,
1, 2, 4, ...`` up to :data:`MAX_CHUNKS` and the rows of a block; the plan takes the fewest pieces
whose ``T(c)`` is within :data:`MIN_GAIN` of the smallest (a prediction's error is larger than a
few percent, and every piece is a message more), so it decomposes only where overlap is
predicted to gain more than that.

Every rank must run the same plan (a ring whose ranks cut blocks differently never matches its
messages), so the inputs are ones every rank shares: the shapes (the same on every rank), the
group's agreed cost model and the matmul rate agreed at the group's first collective matmul
(:mod:`commlib.overlap.costs`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..ops import accumulation_dtype, dtype_name
from ..tuning.model import LinkCost

__all__ = ["KINDS", "MAX_CHUNKS", "MIN_GAIN", "MatmulRate", "Candidate", "OverlapPlan",
           "plan", "piece_bounds"]

KINDS = ("all_gather_matmul", "matmul_reduce_scatter")

#: The most pieces a block is cut into (and the tags a call uses per direction).
MAX_CHUNKS = 64

#: The plan takes the fewest pieces predicted within this share of the fastest candidate.
MIN_GAIN = 0.05


class MatmulRate(NamedTuple):
    """How fast this group multiplies matrices of one dtype on one device type: ``flops_per_s``
    on large operands and ``call_s``, the fixed cost of one call (with the executor's work around
    it); ``source`` says where the numbers come from."""

    flops_per_s: float
    call_s: float
    source: str

    def seconds(self, flops: float) -> float:
        return self.call_s + flops / self.flops_per_s


class Candidate(NamedTuple):
    """One chunk count's prediction: a piece's bytes, its hop ``t``, its matmul ``u``, the two
    bounds of ``T(c)`` (``comm_s = u + (p-1)·c·t``, ``compute_s = p·c·u``) and ``total_s``.
    Chunks 0 (no decomposition): the whole message, the collective's time as ``hop_s`` and
    ``comm_s``, the one matmul as ``matmul_s`` and ``compute_s``, their sum as ``total_s``."""

    chunks: int
    piece_bytes: int
    hop_s: float
    matmul_s: float
    comm_s: float
    compute_s: float
    total_s: float


@dataclass(frozen=True)
class OverlapPlan:
    """What one collective matmul call does, the same on every rank of its group.

    ``a_shape``: the shard for ``all_gather_matmul``, the whole ``a`` for
    ``matmul_reduce_scatter``; ``dim``: the gather or scatter dim (non-negative); ``rows``: the
    rows of one block (a shard, or one rank's block of the product) once its dims but the last are
    flattened; ``pieces``: the ``[start, stop)`` row ranges of the ``chunks`` pieces;
    ``message_bytes``: the bytes of one block on the wire; ``sends`` (= receives): the
    point-to-point messages each rank posts in one call."""

    kind: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    dtype: torch.dtype
    size: int
    dim: int
    rows: int
    chunks: int
    pieces: tuple[tuple[int, int], ...]
    message_bytes: int
    sends: int
    candidates: tuple[Candidate, ...]
    why: str
    link: str
    rate: str
    plain: str = ""
    serial: bool = False

    @property
    def recvs(self) -> int:
        return self.sends

    def __str__(self) -> str:
        us = 1e6
        a_name = "a_shard" if self.kind == "all_gather_matmul" else "a"
        dim_name = "gather_dim" if self.kind == "all_gather_matmul" else "scatter_dim"
        block = "shard of a" if self.kind == "all_gather_matmul" else "accumulator"
        lines = [
            f"{self.kind}: {a_name} {self.a_shape} @ b {self.b_shape}, "
            f"{dtype_name(self.dtype)}, {self.size} rank{'s' * (self.size != 1)}, "
            f"{dim_name}={self.dim}",
            f"  one {block}: {self.rows} rows, {self.message_bytes} B; each rank sends "
            f"{self.sends} and receives {self.recvs} messages",
            f"  link: {self.link}",
            f"  matmul: {self.rate}",
            f"  plain (chunks 0): {self.plain}",
            ("  T(c) = p*c*u + (p-1)*c*t (transfers and matmuls take turns on the same cores)"
             if self.serial else "  T(c) = max(u + (p-1)*c*t, p*c*u)")
            + "; t: one piece's hop, u: one piece's matmul; T(0) = collective + matmul",
            f"  {'chunks':>6} {'piece B':>10} {'t (hop)':>11} {'u (matmul)':>11} "
            f"{'u+(p-1)ct':>11} {'p*c*u':>11} {'T(c)':>11}",
        ]
        for c in self.candidates:
            mark = "  <- chosen" if c.chunks == self.chunks else ""
            lines.append(f"  {c.chunks if c.chunks else '0 plain':>6} {c.piece_bytes:>10} {c.hop_s * us:>8.1f} us "
                         f"{c.matmul_s * us:>8.1f} us {c.comm_s * us:>8.1f} us "
                         f"{c.compute_s * us:>8.1f} us {c.total_s * us:>8.1f} us{mark}")
        chosen = (f"{self.chunks} chunk{'s' * (self.chunks != 1)}" if self.chunks
                  else "no decomposition (the plain collective, then the matmul)")
        lines.append(f"  chosen: {chosen}: {self.why}")
        return "\n".join(lines)


def piece_bounds(rows: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """``chunks`` near-equal ``[start, stop)`` ranges covering ``range(rows)``, in order."""
    return tuple((rows * i // chunks, rows * (i + 1) // chunks) for i in range(chunks))


def _predict(c: int, p: int, rows: int, width: int, itemsize: int, flops_per_row: int,
             link: LinkCost, rate: MatmulRate, add_per_byte: float, serial: bool,
             plain_s: float) -> Candidate:
    if c == 0:  # the plain collective, then one matmul of every block
        message = rows * width * itemsize
        u = rate.seconds(p * rows * flops_per_row) + add_per_byte * p * message
        return Candidate(0, message, plain_s, u, plain_s, u, plain_s + u)
    r = -(-rows // c)  # the largest piece
    piece = r * width * itemsize
    t = link.step(piece)
    u = rate.seconds(r * flops_per_row) + add_per_byte * piece
    comm, compute = u + (p - 1) * c * t, p * c * u
    total = compute + (p - 1) * c * t if serial else max(comm, compute)
    return Candidate(c, piece, t, u, comm, compute, total)


def _candidates(rows: int, forced: int | None) -> list[int]:
    out, c = [0], 1
    while c <= min(MAX_CHUNKS, max(rows, 1)):
        out.append(c)
        c *= 2
    if forced is not None and forced not in out:
        out = sorted([*out, forced])
    return out


@functools.lru_cache(maxsize=1024)
def plan(kind: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: torch.dtype,
         size: int, link: LinkCost, rate: MatmulRate, dim: int = 0, chunks: int | None = None,
         link_source: str = "", plain_s: float | None = None, plain_source: str = "",
         serial: bool = False) -> OverlapPlan:
    """The plan of ``kind`` (one of :data:`KINDS`) for these checked shapes (``a_shape`` the
    shard for all_gather_matmul, the whole ``a`` for matmul_reduce_scatter; ``b_shape`` 2-D;
    ``dim`` non-negative, not the last) on ``size`` ranks: ``chunks`` forced (0: no
    decomposition), or chosen by ``T(c)`` (module docstring). ``plain_s``: the plain collective's
    predicted time (default: a ring of ``link``); ``serial``: transfers and matmuls share the
    cores. Pure and cached."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective matmul {kind!r}; one of {KINDS}")
    k, n = b_shape
    lead = math.prod(a_shape[:-1])
    if kind == "all_gather_matmul":
        rows, width, itemsize, add = lead, k, dtype.itemsize, 0.0
    else:  # one rank's block of the product, accumulated (and sent) in the accumulation dtype
        rows, width = lead // size, n
        itemsize, add = accumulation_dtype(dtype).itemsize, link.gamma
    message = rows * width * itemsize
    flops_per_row = 2 * k * n
    link_text = (f"alpha {link.alpha * 1e6:.1f} us, beta {link.beta * 1e9:.3f} ns/B"
                 f"{' (measured curve)' if link.curve is not None else ''}"
                 f"{f' ({link_source})' if link_source else ''}")
    rate_text = (f"{rate.flops_per_s / 1e9:.2f} GFLOP/s + {rate.call_s * 1e6:.1f} us a call "
                 f"({rate.source})")
    if plain_s is None:
        plain_s = (size - 1) * link.step(message) + (size - 1) * message * add
        plain_source = plain_source or "a ring of the link"
    cands = tuple(_predict(c, size, rows, width, itemsize, flops_per_row, link, rate, add,
                           serial, plain_s)
                  for c in _candidates(rows, chunks))
    by_chunks = {c.chunks: c for c in cands}
    if size == 1 or message == 0:
        # nothing travels: the matmul in one piece (or, forced, in the pieces asked for)
        best = by_chunks[1 if chunks is None else chunks]
        why = ("one rank: nothing travels" if size == 1 else "empty blocks: nothing travels")
        if chunks is not None:
            why = f"forced (chunks={chunks}); {why}"
        sends = 0
    else:
        if chunks is not None:
            best = by_chunks[chunks]
            why = f"forced (chunks={chunks})"
        elif serial:
            # pieces cannot hide transfers made by the computing cores; a decomposition would win
            # only where the model prices the ring's hops below the collective the selector chose,
            # two estimates from different sources (once 8% apart, uncalibrated), not overlap
            best = by_chunks[0]
            why = "overlap cannot hide the transfers here (they use the cores that compute)"
        else:
            fastest = min(cands, key=lambda x: x.total_s)
            best = next(x for x in cands if x.total_s <= fastest.total_s * (1 + MIN_GAIN))
            one = by_chunks[1]
            if best is fastest:
                why = "the fastest predicted"
            else:
                why = (f"the fewest within {MIN_GAIN:.0%} of the fastest ({fastest.chunks} "
                       f"chunks, {fastest.total_s * 1e6:.1f} us)")
            if best.chunks and best is not one:
                why += (f"; {(1 - best.total_s / one.total_s):.0%} below 1 chunk "
                        f"({one.total_s * 1e6:.1f} us)")
            if not best.chunks:
                why += "; overlap is not predicted to gain more"
        if best.chunks:
            bound = "communication" if best.comm_s >= best.compute_s else "compute"
            why += f"; {bound}-bound"
        sends = (size - 1) * best.chunks
    plain_text = f"{plain_s * 1e6:.1f} us ({plain_source})"
    return OverlapPlan(kind, tuple(a_shape), tuple(b_shape), dtype, size, dim, rows, best.chunks,
                       piece_bounds(rows, best.chunks) if best.chunks else (), message, sends,
                       cands, why, link_text, rate_text, plain_text, serial)
