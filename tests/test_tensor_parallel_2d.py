"""2D tensor parallelism (commlib.nn.Linear2D and the other 2D layers, split_2d / gather_2d): the
multi-rank cases of tests/mpi/tp2d_cases.py and tests/mpi/tp2d_layers.py in one mpiexec job per
world size (1, 2, 3, 4 and 6, so meshes 1x1, 1x2, 2x1, 1x3, 3x1, 1x4, 4x1, 2x2, 1x6, 6x1 and 2x3;
at 3 ranks under COMMLIB_DEBUG=1, whose call checks then run in every layer), each against the
dense torch modules. Every job has a hard timeout (a deadlock fails the test)."""

from __future__ import annotations

import pytest

from conftest import run_mpi

CASES = ["case_errors_2d", "case_linear_2d", "case_mlp_2d_composes", "case_split_gather_2d"]
LAYER_CASES = ["case_block_2d", "case_cross_entropy_2d", "case_embedding_2d",
               "case_layernorm_2d", "case_layers_2d_errors"]


@pytest.mark.timeout(320)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_tp2d_mpi(n):
    """One job per world size (tests/mpi/tp2d_layers.py, which runs tests/mpi/tp2d_cases.py's
    cases too). Linear2D's output, input gradient and weight/bias gradients (through to_dense())
    against nn.Linear for float64/float32/bfloat16 x overlap x bias x panel counts, the bytes
    each rank sends against SUMMA's closed form, composition without re-layout,
    split_2d/gather_2d and their gradients; LayerNorm2D (including data where E[x^2]-E[x]^2
    fails), Embedding2D, cross_entropy_2d and TransformerBlock2D against nn.LayerNorm /
    nn.Embedding / F.cross_entropy / the dense TransformerBlock: outputs, input gradients, every
    parameter gradient, bytes sent against the closed forms; typed errors on every rank."""
    debug = {"COMMLIB_DEBUG": "1"} if n == 3 else {}
    out = run_mpi(n, "tp2d_layers.py", *CASES, *LAYER_CASES, timeout=300, **debug).stdout
    for case in CASES + LAYER_CASES:
        assert f"ok {case} (world size {n})" in out, out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mesh", ["2x2", "1x4"])
def test_example_2d_lm_matches_dense(mesh):
    """examples/tp2d_lm.py on 4 ranks: the 2D model's loss equals the one-process dense model's
    at every step (float32, 1e-5 relative), and training lowers it."""
    import re
    import sys

    from conftest import ROOT, mpiexec_path, run_cmd

    script = str(ROOT / "examples" / "tp2d_lm.py")
    out = run_cmd([mpiexec_path(), "-n", "4", sys.executable, script, "--mesh", mesh],
                  timeout=140).stdout
    pairs = [(float(a), float(b)) for a, b in
             re.findall(r"step +\d+ +loss 2d (\S+) +dense (\S+)", out)]
    assert len(pairs) >= 5, out
    for two_d, dense in pairs:
        assert abs(two_d - dense) <= 1e-5 * abs(dense), (mesh, pairs)
    assert pairs[-1][1] < pairs[0][1], pairs
