"""Point-to-point algorithms at world sizes 1 to 5 (5 ranks oversubscribe the 2 cores)."""

import pytest


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_algorithms(mpirun, n):
    proc = mpirun(n, "algos.py", timeout=300)
    for case in ("case_reductions", "case_movement", "case_message_pattern"):
        assert f"ok {case}" in proc.stdout, proc.stdout
