"""Collective algorithms, one file each, registered by name with their cost and eligibility
(:mod:`commlib.algorithms.registry`). Importing this package registers the built-in ones."""

from . import (  # noqa: F401  (each module registers its algorithms)
    binomial,
    cuda_ipc,
    hierarchical,
    native,
    pipelined_doubling,
    rabenseifner,
    recursive_doubling,
    ring,
    shm,
)
from .registry import (
    COLLECTIVES,
    Algorithm,
    Call,
    Ctx,
    algorithm_names,
    chunk_bounds,
    get_algorithm,
    records,
    register_algorithm,
    unregister_algorithm,
)

__all__ = ["Ctx", "Call", "Algorithm", "register_algorithm", "unregister_algorithm",
           "get_algorithm", "algorithm_names", "records", "COLLECTIVES", "chunk_bounds"]
