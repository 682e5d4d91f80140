"""commlib.compress's collectives on real ranks (tests/mpi/compress_cases.py), at 1-4 ranks: every
codec against the exact sum within the summed codec bounds, bytes on the wire against the
formula, AVG and async, error feedback, the hierarchical algorithm on two virtual hosts, the
pieces (reduce-scatter, all-gather, send/recv), the automatic choice against ``explain``, and
errors on every rank. One job per world size; at 3 ranks under COMMLIB_DEBUG=1."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_mpi

CASES = ["case_all_reduce_against_exact", "case_wire_bytes_equal_the_formula",
         "case_avg_and_async", "case_hierarchical", "case_error_feedback_tracks_the_sum",
         "case_pieces", "case_auto_and_explain", "case_errors"]
# world size -> (virtual hosts of the ranks, COMMLIB_DEBUG)
JOBS = {1: ("", False), 2: ("", False), 3: ("", True), 4: ("a,a,b,b", False)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", sorted(JOBS))
def test_compress_mpi(n):
    hosts, debug = JOBS[n]
    env = {"COMPRESS_TEST_HOSTS": hosts} if hosts else {}
    if debug:
        env["COMMLIB_DEBUG"] = "1"
    out = run_mpi(n, "compress_cases.py", *CASES, timeout=230, **env).stdout
    for case in CASES:
        assert f"ok {case} (world size {n})" in out, out


def test_case_list_is_complete():
    text = (ROOT / "tests" / "mpi" / "compress_cases.py").read_text()
    defined = {line.split("(")[0][4:] for line in text.splitlines() if line.startswith("def case_")}
    assert defined == set(CASES), defined
