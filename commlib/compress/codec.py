"""The codec interface, the registry of codecs by name, and the argument checks they share.

A codec turns a float tensor into a 1-D uint8 wire buffer of a size known in advance
(``nbytes(numel, dtype)``, so that both ends of a collective can size their buffers without a
message) and back. The byte layouts are fixed by the format specification (issue 20): the torch
code of each codec is the definition that the C and CUDA paths match byte for byte.

Each codec lives in its own module and registers itself by name (``register("int8", Int8)``);
``codec(name, **options)`` builds one, ``as_codec`` is what every ``codec=`` argument goes through.
Codecs compare and hash by ``key`` (name and normalized options): two ranks that built the codec
from the same name and options hold equal codecs.
"""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import config
from ..errors import CommArgumentError, CommTypeError, arg_error

__all__ = ["Codec", "Packed", "codec", "as_codec", "register", "names"]

# What every codec encodes: the source is widened to float32 exactly, whatever of these it is.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(eq=False)
class Packed:
    """One encoded tensor: the wire bytes and what decoding them needs.

    ``data``: contiguous 1-D uint8 tensor of exactly ``codec.nbytes(numel, dtype)`` bytes.
    ``shape``, ``dtype``: the source tensor's (``decode`` returns this shape and dtype).
    ``codec``: the codec that wrote it (``decode`` checks it is given the same one).
    """

    data: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    codec: Codec

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class Codec:
    """Base class of the codecs. A subclass sets ``OPTIONS`` (option -> default, in the order its
    repr lists them), validates them in ``_check`` and implements ``nbytes``, ``_encode``,
    ``_decode`` and ``_bound``; the public methods below check their arguments first, once, for
    every codec.

    ``name``: the registered name. ``options``: the normalized options (read-only).
    ``key``: ``(name, (option, value), ...)``, hashable; equality and hash go by it.
    ``lossy``: the round trip may change values (True for every built-in codec).
    ``dtype_in_wire``: the wire buffer holds values in the source dtype (topk), so its size and
    layout depend on the dtype; False where every source dtype gives the same bytes.
    """

    name: ClassVar[str] = ""  # set by register()
    OPTIONS: ClassVar[dict[str, Any]] = {}
    lossy: ClassVar[bool] = True
    dtype_in_wire: ClassVar[bool] = False
    MAX_NUMEL: ClassVar[int | None] = None  # the largest tensor the layout can index, if bounded

    def __init__(self, **options: Any):
        fn = f"compress.codec({self.name!r})"
        for opt, value in options.items():
            if opt not in self.OPTIONS:
                close = difflib.get_close_matches(opt, list(self.OPTIONS), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise arg_error(fn, opt, value, f"codec {self.name!r} has no such option",
                                f"{hint}its options are {list(self.OPTIONS)}")
        self.options = self._check(fn, {**self.OPTIONS, **options})
        self.key = (self.name, *self.options.items())

    def _check(self, fn: str, options: dict[str, Any]) -> dict[str, Any]:
        """Validate the options (raising a CommArgumentError naming the bad one) and return them
        normalized, in ``OPTIONS`` order."""
        return options

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        # flags are listed only when set: codec('int8', block=256, scale_dtype=torch.float32)
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items() if v is not False)
        return f"codec({self.name!r}{opts})"

    def _fn(self, method: str) -> str:
        return f"compress.{self!r}.{method}"

    # --- what a codec implements -------------------------------------------------------------

    def nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """The exact size of the wire buffer of ``numel`` values of source dtype ``dtype``."""
        raise NotImplementedError

    def _encode(self, flat: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None) -> None:
        """Write the encoding of ``flat`` (contiguous, 1-D, a dtype of DTYPES) into ``out``."""
        raise NotImplementedError

    def _decode(self, packed: Packed, out: torch.Tensor, accumulate: bool) -> None:
        """Write (or add, ``accumulate``) the decoded values into ``out`` (contiguous, 1-D)."""
        raise NotImplementedError

    def _bound(self, flat: torch.Tensor) -> torch.Tensor:
        """The per-element error bound of ``flat`` (contiguous, 1-D), float32."""
        raise NotImplementedError

    # --- the public entries ------------------------------------------------------------------

    def encode(self, x: torch.Tensor, *, out: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> Packed:
        """Encode ``x`` (float32, bfloat16 or float16, any shape; read as its flattened values).

        ``out``: where to write, a contiguous 1-D uint8 tensor of exactly ``nbytes(x.numel(),
        x.dtype)`` bytes on ``x``'s device (e.g. a slice of a send buffer); default: a new one.
        ``generator``: the random numbers of stochastic rounding (ignored otherwise).
        Returns the :class:`Packed` holding ``out``.
        """
        fn = self._fn("encode")
        check_values(fn, "x", x)
        n = x.numel()
        self._check_numel(fn, "x", n)
        size = self.nbytes(n, x.dtype)
        if out is None:
            out = torch.empty(size, dtype=torch.uint8, device=x.device)
        else:
            check_wire(fn, "out", out, size, x.device)
        self._encode(x.contiguous().view(-1), out, generator)
        return Packed(out, x.shape, x.dtype, self)

    def decode(self, packed: Packed, out: torch.Tensor | None = None, *,
               accumulate: bool = False) -> torch.Tensor:
        """Decode ``packed`` (made by this codec, or by an equal one).

        ``out``: None for a new tensor of ``packed``'s shape and dtype, or a contiguous float32,
        bfloat16 or float16 tensor with ``packed.numel`` elements on the data's device; returned.
        ``accumulate``: add the decoded values to ``out`` instead (one float32 addition, then
        one rounding to ``out``'s dtype); needs ``out``.
        """
        fn = self._fn("decode")
        self._check_packed(fn, packed)
        if out is None:
            if accumulate:
                raise arg_error(fn, "accumulate", accumulate, "adds into out, and out is None",
                                "pass out= (the tensor to add into), or accumulate=False")
            out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.data.device)
        else:
            check_values(fn, "out", out)
            if out.numel() != packed.numel or not out.is_contiguous() or out.device != packed.data.device:
                raise arg_error(fn, "out", describe(out),
                                f"must be contiguous, on {packed.data.device}, with {packed.numel} elements",
                                "pass a contiguous tensor of packed.shape on the packed data's device")
        self._decode(packed, out.view(-1), bool(accumulate))
        return out

    def packed(self, data: torch.Tensor, shape, dtype: torch.dtype) -> Packed:
        """Wrap received wire bytes ``data`` of a tensor of ``shape`` and ``dtype`` for ``decode``;
        raises if ``data`` does not have exactly the bytes ``nbytes`` says."""
        fn = self._fn("packed")
        check_dtype(fn, "dtype", dtype)
        try:
            size = torch.Size(shape)
        except TypeError:
            raise arg_error(fn, "shape", shape, "is not a shape", "pass a tuple of ints or a torch.Size",
                            cls=CommTypeError) from None
        self._check_numel(fn, "shape", math.prod(size))
        check_wire(fn, "data", data, self.nbytes(math.prod(size), dtype))
        return Packed(data, size, dtype, self)

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element upper bound (float32, ``x``'s shape) on ``|x - decode(encode(x))|`` with
        deterministic rounding; NaN where the decoded value is NaN (non-finite input). Each codec's
        docstring gives its formula."""
        check_values(self._fn("bound"), "x", x)
        return self._bound(x.contiguous().view(-1)).view(x.shape)

    def _check_numel(self, fn: str, arg: str, n: int) -> None:
        if self.MAX_NUMEL is not None and n > self.MAX_NUMEL:
            raise arg_error(fn, arg, f"<{n} elements>", f"codec {self.name!r} encodes at most "
                            f"{self.MAX_NUMEL} elements", "split the tensor into smaller pieces")

    def _check_packed(self, fn: str, packed: Packed) -> None:
        if not isinstance(packed, Packed):
            raise arg_error(fn, "packed", type(packed).__name__, "must be a commlib.compress.Packed",
                            "pass what encode() or codec.packed(data, shape, dtype) returned",
                            cls=CommTypeError)
        if not isinstance(packed.codec, Codec) or packed.codec.key != self.key:
            raise arg_error(fn, "packed", f"<Packed by {packed.codec!r}>",
                            f"was encoded by another codec than {self!r}",
                            "decode with the codec that encoded it: packed.codec.decode(packed)")
        check_wire(fn, "packed", packed.data, self.nbytes(packed.numel, packed.dtype))


# --- the registry ---------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Codec]] = {}


def register(name: str, cls: type[Codec]) -> type[Codec]:
    """Make ``codec(name, ...)`` build a ``cls`` (a :class:`Codec` subclass, whose ``name``
    becomes ``name``); a second registration of ``name`` replaces the first. Returns ``cls``."""
    if not isinstance(name, str) or not name:
        raise arg_error("compress.register", "name", name, "must be a non-empty str",
                        "pass the codec's name, e.g. 'int8'", cls=CommTypeError)
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise arg_error("compress.register", "cls", cls, "must be a subclass of commlib.compress.Codec",
                        "derive the codec class from commlib.compress.Codec", cls=CommTypeError)
    cls.name = name
    _REGISTRY[name] = cls
    return cls


def names() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_REGISTRY)


def codec(name: str, **options: Any) -> Codec:
    """The codec registered as ``name`` with ``options`` (each codec's docstring lists them).

    >>> codec("int8", block=128)
    codec('int8', block=128, scale_dtype=torch.float32)
    """
    if not isinstance(name, str):
        raise arg_error("compress.codec", "name", name, "must be a codec name (str)",
                        f"pass one of {names()}", cls=CommTypeError)
    cls = _REGISTRY.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise arg_error("compress.codec", "name", name, f"names no codec (known: {names()})",
                        f"{hint}use a known name, or register(name, cls) your own codec")
    return cls(**options)


def as_codec(spec: str | Codec) -> Codec:
    """What every ``codec=`` argument goes through: a name builds ``codec(name)`` (default
    options), a :class:`Codec` is itself."""
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, str):
        return codec(spec)
    raise arg_error("compress.as_codec", "codec", type(spec).__name__, "must be a codec name or a Codec",
                    "pass e.g. 'int8' or commlib.compress.codec('int8', block=128)", cls=CommTypeError)


# --- shared by the codecs -------------------------------------------------------------------------

def _impl() -> str:
    """``COMMLIB_COMPRESS_IMPL``: 'auto', 'torch' or 'c'; 'torch' while the option does not exist."""
    return config.get("compress_impl") if "compress_impl" in config.OPTIONS else "torch"


def describe(t: Any) -> str:
    """How an error message shows a tensor argument (never its values)."""
    if not isinstance(t, torch.Tensor):
        return f"<{type(t).__name__}>"
    return f"<tensor shape={tuple(t.shape)} dtype={t.dtype} device={t.device}>"


def check_dtype(fn: str, arg: str, dtype: Any) -> None:
    if dtype not in DTYPES:
        raise arg_error(fn, arg, dtype, "codecs encode float32, bfloat16 and float16 values",
                        "cast to one of them first (e.g. x.float())", cls=CommTypeError)


def check_values(fn: str, arg: str, t: Any) -> None:
    """``t`` is a tensor of a dtype the codecs encode."""
    if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES:
        raise arg_error(fn, arg, describe(t), "must be a float32, bfloat16 or float16 tensor",
                        f"pass {arg}.float() (or cast {arg} to torch.bfloat16 / torch.float16)",
                        cls=CommTypeError)


def check_wire(fn: str, arg: str, t: Any, nbytes: int, device: torch.device | None = None) -> None:
    """``t`` is a contiguous 1-D uint8 tensor of exactly ``nbytes`` bytes (on ``device``, if given)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise arg_error(fn, arg, describe(t), "must be a uint8 tensor (wire bytes)",
                        "pass a torch.uint8 buffer, e.g. torch.empty(codec.nbytes(n, dtype), dtype=torch.uint8)",
                        cls=CommTypeError)
    if t.dim() != 1 or not t.is_contiguous() or t.numel() != nbytes or device not in (None, t.device):
        where = f" and on {device}" if device is not None else ""
        raise arg_error(fn, arg, describe(t), f"must be contiguous, 1-D and {nbytes} bytes long{where}",
                        f"pass a contiguous 1-D uint8 tensor of codec.nbytes(...) = {nbytes} bytes "
                        f"(e.g. buf[offset:offset + {nbytes}])", cls=CommArgumentError)


def check_block(fn: str, block: Any) -> int | None:
    if block is None:
        return None
    if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
        raise arg_error(fn, "block", block, "must be an int >= 1 or None (one scale per tensor)",
                        "pass e.g. block=256")
    return int(block)


def check_choice(fn: str, arg: str, value: Any, allowed: tuple) -> Any:
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise arg_error(fn, arg, value, f"must be one of {list(allowed)}", f"pass {arg}={allowed[0]!r}")
    return value


def reinterpret(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``data`` (uint8, 1-D) read as little-endian ``dtype`` values: a view where the
    byte offset is a multiple of the item size, else a copy."""
    if data.storage_offset() % dtype.itemsize:
        data = data.clone()
    return data.view(dtype)
