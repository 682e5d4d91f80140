"""Automatic CPU binding (``COMMLIB_AFFINITY``, commlib/topology/affinity.py and
commlib/runtime/affinity.py): the plan as a pure function, the cores read from a sysfs tree, and
real jobs under mpiexec and with torchrun's variables: unbound ranks get disjoint shares of the
host's CPUs (one CPU each, round robin, when they outnumber the CPUs), every thread of the process
follows, ranks a launcher bound and ``COMMLIB_AFFINITY=off`` are left alone, and
``commlib.finalize`` gives the mask and torch's thread count back."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

from conftest import MPI_DIR, ROOT, base_env, mpiexec_path, run_cmd, torchrun_env

from commlib.runtime.affinity import decide
from commlib.topology.affinity import cores, plan

CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("units,n,want", [
    ([(0,), (1,)], 2, [(0,), (1,)]),
    ([(0,), (1,)], 4, [(0,), (1,), (0,), (1,)]),  # more ranks than cores: round robin
    ([(0,), (1,)], 3, [(0,), (1,), (0,)]),
    ([(0, 4), (1, 5), (2, 6), (3, 7)], 2, [(0, 4, 1, 5), (2, 6, 3, 7)]),  # whole cores, threads too
    ([(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)], 3, [(0, 1), (2, 3), (4, 5)]),  # 6, 7 unused
    ([(0,), (1,)], 1, [(0, 1)]),
])
def test_plan(units, n, want):
    assert [plan(units, k, n) for k in range(n)] == want


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="no cores"):
        plan([], 0, 1)
    with pytest.raises(ValueError, match="local_rank 2"):
        plan([(0,)], 2, 2)


def test_cores_from_a_sysfs_tree(tmp_path):
    # two packages of two cores with two hardware threads each, numbered the way x86 does
    # (cpu k and k + 4 are siblings); cpu 9's topology is missing: a core of its own
    layout = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1),
              4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)}
    for cpu, (package, core) in layout.items():
        d = tmp_path / f"devices/system/cpu/cpu{cpu}/topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")
    assert cores(range(8), root=str(tmp_path)) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert cores([1, 5, 2, 9], root=str(tmp_path)) == [(9,), (1, 5), (2,)]


def test_decide():
    # rank: (host, mask key, mask size)
    rows = [(7, 1, 2), (7, 1, 2), (8, 1, 2), (8, 1, 2), (9, 1, 2)]
    assert [decide(rows, r) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert decide(rows, 4) == "the host's only rank"
    assert "one CPU" in decide([(7, 1, 1), (7, 2, 1)], 0)
    assert "different CPU masks" in decide([(7, 1, 2), (7, 2, 2)], 1)


def _rows(out: str) -> list[dict]:
    line = next(x for x in out.splitlines() if x.startswith("ROWS "))
    return json.loads(line[5:])


def _mpiexec(n: int, *launcher_args: str, **env) -> list[dict]:
    exe = mpiexec_path()
    if exe is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra (pip install mpich)")
    cmd = [exe, *launcher_args, "-n", str(n), sys.executable, str(MPI_DIR / "affinity_check.py")]
    return _rows(run_cmd(cmd, timeout=120, env=base_env(**env)).stdout)


def _check_bound(rows: list[dict]) -> None:
    """The definition: every rank started on the host's whole mask and ends up on a share of it;
    with at least one CPU per rank the shares are disjoint and equal, else one CPU each, spread
    evenly; every thread of a rank on its share; finalize gives the mask back."""
    n = len(rows)
    for row in rows:
        assert row["before"] == CPUS, row
        assert set(row["during"]) <= set(CPUS) and row["during"], row
        assert row["all_threads"] == [row["during"]], row
        assert row["after"] == CPUS, row
    shares = [set(row["during"]) for row in rows]
    if n <= len(CPUS):
        assert all(len(s) == len(CPUS) // n for s in shares), shares
        assert len(set().union(*shares)) == sum(len(s) for s in shares), shares
    else:
        assert all(len(s) == 1 for s in shares), shares
        per_cpu = collections.Counter(next(iter(s)) for s in shares)
        assert set(per_cpu) == set(CPUS) and max(per_cpu.values()) - min(per_cpu.values()) <= 1


@pytest.mark.skipif(len(CPUS) < 2, reason="needs a process allowed on at least 2 CPUs")
@pytest.mark.parametrize("n", [2, 3, 4])
def test_unbound_ranks_are_bound(n):
    _check_bound(_mpiexec(n))


@pytest.mark.skipif(len(CPUS) < 2, reason="needs a process allowed on at least 2 CPUs")
def test_ranks_bound_by_the_launcher_or_off_are_left_alone():
    for row in _mpiexec(4, "-bind-to", "core"):  # each rank on its own CPU already
        assert row["during"] == row["before"] == row["after"] and len(row["before"]) == 1, row
    for row in _mpiexec(2, COMMLIB_AFFINITY="off"):
        assert row["during"] == row["before"] == row["after"] == CPUS, row


@pytest.mark.skipif(len(CPUS) < 2, reason="needs a process allowed on at least 2 CPUs")
def test_torchrun_ranks_bound_and_torch_threads_limited():
    """With torchrun's variables (the torch engine over gloo) and no OMP_NUM_THREADS: torch's
    intra-op threads follow the share (each rank one CPU of two here) and come back at finalize."""
    envs = torchrun_env(len(CPUS))
    procs = []
    for env in envs:
        env.pop("OMP_NUM_THREADS")
        procs.append(subprocess.Popen([sys.executable, str(MPI_DIR / "affinity_check.py")],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env, cwd=ROOT))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    rows = _rows(outs[0])
    _check_bound(rows)
    for row in rows:
        assert row["threads_before"] == row["threads_after"] > len(row["during"]), row
        assert row["threads_during"] == len(row["during"]), row
