"""commlib.compress's collectives on real ranks, against the exact result computed here from every
rank's input (each rank builds every rank's data from the same seed).

``COMPRESS_TEST_HOSTS=a,a,b,b`` puts rank k on virtual host ``a``/``b`` (COMMLIB_TEST_HOST, read
before commlib.init()), so that the hierarchical algorithm is eligible.
"""

from __future__ import annotations

import math
import os
import sys

_LAYOUT = os.environ.get("COMPRESS_TEST_HOSTS", "")
if _LAYOUT:
    os.environ["COMMLIB_TEST_HOST"] = _LAYOUT.split(",")[int(os.environ["PMI_RANK"])]

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _harness import expect_error, main  # noqa: E402

import commlib  # noqa: E402
import commlib.compress as cc  # noqa: E402
from commlib.nn.functional import traffic  # noqa: E402

CODECS = [cc.codec("int8"), cc.codec("int4"), cc.codec("fp8"), cc.codec("fp8", format="e5m2"),
          cc.codec("int8", block=3, scale_dtype=torch.float16), cc.codec("topk", ratio=0.3)]
SIZES = [1, 5, 256, 1000, 4099]


def data(r: int, n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + r)
    return (torch.randn(n, generator=g, dtype=torch.float64) * (r + 1)).to(dtype)


def world():
    return commlib.get_rank(), commlib.get_world_size()


def chunked_bound(c, x: torch.Tensor, p: int) -> torch.Tensor:
    """The codec's bound on ``x`` cut as the all-reduce cuts it: p chunks of ceil(n/p), each
    encoded on its own (its blocks start at the chunk)."""
    k = math.ceil(x.numel() / p)
    return torch.cat([c.bound(x[j * k:(j + 1) * k].float()).double() for j in range(p)])


def _exact_and_bound(c, n, p, dtype, seed, avg=False):
    """The exact sum, and the error allowed: every contribution's bound (each is encoded once,
    the owner's own chunk exactly) plus the reduced chunk's encode bound, summed."""
    xs = [data(r, n, dtype, seed) for r in range(p)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    bound = torch.stack([chunked_bound(c, x, p) for x in xs]).sum(0)
    bound = bound + chunked_bound(c, exact, p)  # the owner's encode of the sum
    if c.name == "topk":  # top-k of the sum can drop up to the whole sum's k-th value per chunk
        bound = bound + exact.abs().max()
    scale = p if avg else 1
    return xs, exact / scale, bound / scale + 1e-5 * (exact.abs() / scale + 1)


def case_all_reduce_against_exact():
    """Every codec x size x float dtype, algorithm "compressed": within the summed bounds; every
    rank holds the same bits."""
    rank, p = world()
    for seed, c in enumerate(CODECS):
        for n in SIZES:
            for dtype in (torch.float32, torch.bfloat16):
                xs, exact, bound = _exact_and_bound(c, n, p, dtype, seed)
                t = xs[rank].clone()
                cc.all_reduce(t, codec=c, algorithm="compressed")
                err = (t.double() - exact).abs()
                tol = bound + (0 if dtype == torch.float32 else exact.abs() * 2 ** -7)
                assert bool((err <= tol).all()), (c, n, dtype, float((err - tol).max()))
                every = torch.empty(p, n, dtype=dtype)
                commlib.all_gather_into_tensor(every, t)
                assert bool((every == every[0]).all()), (c, n, dtype, "ranks differ")


def case_wire_bytes_equal_the_formula():
    """Bytes counted per rank: 2 (p-1) nbytes(ceil(n/p)) for the flat algorithm."""
    rank, p = world()
    for c in CODECS[:3]:
        n = 10007
        t = data(rank, n)
        with traffic() as tr:
            cc.all_reduce(t, codec=c, algorithm="compressed")
        want = 2 * (p - 1) * c.nbytes(math.ceil(n / p)) if p > 1 else 0
        assert tr.by_kind.get("compress.wire", 0) == want, (c, tr.by_kind, want)
        assert cc.wire_bytes(n, p, c) == want


def case_avg_and_async():
    rank, p = world()
    c = cc.codec("int8")
    xs, exact, bound = _exact_and_bound(c, 3001, p, torch.float32, 7, avg=True)
    t = xs[rank].clone()
    w = cc.all_reduce(t, codec=c, op=commlib.ReduceOp.AVG, async_op=True, algorithm="compressed")
    w.wait()
    assert bool(((t.double() - exact).abs() <= bound).all())


def case_hierarchical():
    """On virtual hosts with equal ranks per host: compressed across hosts only, exact inside;
    the bound counts one contribution per host (the host's float32 sum) plus the encode."""
    rank, p = world()
    c = cc.codec("int8")
    hosts = _LAYOUT.split(",")
    if not _LAYOUT or len(set(hosts)) < 2:
        expect_error(lambda: cc.all_reduce(torch.ones(8), codec=c, algorithm="hierarchical"),
                     "algorithm", "Fix:")
        return
    n = 5003
    xs = [data(r, n, seed=3) for r in range(p)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    per_host = {}
    for r, h in enumerate(hosts):
        per_host[h] = per_host.get(h, 0) + xs[r].double()
    local = hosts.count(hosts[0])
    shard = math.ceil(n / local)
    nh = len(set(hosts))

    def cut(x):  # the shards of the host stage, each cut again by the flat stage across hosts
        return torch.cat([chunked_bound(c, x[i * shard:(i + 1) * shard], nh)
                          for i in range(local)])[:n]
    bound = sum(cut(s) for s in per_host.values()) + cut(exact)
    t = xs[rank].clone()
    with traffic() as tr:
        cc.all_reduce(t, codec=c, algorithm="hierarchical")
    assert bool(((t.double() - exact).abs() <= bound.double() + 1e-5 * (exact.abs() + 1)).all())
    assert tr.by_kind.get("compress.wire", 0) == 2 * (len(set(hosts)) - 1) * c.nbytes(
        math.ceil(shard / len(set(hosts))))


def case_error_feedback_tracks_the_sum():
    """With error feedback, the running sum of the compressed all-reduces stays within one
    step's error of the running exact sum (what error feedback is for), while without it the
    error of a biased codec (top-k) grows with the steps."""
    rank, p = world()
    c = cc.codec("topk", ratio=0.1)
    ef = cc.ErrorFeedback()
    n, steps = 400, 30
    total, exact = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    plain = torch.zeros(n, dtype=torch.float64)
    for s in range(steps):
        xs = [data(r, n, seed=100 + s) + 1.0 for r in range(p)]
        exact += torch.stack([x.double() for x in xs]).sum(0)
        t = xs[rank].clone()
        cc.all_reduce(t, codec=c, algorithm="compressed", error_feedback=ef)
        total += t.double()
        u = xs[rank].clone()
        cc.all_reduce(u, codec=c, algorithm="compressed")
        plain += u.double()
    if p > 1:
        err_ef = float((total - exact).abs().max())
        err_plain = float((plain - exact).abs().max())
        assert err_ef < err_plain / 2, (err_ef, err_plain)


def case_pieces():
    """reduce_scatter_tensor, all_gather_into_tensor and send/recv against their definitions."""
    rank, p = world()
    c = cc.codec("int8", block=64)
    m = 777
    xs = [data(r, p * m, seed=11) for r in range(p)]
    out = torch.empty(m)
    cc.reduce_scatter_tensor(out, xs[rank].clone(), codec=c)
    exact = torch.stack([x.double() for x in xs]).sum(0)[rank * m:(rank + 1) * m]
    bound = sum(c.bound(x[rank * m:(rank + 1) * m]).double() for r, x in enumerate(xs)
                if r != rank) + 1e-6
    assert bool(((out.double() - exact).abs() <= bound).all())
    mine = data(rank, m, seed=12)
    every = torch.empty(p * m)
    cc.all_gather_into_tensor(every, mine, codec=c)
    for r in range(p):
        x = data(r, m, seed=12)
        assert bool(((every[r * m:(r + 1) * m] - x).abs() <= c.bound(x)).all()), r
    if p > 1:
        x = data(0, 999, torch.bfloat16, seed=13)
        if rank == 0:
            cc.send(x, 1, codec="fp8")
        elif rank == 1:
            got = torch.empty(999, dtype=torch.bfloat16)
            cc.recv(got, 0, codec="fp8")
            want = cc.codec("fp8").decode(cc.codec("fp8").encode(x))
            assert torch.equal(got, want)


def case_auto_and_explain():
    """auto runs what explain ranks first; every rank agrees (same choice, same result)."""
    rank, p = world()
    c = cc.codec("int8")
    for n in (64, 1 << 20):
        exp = cc.explain(n, c)
        names = [r.algorithm for r in exp.rows]
        assert "uncompressed" in names and ("compressed" in names) == (p > 1), names
        assert exp.chosen == exp.rows[0].algorithm
        assert "compressed all_reduce" in str(exp)
        t = data(rank, n, seed=21)
        cc.all_reduce(t, codec=c)
        every = torch.empty(p, n)
        commlib.all_gather_into_tensor(every, t)
        assert bool((every == every[0]).all())
        if cc.explain(n, c).chosen == "uncompressed":  # exact: the plain all-reduce's result
            u = data(rank, n, seed=21)
            commlib.all_reduce(u)
            assert torch.equal(t, u)


def case_errors():
    rank, p = world()
    expect_error(lambda: cc.all_reduce(torch.ones(4, dtype=torch.int32), codec="int8"),
                 "tensor", "Fix:", kind=commlib.CommTypeError)
    expect_error(lambda: cc.all_reduce(torch.ones(4), codec="int8", op=commlib.ReduceOp.MAX),
                 "op", "Fix:")
    expect_error(lambda: cc.all_reduce(torch.ones(4), codec="int9"), "int8")
    expect_error(lambda: cc.all_reduce(torch.ones(4), codec="int8", algorithm="ring"),
                 "algorithm", "Fix:")
    expect_error(lambda: cc.all_reduce(torch.ones(4), codec="int8", error_feedback={}),
                 "error_feedback", kind=commlib.CommTypeError)
    expect_error(lambda: cc.reduce_scatter_tensor(torch.ones(3), torch.ones(3 * p + 1),
                                                  codec="int8"), "input", "Fix:")


if __name__ == "__main__":
    main(globals())
