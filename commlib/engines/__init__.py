"""Engines (backends, in torch.distributed's word), registered by name: ``mpi``, ``torch``, ``nccl``, ``self``.

Adding one is a new module with a class decorated by ``@register_backend("name")`` and a line in
``_MODULES`` so that it is found by name without importing every engine at start-up.
"""

from __future__ import annotations

import importlib

from ..errors import CommBackendError
from .base import Backend

__all__ = ["Backend", "register_backend", "get_backend_class", "available_backends"]

_REGISTRY: dict[str, type[Backend]] = {}

# name -> module that registers it (imported on first use: engines are optional dependencies).
_MODULES = {
    "self": "commlib.engines.self_backend",
    "mpi": "commlib.engines.mpi",
    "torch": "commlib.engines.torch_dist",
    "nccl": "commlib.engines.nccl",
}


def register_backend(name: str):
    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_backends() -> list[str]:
    return sorted(set(_MODULES) | set(_REGISTRY))


def get_backend_class(name: str) -> type[Backend]:
    if name not in _REGISTRY:
        module = _MODULES.get(name)
        if module is None:
            raise CommBackendError(
                f"commlib.init(): argument 'backend' = {name!r}: no such backend. "
                f"Fix: use one of {available_backends()}."
            )
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise CommBackendError(
                f"commlib.init(): backend {name!r} cannot be imported here ({exc}). "
                f"Fix: install its engine (see docs/quickstart.md: extras 'mpich', 'cuda')."
            ) from exc
    return _REGISTRY[name]
