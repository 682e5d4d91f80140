"""Compressed communication: codecs that turn a float tensor into fewer wire bytes and back
(int8, int4 and fp8 block quantization, top-k sparsification), and error feedback for
gradients. Every codec's byte layout is fixed (the torch code is its definition; a C path
matches it byte for byte), and ``nbytes`` gives the wire size before encoding::

    import commlib.compress as cc

    c = cc.codec("int8", block=256)      # or "int4", "fp8" (format="e5m2"), "topk" (ratio=0.01)
    p = c.encode(grad)                   # p.data: c.nbytes(grad.numel()) uint8 bytes
    approx = c.decode(p)                 # grad's shape and dtype; |grad - approx| <= c.bound(grad)
"""

from . import fp8, int4, int8, topk  # noqa: F401  (each module registers its codec)
from .codec import Codec, Packed, as_codec, codec, names, register
from .collectives import (
    all_gather_into_tensor,
    all_reduce,
    explain,
    recv,
    reduce_scatter_tensor,
    send,
    wire_bytes,
)
from .feedback import ErrorFeedback
from .autograd import (all_gather_fn, all_reduce_fn, copy_fn, recv_activation, reduce_fn,
                       reduce_scatter_fn, send_activation)
from .ddp import ddp_hook

__all__ = ["codec", "as_codec", "register", "names", "Codec", "Packed", "ErrorFeedback",
           "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "send", "recv",
           "explain", "wire_bytes",
           "all_reduce_fn", "reduce_fn", "copy_fn", "reduce_scatter_fn", "all_gather_fn",
           "send_activation", "recv_activation", "ddp_hook"]
