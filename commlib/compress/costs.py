"""What the compressed collectives' choice reads: the codecs' encode and decode rates, measured on
this machine and agreed per group, and the group's links, from its agreed cost model.

The rates are measured, so ranks would measure different numbers, and choices made from different
numbers would run different algorithms and never match their messages: rank 0's measurement is
the group's (the first compressed collective of a codec on a group broadcasts it, through
``commlib.overlap.costs.agree``, as the matmul rate is); :func:`known_rates` never communicates and uses
this rank's own measurement until the group has agreed.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ..overlap.costs import agree, agreed_so_far
from ..tuning import explain_call
from ..tuning.model import DEFAULT_LINKS, LinkCost
from .codec import Codec

__all__ = ["Rates", "measure", "agreed_rates", "known_rates", "links", "plain_seconds"]

MEASURE_NUMEL = 1 << 20  # float32 elements of the rate measurement (4 MiB: a few ms per codec)


class Rates(NamedTuple):
    """Seconds per element to encode a float32 tensor, and to decode one while adding it into a
    float32 accumulator (what the reduction does with every received chunk); where they come
    from."""
    encode_s: float
    decode_s: float
    source: str


_LOCAL: dict = {}  # codec key -> (encode s/elem, decode s/elem): this process's measurements


def _best(fn, repeat: int = 3) -> float:
    fn()  # warm-up: first-call allocation and dispatch
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(codec: Codec) -> tuple[float, float]:
    """This process's (encode, decode-and-accumulate) seconds per float32 element of ``codec``
    on the CPU, on :data:`MEASURE_NUMEL` elements, best of three; measured once per process."""
    hit = _LOCAL.get(codec.key)
    if hit is None:
        x = torch.randn(MEASURE_NUMEL, generator=torch.Generator().manual_seed(0))
        wire = torch.empty(codec.nbytes(MEASURE_NUMEL), dtype=torch.uint8)
        packed = codec.encode(x, out=wire)
        acc = torch.zeros(MEASURE_NUMEL)
        enc = _best(lambda: codec.encode(x, out=wire))
        dec = _best(lambda: codec.decode(packed, out=acc, accumulate=True))
        hit = _LOCAL[codec.key] = (enc / MEASURE_NUMEL, dec / MEASURE_NUMEL)
    return hit


def agreed_rates(group, codec: Codec) -> Rates:
    """The group's rates for ``codec``: collective the first time per (group, codec), rank 0
    measures and broadcasts; cached after."""
    (enc, dec), source = agree(group, ("codec", codec.key), lambda: measure(codec), 2)
    return Rates(enc, dec, source)


def known_rates(group, codec: Codec) -> Rates:
    """The agreed rates if the group has them, else this rank's measurement (never
    communicates)."""
    hit = agreed_so_far(group, ("codec", codec.key))
    if hit is not None:
        return Rates(*hit[0], hit[1])
    return Rates(*measure(codec), "this rank's measurement; the group agrees rank 0's at its "
                                  "first compressed collective of this codec")


def links(group) -> tuple[LinkCost, LinkCost, str]:
    """(the step between ranks of one host, the step of the group's slowest hop: between hosts
    where it spans them), from the group's agreed model; commlib's defaults without one."""
    model = group.model
    table = None if model is None else model.table_for("cpu")
    if table is None:
        return DEFAULT_LINKS["shm"], DEFAULT_LINKS["shm"], "no cost model: commlib's default step"
    intra = table.shm or table.link
    return intra, table.flat_link(group.size), model.source


def plain_seconds(collective: str, nbytes: int, group, dtype: torch.dtype) -> tuple[float, str]:
    """The uncompressed collective's predicted time on ``group``: the algorithm commlib's selection
    runs and the model's time for it (without a model: a ring of the default step)."""
    exp = explain_call(collective, nbytes, group, dtype, "cpu")
    for row in exp.rows:
        if row.algorithm == exp.chosen:
            return row.seconds, f"commlib.{collective} ({exp.chosen})"
    p = group.size
    return 2 * (p - 1) * DEFAULT_LINKS["shm"].step(nbytes / p), f"commlib.{collective} (ring)"
