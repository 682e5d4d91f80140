"""UCX's TCP settings commlib gives MPI before initializing it (commlib/engines/mpi_env.py): set
where the environment leaves them unset, only before MPI_Init, never over the caller's values,
and not at all with COMMLIB_UCX_TCP=off. The real cases run in fresh interpreters, since a process
initializes MPI once."""

import json
import sys

import pytest

from commlib.engines.mpi_env import transport_defaults
from conftest import base_env, run_cmd

SNDBUF, RX_SEG = "UCX_TCP_SNDBUF", "UCX_TCP_RX_SEG_SIZE"
BOTH = {SNDBUF: "256k", RX_SEG: "512k"}


def test_defaults_fill_only_what_the_environment_leaves_unset():
    assert transport_defaults({}, "auto", False) == BOTH
    assert transport_defaults({SNDBUF: "1m"}, "auto", False) == {RX_SEG: "512k"}
    assert transport_defaults({SNDBUF: "", RX_SEG: "64k"}, "auto", False) == {}
    assert transport_defaults({}, "off", False) == {}
    assert transport_defaults({}, "auto", True) == {}  # MPI read its environment already


# Prints, as JSON: what commlib set, the variables as MPI_Init saw them (the process's environment
# once mpi4py.MPI is imported). `import commlib` comes before or after `from mpi4py import MPI`.
_PROBE = """
import json, os, sys
if sys.argv[1] == "mpi4py-first":
    from mpi4py import MPI
import commlib
from commlib.engines import mpi_env
from mpi4py import MPI
assert MPI.Is_initialized()
print(json.dumps({"applied": mpi_env.APPLIED,
                  "env": {k: os.environ.get(k) for k in ("UCX_TCP_SNDBUF", "UCX_TCP_RX_SEG_SIZE")}}))
"""


def _probe(order: str, **env) -> dict:
    environ = base_env(**env)
    for key in (SNDBUF, RX_SEG):
        if key not in env:
            environ.pop(key, None)
    out = run_cmd([sys.executable, "-c", _PROBE, order], timeout=120, env=environ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("order, env, applied, seen", [
    ("commlib-first", {}, BOTH, BOTH),
    ("commlib-first", {SNDBUF: "1m"}, {RX_SEG: "512k"}, {SNDBUF: "1m", RX_SEG: "512k"}),
    ("commlib-first", {"COMMLIB_UCX_TCP": "off"}, {}, {SNDBUF: None, RX_SEG: None}),
    ("mpi4py-first", {}, {}, {SNDBUF: None, RX_SEG: None}),
])
def test_the_settings_reach_mpi_init_only_when_commlib_initializes_it(order, env, applied, seen):
    got = _probe(order, **env)
    assert got == {"applied": applied, "env": seen}
