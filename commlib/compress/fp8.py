"""fp8: block-absmax scaling to an 8-bit float, e4m3 (torch.float8_e4m3fn) or e5m2
(torch.float8_e5m2), as in FP8 training recipes; 4x smaller than float32, relative error.

``codec("fp8", format="e4m3", block=256, scale_dtype=torch.float32)`` (block=None: one scale
per tensor). QMAX = FMAX, the format's largest finite value (448 for e4m3, 57344 for e5m2);
code = the fp8 byte of clamp(x / s_q, -FMAX, FMAX) rounded to nearest even, subnormals
included; the zero code is 0x00. No stochastic rounding. Payload: n bytes; nbytes = nb*ss + n.

Error bound (the formula of :mod:`commlib.compress._blockquant` with the code rounding of half an
fp8 ulp: R_REL = 2^-4, R_ABS = 2^-10 for e4m3; R_REL = 2^-3, R_ABS = 2^-17 for e5m2):
|x - x̂| <~ (2^-4 + 2^-22)*|x| + 2^-10*s_q (e4m3), (2^-3 + 2^-22)*|x| + 2^-17*s_q (e5m2):
half an fp8 ulp relative in the normal range, half the subnormal spacing times s_q below it,
plus the float32 division and multiplication. The clamp excess of a float16 scale (<= 2^-11*a) stays below
the rounding term. Plus, for a bfloat16/float16 source, 2^-8*|x̂| + 2^-134 / 2^-11*|x̂| + 2^-25.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch

from ._blockquant import BlockQuant
from .codec import check_choice, register

__all__ = ["Fp8"]


class _Format(NamedTuple):
    dtype: torch.dtype
    fmax: float  # the largest finite value
    r_rel: float  # half an ulp, relative, in the normal range: 2^-(mantissa bits + 1)
    r_abs: float  # half the subnormal spacing


FORMATS = {
    "e4m3": _Format(torch.float8_e4m3fn, 448.0, 2.0 ** -4, 2.0 ** -10),
    "e5m2": _Format(torch.float8_e5m2, 57344.0, 2.0 ** -3, 2.0 ** -17),
}


class Fp8(BlockQuant):
    OPTIONS: ClassVar[dict[str, Any]] = {"format": "e4m3", **BlockQuant.OPTIONS}
    STOCHASTIC = False
    ZERO = 0

    def _check(self, fn, options):
        check_choice(fn, "format", options["format"], tuple(FORMATS))
        self._format = FORMATS[options["format"]]
        return super()._check(fn, options)

    @property
    def kind(self):
        return self.options["format"]

    @property
    def QMAX(self):  # a class constant in the other codecs
        return self._format.fmax

    @property
    def R_REL(self):
        return self._format.r_rel

    @property
    def R_ABS(self):
        return self._format.r_abs

    def _codes(self, payload, n):
        return payload

    def _quantize(self, y, codes):
        codes.view(self._format.dtype).copy_(y.clamp_(-self.QMAX, self.QMAX))

    def _unpack(self, payload, n):
        return payload.view(self._format.dtype).float()


register("fp8", Fp8)
