"""Multi-host topology under real mpiexec: ranks on different virtual hosts (COMMLIB_TEST_HOST,
MPMD syntax) gather one cluster topology, and Mesh.from_topology keeps "tp" inside a host."""

import sys

from conftest import MPI_DIR, base_env, mpiexec_path, run_cmd


def test_gather_and_mesh_across_virtual_hosts():
    layout = ["a", "b", "a", "b"]  # round-robin launch: a topology-blind mesh would put tp across hosts
    cmd = [mpiexec_path()]
    for k, host in enumerate(layout):
        if k:
            cmd.append(":")
        cmd += ["-n", "1", "-env", "COMMLIB_TEST_HOST", host, sys.executable, str(MPI_DIR / "topology_gather.py"),
                ",".join(layout)]
    proc = run_cmd(cmd, timeout=240, env=base_env())
    assert "ok case_gather_across_hosts (world size 4)" in proc.stdout
    assert "ok case_mesh_from_topology (world size 4)" in proc.stdout
