"""int4: block-absmax quantization to 4-bit codes, two per byte (8x smaller than float32).

``codec("int4", block=64, scale_dtype=torch.float32, stochastic=False)``. QMAX = 7;
q = clamp(round_half_even(x / s_q), -7, 7) (stochastic: floor(x / s_q + u)), stored as the
nibble q + 8 in 1..15; the zero code is nibble 8. Element 2i sits in the low nibble of payload
byte i, element 2i+1 in the high one; an odd n leaves the last high nibble 8. Payload:
ceil(n/2) bytes; nbytes = nb*ss + ceil(n/2).

Error bound (the formula of :mod:`commlib.compress._blockquant`, R_REL = 0, R_ABS = 1/2):
float32 scales: |x - x̂| <= s_q/2 + 2^-23*|x| + 2^-25*s_q + 2^-149 <~ (1/2 + 2^-20)*s_q;
float16 normal scales: the clamp excess 7*2^-11*s_q is below s_q/2, so the same; plus, for a
bfloat16/float16 source, 2^-8*|x̂| + 2^-134 / 2^-11*|x̂| + 2^-25.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ._blockquant import BlockQuant
from .codec import register

__all__ = ["Int4"]


class Int4(BlockQuant):
    OPTIONS: ClassVar[dict[str, Any]] = {**BlockQuant.OPTIONS, "block": 64}
    QMAX = 7.0
    ZERO = 8
    R_REL, R_ABS = 0.0, 0.5

    def payload_nbytes(self, n):
        return (n + 1) // 2

    def _codes(self, payload, n):
        codes = torch.empty(2 * payload.numel(), dtype=torch.uint8, device=payload.device)
        codes[n:].fill_(self.ZERO)  # the odd element's partner
        return codes

    def _quantize(self, y, codes):
        codes.copy_(y.round_().clamp_(-self.QMAX, self.QMAX).add_(8))

    def _pack(self, codes, payload, n):
        pairs = codes.view(-1, 2)
        torch.bitwise_or(pairs[:, 0], pairs[:, 1].bitwise_left_shift_(4), out=payload)

    def _unpack(self, payload, n):
        pairs = torch.empty((payload.numel(), 2), dtype=torch.uint8, device=payload.device)
        torch.bitwise_and(payload, 15, out=pairs[:, 0])
        torch.bitwise_right_shift(payload, 4, out=pairs[:, 1])
        return pairs.view(-1)[:n].view(torch.int8).sub_(8)


register("int4", Int4)
