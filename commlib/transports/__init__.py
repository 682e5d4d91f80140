"""Transports: data planes a group uses beside its engine, attached at group creation or not
(saying why). ``shm``: one shared-memory segment per group of CPU ranks on one host (csrc/shm/).
``cuda_ipc``: CUDA IPC buffers and kernels for the GPU ranks of one host (csrc/cuda_ipc.cu)."""

from . import cuda_ipc, shm  # noqa: F401  (each registers its transport)
from .base import GroupFacts, Transport, register_transport, transports

__all__ = ["Transport", "GroupFacts", "register_transport", "transports"]
