"""Hierarchical all-reduce across virtual hosts (one machine's ranks split by COMMLIB_TEST_HOST),
for correctness at 2x2 and 2x3 ranks, hosts contiguous and interleaved; and its refusal, on every
rank, where the layout cannot run it."""

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


@pytest.mark.parametrize("hosts", [["a", "a"], ["a", "b"], ["a", "a", "b"]],
                         ids=["one-host", "one-rank-per-host", "uneven"])
def test_hierarchical_refuses_layouts_it_cannot_run(hosts):
    proc = run_mpi_hosts(hosts, "hierarchical_refuse.py", timeout=120)
    assert proc.stdout.count("refused:") == len(hosts), proc.stdout + proc.stderr
    assert "needs at least two hosts with the same number (>= 2) of ranks each" in proc.stdout
