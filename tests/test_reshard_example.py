"""examples/reshard_pipeline.py: two pipeline stages on meshes of different shapes joined by
``commlib.reshard(..., async_op=True)`` train to the same losses as the one-process dense model,
step by step, and the losses fall. At 3 ranks (stage 0 on 2 ranks, Shard(1) -> stage 1 on 1 rank)
and at 4 (2 -> 2, Shard(1) -> Shard(0) with uneven rows, and -> Replicate()). Every job has a hard
timeout (a deadlock fails the test)."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import ROOT, base_env, mpiexec_path, run_cmd

SCRIPT = str(ROOT / "examples" / "reshard_pipeline.py")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,stage1", [(3, "shard0"), (4, "shard0"), (4, "replicate")])
def test_reshard_pipeline_matches_dense(n, stage1):
    exe = mpiexec_path()
    if exe is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra (pip install mpich)")
    out = run_cmd([exe, "-n", str(n), sys.executable, SCRIPT, "--stage1", stage1],
                  timeout=140, env=base_env()).stdout
    pairs = [(float(a), float(b)) for a, b in
             re.findall(r"step +\d+ +loss pipeline (\S+) +dense (\S+)", out)]
    assert len(pairs) >= 5, out
    for pipe, dense in pairs:
        assert abs(pipe - dense) <= 1e-5 * abs(dense), (n, stage1, pairs)
    assert pairs[-1][1] < pairs[0][1] and pairs[-1][0] < pairs[0][0], pairs
    assert "max rel loss diff" in out, out
