import pytest


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_reduce_sum_of_ranks(mpirun, n):
    proc = mpirun(n, "smoke.py")
    assert "ok case_sum_of_ranks" in proc.stdout
