"""Point-to-point algorithms at world sizes 1 to 5 (5 ranks oversubscribe the 2 cores): one
mpiexec spawn per size runs every case of tests/mpi/algorithms.py."""

import pytest

CASES = (
    "case_reductions", "case_movement", "case_shapes", "case_async", "case_message_pattern",
)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_algorithms(mpirun, n):
    proc = mpirun(n, "algorithms.py", timeout=300)
    for case in CASES:
        assert f"ok {case} (world size {n})" in proc.stdout, proc.stdout


def test_algorithms_polled(mpirun):
    """The same cases through the poll loop (COMMLIB_TIMEOUT_MODE=raise) instead of the engine's
    blocking wait; 3 ranks take the non-power-of-two fold."""
    proc = mpirun(3, "algorithms.py", timeout=300, COMMLIB_TIMEOUT_MODE="raise")
    for case in CASES:
        assert f"ok {case} (world size 3)" in proc.stdout, proc.stdout
