"""The CUDA sources of ``csrc/`` compiled at run time by NVRTC through CuPy ``RawModule`` (the
'cuda' extra), once per process and file. CuPy is imported only here and only when a kernel is
first needed, so that CPU-only installs never touch it."""

from __future__ import annotations

import pathlib

from ..errors import CommBackendError

__all__ = ["load"]

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
_MODULES: dict = {}


def load(name: str, who: str, fix: str):
    """``csrc/<name>`` compiled (cached). Without CuPy: ``CommBackendError`` saying ``who`` needs
    it, and ``fix``."""
    module = _MODULES.get(name)
    if module is None:
        try:
            import cupy  # optional dependency (the 'cuda' extra): only CUDA paths get here
        except ImportError as exc:
            raise CommBackendError(f"{who}: CuPy is not installed ({exc}). Fix: {fix}") from exc
        source = (CSRC / name).read_text()
        module = _MODULES[name] = cupy.RawModule(code=source, options=("-std=c++17", f"-I{CSRC}"))
    return module
