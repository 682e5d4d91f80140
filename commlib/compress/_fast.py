"""The C fast path of the block-quantizer codecs (int8, int4, fp8 e4m3/e5m2): fused quantize +
pack and unpack + dequantize (+ accumulate), writing exactly the bytes of the torch definition
(commlib/compress/_blockquant.py; tests/test_compress_c.py checks them bit for bit).

The extension ``commlib.compress._codecs`` (csrc/compress/, built by ``pip install -e .`` where a
C compiler exists) runs single-threaded with the GIL released, AVX2/F16C where the CPU has them;
CUDA tensors go to the kernels of :mod:`commlib.compress.cuda` (CuPy). Where the extension is not
built this module still imports and :func:`available` is False.

Contract (what the codecs call, with arguments they have already checked; the checks here are
the cheap ones that keep a wrong call from writing out of bounds)::

    available() -> bool
    encode(kind, x, out, block, scale_dtype)              x: contiguous float32/bfloat16/float16,
                                                          out: contiguous uint8 of nbytes(...)
    decode(kind, data, out, block, scale_dtype, accumulate)
    kind: "int8" | "int4" | "e4m3" | "e5m2"; block: resolved (per-tensor: max(n, 1))
"""

from __future__ import annotations

import torch

from ..errors import CommArgumentError, CommConfigError, CommTypeError, arg_error
from .cuda import decode as _cuda_decode, encode as _cuda_encode

try:  # the functions, not the module: grimp reads `from . import _codecs` as importing the package
    # itself, a cycle for tests/test_layers.py
    from ._codecs import decode as _c_decode, encode as _c_encode
except ImportError:  # not built (no C compiler at install): the torch definition runs instead
    _c_decode = _c_encode = None

__all__ = ["available", "encode", "decode", "nbytes", "KINDS", "DTYPES"]

# The codes of the C enums: kinds of csrc/compress/codec_math.h, dtypes of csrc/reduce_math.h.
KINDS = {"int8": 0, "int4": 1, "e4m3": 2, "e5m2": 3}
DTYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}
_SCALE_DTYPES = (torch.float32, torch.float16)


def available() -> bool:
    """Whether the C codecs are built (importable)."""
    return _c_encode is not None


def nbytes(kind: str, n: int, block: int, scale_dtype: torch.dtype) -> int:
    """The wire bytes of n values: one scale per block, then the payload."""
    nb = -(-n // block)
    return nb * scale_dtype.itemsize + ((n + 1) // 2 if kind == "int4" else n)


def _check(fn: str, kind, values: torch.Tensor, wire: torch.Tensor, block, scale_dtype) -> tuple[int, int]:
    """(kind code, dtype code) after checking the arguments of encode/decode; ``values`` is the
    float side (x or out), ``wire`` the bytes (out or data)."""
    fn = f"compress._fast.{fn}"
    if kind not in KINDS:
        raise arg_error(fn, "kind", kind, f"must be one of {list(KINDS)}", "pass the codec's kind")
    if not isinstance(values, torch.Tensor) or values.dtype not in DTYPES:
        raise arg_error(fn, "x/out", getattr(values, "dtype", type(values).__name__),
                        "must be a float32, bfloat16 or float16 tensor",
                        "cast it first (e.g. x.float())", cls=CommTypeError)
    if not isinstance(wire, torch.Tensor) or wire.dtype != torch.uint8:
        raise arg_error(fn, "data/out", getattr(wire, "dtype", type(wire).__name__),
                        "must be a uint8 tensor (wire bytes)", "pass a torch.uint8 buffer",
                        cls=CommTypeError)
    if scale_dtype not in _SCALE_DTYPES:
        raise arg_error(fn, "scale_dtype", scale_dtype, "must be torch.float32 or torch.float16",
                        "pass the codec's scale_dtype")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise arg_error(fn, "block", block, "must be an int >= 1 (resolved: per-tensor is max(n, 1))",
                        "pass codec._block(n)")
    n = values.numel()
    size = nbytes(kind, n, block, scale_dtype)
    if not (values.is_contiguous() and wire.is_contiguous()) or wire.numel() != size:
        raise arg_error(fn, "data/out", f"<{wire.numel()} bytes, {n} values>",
                        f"both tensors must be contiguous and the wire {size} bytes long",
                        "pass contiguous tensors and a wire buffer of codec.nbytes(n)")
    if values.device != wire.device:
        raise arg_error(fn, "data/out", f"<{values.device} and {wire.device}>",
                        "the values and the wire bytes must be on one device",
                        "move them to one device")
    if values.device.type not in ("cpu", "cuda"):
        raise arg_error(fn, "x/out", f"<{values.device}>", "the fast path runs on CPU and CUDA tensors",
                        "use the torch definition (COMMLIB_COMPRESS_IMPL=torch) on this device")
    if values.device.type == "cuda" and wire.data_ptr() % scale_dtype.itemsize:
        raise arg_error(fn, "data/out", f"<address {wire.data_ptr():#x}>",
                        f"the CUDA kernels read the scales as words: the wire must be "
                        f"{scale_dtype.itemsize}-byte aligned", "slice the wire at an aligned offset",
                        cls=CommArgumentError)
    return KINDS[kind], DTYPES[values.dtype]


def _need_ext() -> None:
    if _c_encode is None:
        raise CommConfigError("commlib.compress: the C codecs (commlib.compress._codecs) are not built. "
                              "Fix: pip install -e . on a machine with a C compiler, or set "
                              "COMMLIB_COMPRESS_IMPL=torch")


def encode(kind: str, x: torch.Tensor, out: torch.Tensor, block: int, scale_dtype: torch.dtype) -> None:
    """Write the wire bytes of ``x``'s values (flattened) into ``out``."""
    k, d = _check("encode", kind, x, out, block, scale_dtype)
    if x.device.type == "cuda":
        _cuda_encode(kind, x, out, block, scale_dtype)
        return
    _need_ext()
    _c_encode(k, x.data_ptr(), d, x.numel(), block, scale_dtype == torch.float16, out.data_ptr())


def decode(kind: str, data: torch.Tensor, out: torch.Tensor, block: int, scale_dtype: torch.dtype,
           accumulate: bool) -> None:
    """Write (``accumulate``: add in float32, then round once) the values of ``data`` into ``out``."""
    k, d = _check("decode", kind, out, data, block, scale_dtype)
    if out.device.type == "cuda":
        _cuda_decode(kind, data, out, block, scale_dtype, accumulate)
        return
    _need_ext()
    _c_decode(k, data.data_ptr(), out.numel(), block, scale_dtype == torch.float16, out.data_ptr(), d,
                bool(accumulate))
