"""One rank fails while the world group is being built (a collective step: shared-memory segment,
cost model): the job must end, not leave the other ranks waiting in that step."""

from mpi4py import MPI

import commlib
from commlib.runtime import resources as _resources

if MPI.COMM_WORLD.Get_rank() == 1:
    def _fail(engine):
        raise RuntimeError("injected failure while building the world group")

    _resources._facts = _fail

commlib.init()
commlib.all_reduce(__import__("torch").ones(4))
print("unreachable: every rank finished init", flush=True)
