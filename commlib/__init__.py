"""commlib: topology-aware collectives and parallel building blocks for distributed deep learning.

Drop-in for torch.distributed's collectives::

    import commlib, torch
    commlib.init()                       # mpirun, torchrun, an initialized torch.distributed, or 1 process
    t = torch.full((5,), float(commlib.get_rank() + 1))
    commlib.all_reduce(t)                # every rank: sum over ranks
"""

from . import tuning
from .api.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    reduce,
    reduce_scatter_tensor,
)
from .api.explain import explain
from .api.groups import (
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
from .api.memory import shared_empty
from .api.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
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
from .ops import ReduceOp
from .runtime.progress import Work
from .version import __version__  # noqa: F401  (commlib.__version__)

# ``commlib.tuning.explain``, the name the docs used first: the same function. (The tuning layer
# sits below the groups, so the API, which knows the default group, provides it.)
tuning.explain = explain

__all__ = [
    "init", "finalize", "is_initialized", "get_rank", "get_world_size", "get_world_group",
    "new_group", "Group", "Mesh", "Work", "ReduceOp", "P2POp",
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "shared_empty", "explain",
    "CommError", "CommArgumentError", "CommTypeError", "CommConfigError", "CommStateError",
    "CommMismatchError", "CommTimeoutError", "CommBackendError", "CommUnsupportedError",
]
