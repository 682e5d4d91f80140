"""topk: keep the k largest-magnitude values and their indices (Deep Gradient Compression
style sparsification), everything else decodes as zero. Pair it with ErrorFeedback: what it drops
is carried into the next step instead of being lost.

``codec("topk", ratio=0.01)``: k(n) = 0 for n = 0, else min(n, max(1, ceil(ratio*n))) (math.ceil
of the Python float product, so ratio=0.07 keeps 8 of 100: 0.07*100 = 7.000000000000001).
Wire buffer: bytes [0, 4k) the indices (int32, little-endian, ascending), bytes [4k, 4k +
k*itemsize) the values x[idx] in the source dtype; nbytes(n, dtype) = k*(4 + itemsize(dtype)).
Selection: the k largest |x| (NaN above every number, +-inf above every finite value; ties broken
arbitrarily). Indices are int32, so a tensor holds fewer than 2^31 elements. Torch only (no C path).

Error bound: a kept value decodes exactly, a dropped one as 0, and only values |x_i| <= the k-th
largest |x| can be dropped: bound_i = |x_i| where |x_i| <= kth, else 0; NaN where x_i is not
finite (a kept inf decodes to inf, whose difference from itself is NaN).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ..errors import arg_error
from .codec import Codec, check_dtype, reinterpret, register

__all__ = ["TopK"]


class TopK(Codec):
    OPTIONS: ClassVar[dict[str, Any]] = {"ratio": 0.01}
    dtype_in_wire = True
    MAX_NUMEL = 2 ** 31 - 1

    def _check(self, fn, options):
        ratio = options["ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise arg_error(fn, "ratio", ratio, "must be a number in (0, 1]: the fraction of values kept",
                            "pass e.g. ratio=0.01")
        return {"ratio": float(ratio)}

    def k(self, n: int) -> int:
        """How many of n values are kept."""
        return 0 if n == 0 else min(n, max(1, math.ceil(self.options["ratio"] * n)))

    def nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        fn = self._fn("nbytes")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise arg_error(fn, "numel", numel, "must be an int >= 0", "pass tensor.numel()")
        self._check_numel(fn, "numel", numel)
        check_dtype(fn, "dtype", dtype)
        return self.k(numel) * (4 + dtype.itemsize)

    def _encode(self, flat, out, generator):
        k = self.k(flat.numel())
        if k == 0:
            return
        idx = torch.topk(flat.float().abs(), k, sorted=False).indices.sort().values
        out[:4 * k].copy_(idx.to(torch.int32).view(torch.uint8))
        out[4 * k:].copy_(flat[idx].view(torch.uint8))

    def _decode(self, packed, out, accumulate):
        k = self.k(out.numel())
        if not accumulate:
            out.zero_()
        if k == 0:
            return
        idx = reinterpret(packed.data[:4 * k], torch.int32).long()
        values = reinterpret(packed.data[4 * k:], packed.dtype)
        if accumulate:  # float32(out) + value, one rounding to out's dtype
            values = out.index_select(0, idx).float().add_(values.float())
        out.index_copy_(0, idx, values.to(out.dtype))

    def _bound(self, flat):
        ax = flat.float().abs()
        k = self.k(flat.numel())
        if k == 0:
            return ax
        kth = torch.topk(ax, k).values[-1]
        b = torch.where(ax > kth, 0.0, ax)
        return b.masked_fill_(~torch.isfinite(flat), math.nan)


register("topk", TopK)
