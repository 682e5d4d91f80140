"""commlib: topology-aware collectives and parallel building blocks for distributed deep learning.

Drop-in for torch.distributed's collectives::

    import commlib, torch
    commlib.init()                       # mpirun, torchrun, an initialized torch.distributed, or 1 process
    t = torch.full((5,), float(commlib.get_rank() + 1))
    commlib.all_reduce(t)                # every rank: sum over ranks
"""

from ._progress import Work
from .collectives import (
    P2POp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter_tensor,
    send,
)
from .errors import (
    CommArgumentError,
    CommBackendError,
    CommConfigError,
    CommError,
    CommMismatchError,
    CommStateError,
    CommTimeoutError,
    CommTypeError,
    CommUnsupportedError,
)
from .group import (
    Group,
    Mesh,
    finalize,
    get_rank,
    get_world_group,
    get_world_size,
    init,
    is_initialized,
    new_group,
)
from .memory import shared_empty
from .ops import ReduceOp

__version__ = "0.1.0"

__all__ = [
    "init", "finalize", "is_initialized", "get_rank", "get_world_size", "get_world_group",
    "new_group", "Group", "Mesh", "Work", "ReduceOp", "P2POp",
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "shared_empty",
    "CommError", "CommArgumentError", "CommTypeError", "CommConfigError", "CommStateError",
    "CommMismatchError", "CommTimeoutError", "CommBackendError", "CommUnsupportedError",
]
