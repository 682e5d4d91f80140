"""Block-absmax quantization, the one implementation behind int8, int4 and fp8.

The values are cut into blocks of ``block`` consecutive elements (the last one shorter); each
block is stored as one scale ``s = absmax / QMAX`` and one code per element, ``quantize(x / s)``.
A codec says only what differs: ``QMAX``, the code of zero, how a float32 ``y = x / s`` becomes
codes, how codes sit in the payload, and how much its code rounding may err.

Wire buffer (uint8, exactly ``nbytes(n)`` long)::

    bytes [0, nb*ss)        the nb scales, little-endian, in scale_dtype (ss = 4 or 2 bytes)
    bytes [nb*ss, nbytes)   the payload (per codec)

Per block, in float32 with round-to-nearest-even and no fused operations::

    a = max |x_i|;  s = a / QMAX;  s_st = scale_dtype(s);  s_q = float32(s_st)
    a non-finite x_i, or a non-finite s_st (float16 overflow)  ->  s_st = NaN, codes = ZERO
    s_q == 0 (a == 0, or a float16 scale that underflowed)     ->  codes = ZERO
    otherwise                                                  ->  code_i = quantize(x_i / s_q)
    decode: x̂_i = dequantize(code_i) * s_q, then rounded to the output dtype

A NaN scale makes the whole block decode to NaN: a non-finite input is never turned into a finite
wrong number. Blocks are handled as at most two 2-D pieces (the full blocks as an (nb-1, B) or
(nb, B) matrix, the shorter tail as a (1, t) one), never block by block.

Error bound (``bound``), deterministic rounding, per element of a finite block whose stored scale
is finite and non-zero, with u = 2^-24 (float32's unit roundoff), t = |x| / s_q, and the code
rounding |code - y| <= R_REL*|y| + R_ABS (int: R_REL = 0, R_ABS = 1/2; fp8: half an ulp)::

    E_round = s_q * (u*t + 2^-150 + R_REL*(t*(1+u) + 2^-150) + R_ABS)   x / s_q, then the code
    E_clamp = max(0, |x| - QMAX*s_q)        s_q may be below a/QMAX, so |x / s_q| may clamp
    E_q     = max(E_round, E_clamp)         the error of code*s_q in exact arithmetic
    E       = E_q + u*(|x| + E_q) + 2^-150  the float32 multiplication of the decode
    then, for a bfloat16/float16 source (decode rounds to it):
    E      += 2^-p*(|x| + E) + 2^(emin-p)   p = 8, emin = -126 (bfloat16); p = 11, emin = -14 (float16)

It is computed in float64, enlarged by 2^-40 relative and rounded up to float32. Where the decoded
value can overflow (|x| + E reaches the output dtype's overflow threshold, e.g. a float16 source
of absmax near 65504 whose float16 scale rounded up) the bound is inf. A zero scale decodes zeros:
the error is |x| exactly (a float16 scale underflows when a <= QMAX * 2^-25). A non-finite block:
NaN. Stochastic rounding (int8, int4) errs less than s_q (+ E_clamp) and is not what ``bound``
describes.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ..errors import CommConfigError, arg_error
from . import _fast
from .codec import Codec, _impl, check_block, check_choice, check_dtype, reinterpret

__all__ = ["BlockQuant"]

U = 2.0 ** -24  # float32 unit roundoff
TINY = 2.0 ** -150  # half the smallest float32 subnormal: the absolute error of a rounding there
# Rounding to an output dtype: (precision p, minimum normal exponent emin, overflow threshold).
_ROUND_TO = {
    torch.bfloat16: (8, -126, (2 - 2 ** -8) * 2.0 ** 127),
    torch.float16: (11, -14, 65520.0),
}
F32_OVERFLOW = (2 - 2 ** -24) * 2.0 ** 127  # float32 products at or above round to inf


def _parts(n: int, block: int) -> list[tuple[int, int, int, int]]:
    """The blocks of n elements as at most two matrices: (first element, first block, rows, columns)."""
    full, tail = divmod(n, block)
    parts = [(0, 0, full, block)] if full else []
    if tail:
        parts.append((full * block, full, 1, tail))
    return parts


def use_fast(t: torch.Tensor, stochastic: bool = False) -> bool:
    """Whether the C codecs (commlib.compress._fast) run this call: CPU, deterministic rounding,
    and ``COMMLIB_COMPRESS_IMPL`` not 'torch'."""
    impl = _impl()
    if impl == "c" and not _fast.available():
        raise CommConfigError("commlib: COMMLIB_COMPRESS_IMPL='c' but the C codecs "
                              "(commlib.compress._codecs) are not built. Fix: build them "
                              "(pip install -e .) or set COMMLIB_COMPRESS_IMPL=auto.")
    return impl != "torch" and not stochastic and t.device.type == "cpu" and _fast.available()


class BlockQuant(Codec):
    """A block-absmax quantizer (see the module docstring for the layout and the bound).

    Options: ``block`` (int >= 1, or None for one scale for the whole tensor), ``scale_dtype``
    (torch.float32 or torch.float16), ``stochastic`` (bool; unbiased stochastic rounding, where
    the codec has it).
    """

    OPTIONS: ClassVar[dict[str, Any]] = {"block": 256, "scale_dtype": torch.float32, "stochastic": False}
    STOCHASTIC: ClassVar[bool] = True  # whether the codec offers stochastic rounding
    QMAX: float  # the largest code magnitude: s = absmax / QMAX
    ZERO: ClassVar[int]  # the code (byte or nibble) of every element of a zero or NaN-scale block
    R_REL: float  # the code rounding: |code - y| <= R_REL*|y| + R_ABS, in units of the scale
    R_ABS: float

    # --- what a codec defines ----------------------------------------------------------------

    @property
    def kind(self) -> str:
        """The C fast path's name of this format."""
        return self.name

    def payload_nbytes(self, n: int) -> int:
        return n

    def _codes(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """The n-element tensor encode writes codes into (a view of the payload, or a temporary
        that ``_pack`` then packs)."""
        raise NotImplementedError

    def _quantize(self, y: torch.Tensor, codes: torch.Tensor) -> None:
        """codes = quantize(y), y = x / s_q (float32, may be overwritten)."""
        raise NotImplementedError

    def _pack(self, codes: torch.Tensor, payload: torch.Tensor, n: int) -> None:
        """Move the codes into the payload (nothing to do where ``_codes`` is the payload)."""

    def _unpack(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """The n codes as a tensor whose product with float32 scales is the float32 dequantized
        value times the scale (integer codes as int8, fp8 codes widened to float32)."""
        raise NotImplementedError

    # --- the shared machinery ----------------------------------------------------------------

    def _check(self, fn: str, options: dict[str, Any]) -> dict[str, Any]:
        options["block"] = check_block(fn, options["block"])
        check_choice(fn, "scale_dtype", options["scale_dtype"], (torch.float32, torch.float16))
        check_choice(fn, "stochastic", options["stochastic"], (False, True))
        if options["stochastic"] and not self.STOCHASTIC:
            raise arg_error(fn, "stochastic", True, f"codec {self.name!r} has no stochastic rounding",
                            "use stochastic=False, or an integer codec ('int8', 'int4')")
        return options

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.options["scale_dtype"]

    def _block(self, n: int) -> int:
        """The block size used for n elements (block=None: the whole tensor)."""
        block = self.options["block"]
        return max(n, 1) if block is None else block

    def _scale_bytes(self, n: int) -> int:
        return -(-n // self._block(n)) * self.scale_dtype.itemsize

    def nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        fn = self._fn("nbytes")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise arg_error(fn, "numel", numel, "must be an int >= 0", "pass tensor.numel()")
        check_dtype(fn, "dtype", dtype)
        return self._scale_bytes(numel) + self.payload_nbytes(numel)

    def _scales(self, xf: torch.Tensor, parts) -> torch.Tensor:
        """The stored scales s_st (scale_dtype, one per block) of the float32 values xf."""
        absmax = []
        for o, _, r, c in parts:
            lo, hi = torch.aminmax(xf[o:o + r * c].view(r, c), dim=1)  # NaN propagates
            absmax.append(torch.maximum(hi, lo.neg_()).abs_())  # abs_: a block of zeros has +0
        a = torch.cat(absmax)
        # a tensor divisor, not a Python number: CUDA divides by a scalar as a reciprocal product
        s_st = (a / torch.full_like(a, self.QMAX)).to(self.scale_dtype)
        bad = ~(torch.isfinite(a) & torch.isfinite(s_st))
        return s_st.masked_fill_(bad, math.nan)  # the canonical quiet NaN: 0x7fc00000 / 0x7e00

    def _encode(self, flat, out, generator):
        n = flat.numel()
        if n == 0:
            return
        stochastic = self.options["stochastic"]
        if use_fast(flat, stochastic):
            _fast.encode(self.kind, flat, out, self._block(n), self.scale_dtype)
            return
        xf = flat.float()
        parts = _parts(n, self._block(n))
        s_st = self._scales(xf, parts)
        head = self._scale_bytes(n)
        out[:head].copy_(s_st.view(torch.uint8))
        s_q = s_st.float()
        zero = (s_q == 0) | torch.isnan(s_q)
        u = torch.rand(n, generator=generator, dtype=torch.float32, device=xf.device) if stochastic else None
        codes = self._codes(out[head:], n)
        for o, b, r, c in parts:
            y = xf[o:o + r * c].view(r, c) / s_q[b:b + r, None]
            if u is not None:
                y.add_(u[o:o + r * c].view(r, c)).floor_()
            dst = codes[o:o + r * c].view(r, c)
            self._quantize(y, dst)
            dst.masked_fill_(zero[b:b + r, None], self.ZERO)
        self._pack(codes, out[head:], n)

    def _decode(self, packed, out, accumulate):
        n = out.numel()
        if n == 0:
            return
        data = packed.data
        if use_fast(out):
            _fast.decode(self.kind, data, out, self._block(n), self.scale_dtype, accumulate)
            return
        head = self._scale_bytes(n)
        s_q = reinterpret(data[:head], self.scale_dtype).float()
        codes = self._unpack(data[head:], n)
        for o, b, r, c in _parts(n, self._block(n)):
            q, s, dst = codes[o:o + r * c].view(r, c), s_q[b:b + r, None], out[o:o + r * c].view(r, c)
            if out.dtype == torch.float32 and not accumulate:
                torch.mul(q, s, out=dst)
                continue
            v = q * s  # float32
            if not accumulate:
                dst.copy_(v)
            elif out.dtype == torch.float32:
                dst.add_(v)
            else:
                dst.copy_(v.add_(dst))  # float32(out) + x̂, one rounding to out's dtype

    def _bound(self, flat):
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.float32, device=flat.device)
        xf = flat.float()
        block = self._block(n)
        s_st = self._scales(xf, _parts(n, block))
        s = torch.repeat_interleave(s_st.double(), block)[:n]
        ax = xf.double().abs()
        t = ax / s
        e_round = s * (U * t + TINY + self.R_REL * (t * (1 + U) + TINY) + self.R_ABS)
        e_q = torch.maximum(e_round, (ax - self.QMAX * s).clamp_(min=0))
        e = e_q + U * (ax + e_q) + TINY
        overflow = ax + e_q >= F32_OVERFLOW
        if flat.dtype in _ROUND_TO:
            p, emin, threshold = _ROUND_TO[flat.dtype]
            e = e + 2.0 ** -p * (ax + e) + 2.0 ** (emin - p)
            overflow |= ax + e >= threshold
        e = torch.where(overflow, math.inf, e)
        e = torch.where(s == 0, ax, e * (1 + 2.0 ** -40))
        return _round_up(e)


def _round_up(e64: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, rounding up (a bound must not shrink)."""
    e32 = e64.float()
    return torch.where(e32.double() < e64, torch.nextafter(e32, torch.full_like(e32, math.inf)), e32)

