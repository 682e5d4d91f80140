"""Hierarchical all-reduce across virtual hosts (one machine's ranks split by COMMLIB_TEST_HOST),
for correctness at 2x2 and 2x3 ranks, hosts contiguous and interleaved, and on the layouts where it
degenerates (one host, one rank per host) or runs one leader per host (uneven hosts)."""

import pytest

from conftest import run_mpi_hosts

CASES = ("case_layout", "case_all_reduce", "case_async_and_shaped")


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "a", "b"],
                                   ["a", "a", "a", "b", "b", "b"]],
                         ids=["2x2", "2x2-interleaved", "2x3"])
def test_hierarchical_all_reduce(hosts):
    proc = run_mpi_hosts(hosts, "hierarchical.py", ",".join(hosts), timeout=300)
    for case in CASES:
        assert f"ok {case} (world size {len(hosts)})" in proc.stdout, proc.stdout


@pytest.mark.parametrize("hosts", [["a", "a", "a"], ["a", "b", "c"], ["a", "a", "b"]],
                         ids=["one-host", "one-rank-per-host", "uneven-leaders"])
def test_hierarchical_on_every_layout(hosts):
    proc = run_mpi_hosts(hosts, "hierarchical.py", ",".join(hosts), timeout=300)
    for case in CASES:
        assert f"ok {case} (world size {len(hosts)})" in proc.stdout, proc.stdout
