"""Multi-host topology under real mpiexec: ranks on different virtual hosts (COMMLIB_TEST_HOST,
MPMD syntax) gather one cluster topology, and Mesh.from_topology keeps "tp" inside a host."""

from conftest import run_mpi_hosts


def test_gather_and_mesh_across_virtual_hosts():
    layout = ["a", "b", "a", "b"]  # round-robin launch: a topology-blind mesh would put tp across hosts
    proc = run_mpi_hosts(layout, "topology_gather.py", ",".join(layout))
    assert "ok case_gather_across_hosts (world size 4)" in proc.stdout
    assert "ok case_mesh_from_topology (world size 4)" in proc.stdout
