"""The CUDA kernels of the block-quantizer codecs (``csrc/compress.cu``, loaded through CuPy
``RawModule``; the per-element math is ``csrc/compress/codec_math.h``, shared with the C fast
path). :mod:`commlib.compress._fast` hands CUDA tensors here, with the same arguments as its CPU
path.

Untested on a device: this machine has no GPU, so the kernels are only compiled (for sm_80 and
sm_90, tests/test_csrc.py); the host build of the same per-element math is what
tests/test_compress_c.py checks against the torch definition. CuPy (the 'cuda' extra) is imported
only when a kernel is first needed.

Launches go on torch's current stream (raw device pointers; no CuPy arrays, no host round trip).
Encode is two launches: the scales (one thread block per codec block), then the codes (one thread
per payload byte); decode is one (one thread per element).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import nvrtc

__all__ = ["load_module", "kernel_names", "encode", "decode"]

_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_KIND = {"int8": 0, "int4": 1, "e4m3": 2, "e5m2": 3}  # CL_INT8 ... of codec_math.h
_THREADS = 256  # CL_THREADS of compress.cu (the scales kernel's shared memory is sized by it)
_MAX_GRID = 65535

def kernel_names() -> list[str]:
    """Every kernel this module launches (tests check that csrc/compress.cu defines each)."""
    names = [f"cl_compress_scales_{d}" for d in _SUFFIX.values()]
    return names + [f"cl_compress_{op}_{k}_{d}" for op in ("encode", "decode") for k in _KIND
                    for d in _SUFFIX.values()]


_CSRC = nvrtc.CSRC  # the CUDA sources (tests read them from here)


def load_module():
    """csrc/compress.cu compiled by NVRTC through CuPy (once per process)."""
    return nvrtc.load("compress.cu", "commlib.compress",
                      "the codecs' CUDA kernels need it: pip install 'commlib[cuda]', or set "
                      "COMMLIB_COMPRESS_IMPL=torch")


def _launch(name: str, grid: int, args: tuple, device: torch.device) -> None:
    import cupy  # optional dependency (the 'cuda' extra): only CUDA tensors get here

    kernel = load_module().get_function(name)
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        kernel((max(1, min(grid, _MAX_GRID)),), (_THREADS,), args)


def encode(kind: str, x: torch.Tensor, out: torch.Tensor, block: int, scale_dtype: torch.dtype) -> None:
    """``commlib.compress._fast.encode`` for CUDA tensors (arguments already checked there)."""
    n = x.numel()
    if n == 0:
        return
    u64, i32 = np.uint64, np.int32
    f16 = i32(scale_dtype == torch.float16)
    src, wire = u64(x.data_ptr()), u64(out.data_ptr())
    _launch(f"cl_compress_scales_{_SUFFIX[x.dtype]}", -(-n // block),
            (src, u64(n), u64(block), i32(_KIND[kind]), f16, wire), x.device)
    nbytes = (n + 1) // 2 if kind == "int4" else n
    _launch(f"cl_compress_encode_{kind}_{_SUFFIX[x.dtype]}", -(-nbytes // _THREADS),
            (src, u64(n), u64(block), f16, wire), x.device)


def decode(kind: str, data: torch.Tensor, out: torch.Tensor, block: int, scale_dtype: torch.dtype,
           accumulate: bool) -> None:
    """``commlib.compress._fast.decode`` for CUDA tensors (arguments already checked there)."""
    n = out.numel()
    if n == 0:
        return
    u64, i32 = np.uint64, np.int32
    _launch(f"cl_compress_decode_{kind}_{_SUFFIX[out.dtype]}", -(-n // _THREADS),
            (u64(data.data_ptr()), u64(n), u64(block), i32(scale_dtype == torch.float16),
             u64(out.data_ptr()), i32(bool(accumulate))), out.device)
