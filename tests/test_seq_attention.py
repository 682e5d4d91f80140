"""Sequence-parallel attention (commlib.nn): the ring plan in this process, then the multi-rank
cases of tests/mpi/seq_attention.py on real ranks (mpiexec at world sizes 1-4, gloo through
torchrun at 2 and 3), and the example LM against its one-process run. Every spawned job has a
hard timeout (a deadlock fails the test)."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import ROOT, base_env, run_cmd, run_mpi

import torch

from commlib.nn._blocks import BLOCK_OPS, block_ops, merge_
from commlib.nn._plan import plan_ring
from commlib.nn._ring import _bounds, _tiles, ring_passes

CASES = ["case_default_segments", "case_errors", "case_float64", "case_low_precision",
         "case_module", "case_ring_matrix", "case_ring_odd_lengths", "case_shard_roundtrip", "case_ulysses"]


def _visible_pairs(plan, chunk=1):
    """Query-key pairs the plan computes: causal calls count their lower triangle."""
    total = 0
    for step in plan.steps:
        for c in step.calls:
            rows, cols = (c.q1 - c.q0) * chunk, (c.k1 - c.k0) * chunk
            total += rows * (rows + 1) // 2 if c.causal else rows * cols
    return total


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_zigzag_plan_balanced_and_exact(n):
    """Causal zigzag: every rank computes the same number of query-key pairs, and together they
    cover exactly the causal triangle (each pair once); the contiguous layout is unbalanced."""
    chunk = 6  # tokens per chunk
    s = 2 * n * chunk
    work = [_visible_pairs(plan_ring(r, n, True, "zigzag"), chunk) for r in range(n)]
    assert len(set(work)) == 1, work
    assert sum(work) == s * (s + 1) // 2
    for r in range(n):
        plan = plan_ring(r, n, True, "zigzag")
        assert len(plan.steps) == n and plan.kv_transfers == n - 1
        assert all(len(step.calls) == 1 for step in plan.steps), str(plan)  # one kernel call a step
        assert (plan.send_to, plan.recv_from) == ((r + 1) % n, (r - 1) % n)
    contiguous = [_visible_pairs(plan_ring(r, n, True, "contiguous"), 2 * chunk) for r in range(n)]
    assert sum(contiguous) == s * (s + 1) // 2
    if n > 1:
        assert contiguous[-1] > contiguous[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("finish_after", [0, 1, 3, 100])
def test_pieces_split_while_the_transfer_runs(finish_after):
    """Query rows are cut into equal pieces while the step's transfer is in flight (poll points
    between kernel calls), and the rest is one piece once it is done; the pieces tile the range,
    and a causal diagonal call's pieces tile its lower triangle exactly once."""
    polls = iter(range(10 ** 6))
    state = {"done": finish_after == 0}

    def done():
        return state["done"]

    got = []
    for a, b in _bounds(100, 2148, 8, done):
        got.append((a, b))
        state["done"] = next(polls) + 1 >= finish_after
    assert got[0][0] == 100 and got[-1][1] == 2148
    assert all(x[1] == y[0] and x[0] < x[1] for x, y in zip(got, got[1:]))
    assert len(got) == (1 if finish_after == 0 else min(finish_after + 1, 8))
    if 0 < finish_after < 7:
        assert all(b - a == 256 for a, b in got[:-1]) and got[-1][1] - got[-1][0] > 256

    capped = list(_bounds(0, 100, 2, lambda: True, cap=30))
    assert capped == [(0, 30), (30, 60), (60, 90), (90, 100)]


@pytest.mark.parametrize("segments", [1, 3, 4])
@pytest.mark.parametrize("cap", [None, 5])
def test_tiles_cover_each_visible_pair_once(segments, cap):
    """Every call of every step, cut into key segments (one ring pass each) and pieces of rows
    (poll points, and the backward's row cap), computes each visible (query, key) pair of the
    global causal mask exactly once; in the first segment's step 0 every row has exactly one
    piece marked first (the forward assigns there instead of merging)."""
    n, c = 3, 7
    sl = 2 * c
    for r in range(n):
        plan = plan_ring(r, n, True, "zigzag")
        seen = torch.zeros(n, sl, sl, dtype=torch.int64)  # [source rank, local query, local key]
        firsts = torch.zeros(sl, dtype=torch.int64)
        for _, _, spans in ring_passes(1, 1, c, 2, 1, segments):
            local_keys = torch.cat([torch.arange(s0, s1) for s0, s1 in spans])
            for step in plan.steps:
                state = {"polls": 0}
                for call in step.calls:
                    for first, rows, cols, causal in _tiles(call, c, spans, 3,
                                                            lambda s=state: s["polls"] > 1, cap):
                        state["polls"] += 1
                        assert cap is None or rows.stop - rows.start <= cap
                        keys = local_keys[cols]  # packed positions -> local tokens
                        assert bool((keys[1:] - keys[:-1] > 0).all())
                        if causal:  # a square of consecutive tokens on the diagonal
                            assert keys.tolist() == list(range(rows.start, rows.stop))
                        block = torch.ones(rows.stop - rows.start, len(keys), dtype=torch.int64)
                        seen[step.source, rows, keys] += block.tril() if causal else block
                        if step.index == 0 and spans[0][0] == 0 and first:
                            firsts[rows] += 1
        assert torch.equal(firsts, torch.ones_like(firsts))
        mine = _positions(r, n, c)
        for src in range(n):
            want = (_positions(src, n, c).view(1, -1) <= mine.view(-1, 1)).to(torch.int64)
            assert torch.equal(seen[src], want), (r, src)


def _positions(rank, n, c):
    """Global token positions of a rank's zigzag chunks (r and 2N-1-r of 2N), written out here."""
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)])


def test_default_seq_chunks():
    """Key segments by default: none on one rank or below 1536 tokens per chunk (segments of at
    least 768), then up to 32 passes in all (head groups x segments)."""
    from commlib.nn.functional import default_seq_chunks

    assert default_seq_chunks(8, 4096, 1) == 1
    assert default_seq_chunks(8, 1535, 2) == 1
    assert default_seq_chunks(8, 1536, 2) == 2
    assert default_seq_chunks(8, 4096, 4) == 4  # 8 heads x 4 = 32 passes
    assert default_seq_chunks(1, 4096, 4) == 5  # 768-token segments first
    assert default_seq_chunks(1, 65536, 4) == 32
    assert default_seq_chunks(64, 65536, 8) == 1


def test_plan_is_printable():
    text = str(plan_ring(1, 3, True, "zigzag"))
    assert "step 0: block of rank 1: q[0:2]xk[0:2] causal" in text
    assert "step 1: block of rank 0: q[0:2]xk[0:1]" in text
    assert "step 2: block of rank 2: q[1:2]xk[0:2]" in text


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_seq_attention_mpi(n):
    """out, lse, dq, dk, dv vs SDPA on the full sequence, message counts, errors, module, on mpi.
    At 3 ranks the whole set runs under COMMLIB_DEBUG=1, plus the rank-disagreement case."""
    debug = n == 3
    cases = CASES + ["case_debug_mismatch"] if debug else CASES
    out = run_mpi(n, "seq_attention.py", *cases, timeout=140,
                  **({"COMMLIB_DEBUG": "1"} if debug else {})).stdout
    for case in cases:
        assert f"ok {case} (world size {n})" in out, out


@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent on this machine: the "
                    "cuda block kernels (torch's memory-efficient SDPA) need a GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_blocks_match_math(causal):
    """The cuda block kernels (out, lse, dq, dk, dv; GQA 4:1) equal the math definition, and two
    key halves merged with merge_ equal the whole block, on the GPU."""
    g = torch.Generator().manual_seed(3)
    b, h, hk, s, d = 2, 8, 2, 48, 16
    q, do = (torch.randn(b, h, s, d, generator=g).cuda() for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, generator=g).cuda() for _ in range(2))
    cuda, math = BLOCK_OPS["cuda"], BLOCK_OPS["math"]
    assert block_ops(q.device, torch.float32) is cuda
    out, lse = cuda.forward(q, k, v, causal, 0.25)
    ref_out, ref_lse = math.forward(q, k, v, causal, 0.25)
    for got, want in zip((out, lse, *cuda.backward(do, q, k, v, out, lse, causal, 0.25)),
                         (ref_out, ref_lse, *math.backward(do, q, k, v, ref_out, ref_lse, causal,
                                                           0.25))):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6
    if not causal:  # blockwise: the first key half, then merge the second
        o1, l1 = cuda.forward(q, k[:, :, :24], v[:, :, :24], False, 0.25)
        o2, l2 = cuda.forward(q, k[:, :, 24:], v[:, :, 24:], False, 0.25)
        o1 = o1.float()
        merge_(o1, l1, o2, l2)
        assert (o1 - ref_out).abs().max().item() <= 1e-5 * ref_out.abs().max().item()
        assert (l1 - ref_lse).abs().max().item() <= 1e-5 * ref_lse.abs().max().item()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3])
def test_seq_attention_gloo(n):
    """The same cases over torch.distributed gloo (torchrun launch)."""
    env = base_env(GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    cases = ["case_ring_matrix", "case_ulysses", "case_shard_roundtrip", "case_module"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           str(ROOT / "tests" / "mpi" / "seq_attention.py"), *cases]
    out = run_cmd(cmd, timeout=140, env=env).stdout
    for case in cases:
        assert f"ok {case} (world size {n})" in out, out


def _losses(text):
    return [float(x) for x in re.findall(r"step \d+ loss (\S+)", text)]


@pytest.mark.timeout(150)
def test_example_lm_matches_one_process():
    """examples/seq_parallel_lm.py: sequence-parallel training on 2 and 3 mpi ranks gives the
    one-process losses step for step."""
    script = str(ROOT / "examples" / "seq_parallel_lm.py")
    args = ["--steps", "6"]
    ref = _losses(run_cmd([sys.executable, script, *args, "--reference"], timeout=60).stdout)
    assert len(ref) == 6 and ref[-1] < ref[0]
    for n in (2, 3):
        from conftest import mpiexec_path

        got = _losses(run_cmd([mpiexec_path(), "-n", str(n), sys.executable, script, *args],
                              timeout=60).stdout)
        assert len(got) == 6
        for i, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) <= 1e-5 * abs(b), (n, i, got, ref)
