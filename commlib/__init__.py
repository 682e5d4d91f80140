"""commlib: topology-aware collectives and parallel building blocks for distributed deep learning.

Drop-in for torch.distributed's collectives::

    import commlib, torch
    commlib.init()                       # mpirun, torchrun, an initialized torch.distributed, or 1 process
    t = torch.full((5,), float(commlib.get_rank() + 1))
    commlib.all_reduce(t)                # every rank: sum over ranks

A program written for torch.distributed runs with ``import torch.distributed as dist`` replaced by
``import commlib as dist``: ``init_process_group``, the collectives (list and tensor forms), the
object collectives, ``monitored_barrier`` and the group queries keep torch's names and signatures.
"""

from .engines import mpi_env as _mpi_env  # noqa: F401 - first: UCX's TCP defaults, before MPI's init
from . import tuning
from .api import autotune as _autotune  # noqa: F401 - registers the in-job calibration of new groups
from .api.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from .api.compat import (
    GroupMember,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    init_process_group,
    is_available,
    reduce_op,
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
from .api.objects import all_gather_object, broadcast_object_list, gather_object, scatter_object_list
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
from . import torch_backend  # noqa: F401, E402  (registers the torch.distributed backend "commlib")

# ``commlib.tuning.explain``, the name the docs used first: the same function. (The tuning layer
# sits below the groups, so the API, which knows the default group, provides it.)
tuning.explain = explain

__all__ = [
    "init", "finalize", "is_initialized", "get_rank", "get_world_size", "get_world_group",
    "new_group", "Group", "Mesh", "Work", "ReduceOp", "P2POp",
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "init_process_group", "destroy_process_group", "is_available", "get_backend",
    "get_global_rank", "get_group_rank", "get_process_group_ranks", "GroupMember", "reduce_op",
    "shared_empty", "explain",
    "CommError", "CommArgumentError", "CommTypeError", "CommConfigError", "CommStateError",
    "CommMismatchError", "CommTimeoutError", "CommBackendError", "CommUnsupportedError",
]
