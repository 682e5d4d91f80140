"""Error feedback (1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019): what a lossy
codec dropped from this step's gradient is added to the next step's, so that nothing is lost for
good. After T steps the decoded values sum to the inputs' sum minus the last residual alone,
which one step's error bound bounds; without feedback the errors of all T steps add up.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from ..errors import arg_error
from .codec import Codec, Packed, as_codec, check_values

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The residuals of lossy encodings, one float32 tensor per key (e.g. per parameter or
    bucket), kept on the tensor's device.

    ``encode(codec, x, key=k)``: y = float32(x) + e[k] (e = 0 the first time); encodes y; keeps
    e[k] = y - decode(y's encoding) in float32. The returned Packed has x's shape and dtype, so
    ``decode`` gives x's dtype. Codecs whose wire holds the source dtype (topk) encode y rounded to
    x's dtype (the rounding then goes into the residual too); the others encode y in float32.

    >>> ef = ErrorFeedback()
    >>> p = ef.encode("int8", grad, key="layer1.weight")   # send p.data; the receiver decodes
    """

    def __init__(self):
        self._residual: dict[Hashable, torch.Tensor] = {}

    def encode(self, codec: str | Codec, x: torch.Tensor, *, key: Hashable = 0,
               out: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Packed:
        fn = "compress.ErrorFeedback.encode"
        codec = as_codec(codec)
        check_values(fn, "x", x)
        e = self._residual.get(key)
        if e is not None and e.numel() != x.numel():
            raise arg_error(fn, "key", key, f"holds the residual of {e.numel()} elements, and x has "
                            f"{x.numel()}", f"call reset({key!r}) first, or use another key per tensor")
        y = x.float() if e is None else x.float() + e.view(x.shape)
        p = codec.encode(y.to(x.dtype) if codec.dtype_in_wire else y, out=out, generator=generator)
        e = torch.empty(x.shape, dtype=torch.float32, device=x.device) if e is None else e.view(x.shape)
        codec.decode(p, out=e)
        torch.sub(y, e, out=e)
        self._residual[key] = e
        return Packed(p.data, x.shape, x.dtype, codec)

    def residual(self, key: Hashable = 0) -> torch.Tensor | None:
        """The float32 residual kept for ``key`` (x's shape at its last encode), or None."""
        return self._residual.get(key)

    def reset(self, key: Any = None) -> None:
        """Forget the residual of ``key``, or every residual (``key=None``)."""
        if key is None:
            self._residual.clear()
        else:
            self._residual.pop(key, None)
