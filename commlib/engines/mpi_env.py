"""The environment commlib gives MPI before initializing it: UCX's TCP transport settings.

MPI reads its transport's options once, in ``MPI_Init``, from the environment. ``import commlib``
imports this module first, and when MPI is not initialized yet (``mpi4py.MPI`` not imported: MPI
is then initialized by ``commlib.init`` or ``init_process_group("commlib")`` under mpirun, or by
the program's own later ``from mpi4py import MPI``) it sets the options of :data:`UCX_TCP` that the
environment leaves unset (``COMMLIB_UCX_TCP=off``: none). They touch only
UCX's TCP transport (MPICH's and Open MPI's UCX over Ethernet between hosts): InfiniBand, shared
memory and the other engines never read them. Measured on 2 hosts x 1 rank at 1 Gb/s,
docs/torch-backend-bench.md:

* ``UCX_TCP_SNDBUF=256k``. With the kernel's autotuned send buffer (megabytes), an eager send of
  an all-reduce's ~1 MiB chunks completes as soon as its bytes are in the socket: under DDP's skew
  the later rank finished its last bucket 9-18 ms before the earlier one, which waited on bytes
  the kernel had yet to send and took 103-112 ms for 11 MiB where gloo took 97-100. With 256 KiB
  the ranks end within 2-4 ms of each other, 97 ms after the later one's issue, as gloo does. At
  256 KiB a connection still covers 2 Gb/s at a millisecond's round trip (20 Gb/s at 100 µs); a
  faster TCP link wants a larger value in the launcher's environment.
* ``UCX_TCP_RX_SEG_SIZE=512k``. UCX reads at most one receive segment (64 KiB by default) per
  progress call, so at the progress thread's 1 ms pace an 11 MiB bucket took 163 ms; with 512 KiB
  segments the same bytes need an eighth of the calls.

A program that imports ``mpi4py.MPI`` before commlib has initialized MPI already: nothing is set
then (import commlib first, or give them in the launcher's environment, ``mpiexec -genv``).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, MutableMapping

from .. import config

__all__ = ["UCX_TCP", "transport_defaults", "apply", "APPLIED"]

UCX_TCP = {"UCX_TCP_SNDBUF": "256k", "UCX_TCP_RX_SEG_SIZE": "512k"}

# What :func:`apply` set in this process (empty if nothing: MPI already initialized, the option
# off, or every variable set by the caller).
APPLIED: dict[str, str] = {}


def transport_defaults(environ: Mapping[str, str], mode: str,
                       mpi_initialized: bool) -> dict[str, str]:
    """The variables of :data:`UCX_TCP` to set (pure): none when ``mode`` (``COMMLIB_UCX_TCP``) is
    ``off`` or MPI is initialized already (its transports read the environment once, at init),
    else those ``environ`` leaves unset (the caller's settings win)."""
    if mode == "off" or mpi_initialized:
        return {}
    return {name: value for name, value in UCX_TCP.items() if name not in environ}


def apply(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set :func:`transport_defaults` in ``environ``, before ``mpi4py.MPI`` is imported (which
    initializes MPI); returns what it set, also kept in :data:`APPLIED`."""
    chosen = transport_defaults(environ, config.get("ucx_tcp"), "mpi4py.MPI" in sys.modules)
    environ.update(chosen)
    APPLIED.update(chosen)
    return chosen


apply()
