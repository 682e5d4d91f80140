"""Turning what users pass (torch tensors, NumPy arrays, CuPy arrays) into torch tensors that share
their memory, and checking them."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..errors import CommArgumentError, CommTypeError, arg_error
from ..ops import DTYPES

__all__ = ["as_tensor", "work_view", "overlaps"]


def as_tensor(x, fn: str, arg: str, writable: bool = False) -> torch.Tensor:
    """A torch tensor sharing ``x``'s memory, with a dtype commlib supports."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray):
        if writable and not x.flags.writeable:
            raise arg_error(fn, arg, f"<read-only ndarray {x.shape}>",
                            "is read-only but receives the result",
                            "pass a writable array (np.array(x) makes one)", CommArgumentError)
        if any(s < 0 for s in x.strides):
            raise arg_error(fn, arg, f"<ndarray strides={x.strides}>",
                            "has negative strides, which torch cannot view without a copy",
                            "pass np.ascontiguousarray(x)", CommArgumentError)
        if not x.dtype.isnative:
            raise arg_error(fn, arg, f"<ndarray dtype={x.dtype.str}>",
                            "is not in this machine's byte order",
                            "convert it with x.astype(x.dtype.newbyteorder('='))", CommTypeError)
        try:
            if x.flags.writeable:
                t = torch.from_numpy(x)
            else:  # a read-only input: commlib only reads it, so torch's warning does not apply
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    t = torch.from_numpy(x)
        except TypeError:
            t = None
        if t is None:
            raise arg_error(fn, arg, f"<ndarray dtype={x.dtype}>", "has an unsupported dtype",
                            f"use one of {sorted(n for n, _ in DTYPES.values())}", CommTypeError)
    elif type(x).__module__.split(".")[0] == "cupy":
        # CuPy work is queued on CuPy's current stream: finish it before an engine reads the
        # memory (DLPack hands over the pointer, not the stream order).
        import cupy  # optional dependency (the 'cuda' extra): only GPU paths get here

        cupy.cuda.get_current_stream().synchronize()
        t = torch.from_dlpack(x)
    else:
        raise arg_error(fn, arg, f"<{type(x).__module__}.{type(x).__qualname__}>",
                        "must be a torch.Tensor, numpy.ndarray or cupy.ndarray",
                        "convert it, e.g. torch.as_tensor(x)", CommTypeError)
    if t.dtype not in DTYPES:
        raise arg_error(fn, arg, f"<tensor dtype={t.dtype}>", "has an unsupported dtype",
                        f"use one of {sorted(n for n, _ in DTYPES.values())}", CommTypeError)
    if t.requires_grad:  # communication is not recorded by autograd (as in torch.distributed):
        t = t.detach()   # the engine works on the same memory, without the autograd wrapper
    return t


def work_view(t: torch.Tensor, fn: str | None = None, arg: str = "tensor") -> tuple[torch.Tensor, bool]:
    """A contiguous tensor holding ``t``'s data, and whether it is a copy (non-contiguous input:
    the result must be copied back with ``t.copy_(buf)``). Its shape is ``t``'s: algorithms that
    slice it flatten it themselves (``buf.view(-1)``), so the native path pays for no view.

    ``fn`` given: ``t`` receives a result, and one whose elements share memory (an ``expand()``ed
    view) is refused here, before anything is posted, rather than failing in the copy-back."""
    if t.is_contiguous():
        return t, False
    if fn is not None and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise arg_error(fn, arg, f"<tensor shape={tuple(t.shape)} stride={t.stride()}>",
                        "receives the result but several of its elements share memory "
                        "(a stride of 0, as expand() makes)", "pass a tensor with its own memory, e.g. x.clone()")
    return t.contiguous(), True


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges overlap (aliasing between input and output)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1
