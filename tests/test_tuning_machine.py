"""Planning machines you don't have: catalog topologies through the cost model, checked against
published figures (../shared/reference/collectives.md §1.2 and §1.4), and the command."""

import subprocess
import sys

import pytest

from commlib.errors import CommArgumentError
from commlib.tuning.__main__ import busbw
from commlib.tuning.machine import plan_machine
from commlib.tuning.model import predict


def best(plan, collective, nbytes, algorithm=None):
    preds = predict(collective, nbytes, plan.ranks, plan.table)
    if algorithm is not None:
        preds = [x for x in preds if x.algorithm == algorithm]
    return preds[0]


def test_h100_node_ring_busbw_is_nccls_370():
    plan = plan_machine("hgx-h100-8")
    ring = best(plan, "all_reduce", 8 << 30, "ring")
    # nccl-tests#212: "NCCL can get an effective NVLink bandwidth of 370 GB/s" on 8 x H100
    assert busbw("all_reduce", 8 << 30, 8, ring.seconds) == pytest.approx(370, rel=0.03)


def test_a100_node_ring_busbw_is_about_230():
    plan = plan_machine("dgx-a100")
    ring = best(plan, "all_reduce", 8 << 30, "ring")
    # nccl-tests#149: ~230 GB/s all_reduce busbw on 8 x A100 (240 line rate after payload)
    assert busbw("all_reduce", 8 << 30, 8, ring.seconds) == pytest.approx(230, rel=0.06)


def test_small_message_ring_latency_matches_nccls_model():
    plan = plan_machine("hgx-h100-8")
    ring = best(plan, "all_reduce", 8, "ring")
    # NCCL's tuner: ring/LL on 8 GPUs = 6.6 + 14 x 0.6 = 15 us
    assert ring.seconds * 1e6 == pytest.approx(15.0, rel=0.05)


def test_three_a100_nodes_are_bound_by_their_nics():
    plan = plan_machine("dgx-a100", nodes=3, nics_per_host=4, nic_gbps=200)
    assert plan.ranks == 24 and plan.rails == 4
    t = best(plan, "all_reduce", 1 << 30)
    # nccl-tests#119: 3 nodes of A100 with 4 x HDR each reach 85-96 GB/s, 100 GB/s theoretical
    assert 80 <= busbw("all_reduce", 1 << 30, 24, t.seconds) <= 101


def test_hierarchical_wins_mid_sizes_across_nodes_and_flat_wins_on_one():
    many = plan_machine("hgx-h100-8", nodes=16, nics_per_host=8, nic_gbps=400)
    algos = {x.algorithm for x in predict("all_reduce", 1 << 20, many.ranks, many.table)}
    assert "hierarchical" in algos
    assert best(many, "all_reduce", 256 << 10).algorithm == "hierarchical"
    one = plan_machine("hgx-h100-8")
    assert "hierarchical" not in {x.algorithm for x in predict("all_reduce", 1 << 20, 8, one.table)}


def test_pcie_box_is_slower_than_nvlink():
    pcie, nvl = plan_machine("pcie-4xa10"), plan_machine("dgx1-v100")
    assert pcie.intra_class not in ("NVL", "NVB") and nvl.intra_class == "NVL"
    assert pcie.intra_gbps < nvl.intra_gbps


def test_bad_arguments():
    with pytest.raises(CommArgumentError, match="'nodes' = 0: must be a positive int"):
        plan_machine("dgx-a100", nodes=0)
    with pytest.raises(CommArgumentError, match="is not in the catalog"):
        plan_machine("no-such-system")


def test_command_prints_every_algorithm_and_the_best():
    proc = subprocess.run([sys.executable, "-m", "commlib.tuning", "--topology", "hgx-h100-8",
                           "--nodes", "16", "--nics-per-host", "8", "--nic-gbps", "400", "--op",
                           "all_reduce", "-b", "8", "-e", "1G", "-f", "1024"],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = proc.stdout.splitlines()
    assert "16 x hgx-h100-8: 128 GPUs" in lines[0]
    for name in ("ring", "rabenseifner", "recursive_doubling", "binomial", "hierarchical"):
        assert f"{name} us" in lines[2]
    sizes = [ln.split()[0] for ln in lines[3:]]
    assert sizes == ["8", "8K", "8M"]
    bad = subprocess.run([sys.executable, "-m", "commlib.tuning", "--topology", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "is not in the catalog" in bad.stderr
