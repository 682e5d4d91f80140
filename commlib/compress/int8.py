"""int8: block-absmax quantization to signed bytes (QLoRA-style blockwise int8, 4x smaller than
float32).

``codec("int8", block=256, scale_dtype=torch.float32, stochastic=False)``. QMAX = 127;
code = clamp(round_half_even(x / s_q), -127, 127) as a two's complement byte (stochastic:
floor(x / s_q + u), u uniform in [0, 1)); the zero code is 0. Payload: n bytes, element i in
byte i. nbytes = nb*ss + n (nb = ceil(n / block) scales of ss = 4 or 2 bytes).

Error bound (the general formula in :mod:`commlib.compress._blockquant` with R_REL = 0,
R_ABS = 1/2), per element of a block with scale s_q:
float32 scales: |x - x̂| <= s_q/2 + 2^-23*|x| + 2^-25*s_q + 2^-149 <~ (1/2 + 2^-16)*s_q
(|x| <= 127*s_q; the clamp excess, a - 127*s_q <= 2^-24*a, stays below the rounding term);
float16 scales (normal, s >= 2^-14): a - 127*s_q <= 127*2^-11*s_q ~ 0.062*s_q is still below it,
so the same; float16 subnormal scales may clamp by more (the formula's E_clamp).
Plus, for a bfloat16/float16 source, 2^-8*|x̂| + 2^-134 / 2^-11*|x̂| + 2^-25.
"""

from __future__ import annotations

import torch

from ._blockquant import BlockQuant
from .codec import register

__all__ = ["Int8"]


class Int8(BlockQuant):
    QMAX = 127.0
    ZERO = 0
    R_REL, R_ABS = 0.0, 0.5

    def _codes(self, payload, n):
        return payload.view(torch.int8)

    def _quantize(self, y, codes):
        codes.copy_(y.round_().clamp_(-self.QMAX, self.QMAX))

    def _unpack(self, payload, n):
        return payload.view(torch.int8)


register("int8", Int8)
