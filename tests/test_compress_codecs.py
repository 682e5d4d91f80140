"""The codecs of commlib.compress, in one process: wire bytes of hand-computed examples, round trips
within the codec's own bound and within a closed form written here, sizes, non-finite blocks,
stochastic rounding, decode into out/accumulate, error feedback, and every argument check."""

import math
import struct
import sys

import pytest
import torch

import commlib.compress as cc
from commlib import config
from commlib.compress import _fast
from commlib.errors import CommArgumentError, CommConfigError, CommTypeError

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
SCALES = [torch.float32, torch.float16]
# (name, options, QMAX, code rounding |code - y| <= R_REL*|y| + R_ABS), written out here
BLOCK_CODECS = [
    ("int8", {}, 127.0, 0.0, 0.5),
    ("int4", {}, 7.0, 0.0, 0.5),
    ("fp8", {"format": "e4m3"}, 448.0, 2.0 ** -4, 2.0 ** -10),
    ("fp8", {"format": "e5m2"}, 57344.0, 2.0 ** -3, 2.0 ** -17),
]
IDS = ["int8", "int4", "e4m3", "e5m2"]
SIZES = [0, 1, 2, 255, 256, 257, 1001]


def le(fmt, *values):
    """Little-endian bytes of values, as a list of ints."""
    return list(struct.pack("<" + fmt * len(values), *values))


def wire(x, name, **opts):
    return cc.codec(name, **opts).encode(torch.tensor(x, dtype=torch.float32)).data.tolist()


class raises:
    """``pytest.raises`` that also checks the message names the argument and says a fix."""

    def __init__(self, exc, arg, *fragments):
        self.ctx, self.fragments = pytest.raises(exc), (f"argument '{arg}'", "Fix:", *fragments)

    def __enter__(self):
        self.info = self.ctx.__enter__()
        return self.info

    def __exit__(self, *exc_info):
        handled = self.ctx.__exit__(*exc_info)
        for fragment in self.fragments:
            assert fragment in str(self.info.value), f"{fragment!r} not in {self.info.value}"
        return handled


# --- wire bytes of hand-computed examples ---------------------------------------------------------

def test_int8_bytes():
    # a = 127 -> s = 1; -0.5 -> -0 -> 0, 2.5 -> 2, -1.5 -> -2, 3.5 -> 4 (half to even)
    x = [1.0, -0.5, 0.25, 127.0, 2.5, -1.5, 3.5, -127.0]
    payload = [1, 0, 0, 127, 2, 0xFE, 4, 0x81]
    assert wire(x, "int8", block=8) == le("f", 1.0) + payload
    assert wire(x, "int8", block=None, scale_dtype=torch.float16) == [0x00, 0x3C] + payload
    # two blocks: (127, -63.5) with s = 1, (0.5, -254) with s = 2; -63.5 -> -64 (even)
    assert wire([127.0, -63.5, 0.5, -254.0], "int8", block=2) == le("f", 1.0, 2.0) + [127, 0xC0, 0, 0x81]
    # a tail block: block 2 of [254, -1, 3] holds one value; -1/2 -> -0 -> 0
    assert wire([254.0, -1.0, 3.0], "int8", block=2) == le("f", 2.0, 3 / 127) + [127, 0, 127]


def test_int4_bytes():
    # a = 7 -> s = 1; codes 7, -7, 1, 0, 4 -> nibbles 15, 1, 9, 8, 12; element 2i low, 2i+1 high
    x = [7.0, -7.0, 1.0, -0.5, 3.5]
    assert wire(x, "int4", block=None) == le("f", 1.0) + [0x1F, 0x89, 0x8C]  # odd n: high nibble 8
    assert wire(x[:4], "int4", block=None) == le("f", 1.0) + [0x1F, 0x89]
    # blocks of 2: (7, -3.5) with s = 1 -> 7, -4; (14) with s = 2 -> 7
    assert wire([7.0, -3.5, 14.0], "int4", block=2) == le("f", 1.0, 2.0) + [0x4F, 0x8F]


def test_fp8_bytes():
    # e4m3fn, s = 448/448 = 1: 448 = 1.75*2^8 -> 0x7e, 1 -> 0x38, -2 -> 0xc0, -0 -> 0x80,
    # 2^-9 (smallest subnormal) -> 0x01, 2^-10 (tie) -> 0, 3*2^-10 (tie) -> 2*2^-9 = 0x02,
    # 1.0625 (tie) -> 1.0 = 0x38, 1.1875 (tie) -> 1.25 = 0x3a, 500/448*448 clamps -> 0x7e
    x = [448.0, 1.0, -2.0, -0.0, 2 ** -9, 2 ** -10, 3 * 2 ** -10, 1.0625, 1.1875]
    assert wire(x, "fp8", block=None) == le("f", 1.0) + [0x7E, 0x38, 0xC0, 0x80, 0x01, 0x00, 0x02, 0x38, 0x3A]
    # e5m2, s = 1: 57344 = 1.75*2^15 -> 0x7b, 1 -> 0x3c, -2 -> 0xc0, 2^-16 -> 0x01,
    # 1.125 (tie) -> 1.0 = 0x3c, 1.375 (tie) -> 1.5 = 0x3e
    x = [57344.0, 1.0, -2.0, 0.0, 2 ** -16, 1.125, 1.375]
    assert wire(x, "fp8", format="e5m2", block=None) == le("f", 1.0) + [0x7B, 0x3C, 0xC0, 0, 0x01, 0x3C, 0x3E]
    # float16 scales: 896/448 = 2 -> 0x4000
    assert wire([896.0, -2.0], "fp8", block=None, scale_dtype=torch.float16) == [0x00, 0x40, 0x7E, 0xB8]


def _fp8_values(fmt):
    """Every finite non-negative fp8 value by bit pattern, from the format's definition."""
    ebits, mbits, bias = (4, 3, 7) if fmt == "e4m3" else (5, 2, 15)
    values = {}
    for code in range(128):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if fmt == "e4m3" and code == 0x7F or fmt == "e5m2" and e == (1 << ebits) - 1:
            continue  # NaN / inf
        values[code] = (m * 2.0 ** (1 - bias - mbits) if e == 0 else (1 + m / 2 ** mbits) * 2.0 ** (e - bias))
    return values


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_rounding_matches_the_format(fmt):
    """Nearest fp8 value, ties to the even pattern, at every value, midpoint and random points."""
    values = _fp8_values(fmt)
    grid = sorted(values.values())
    fmax = grid[-1]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    g = torch.Generator().manual_seed(1)
    rand = (torch.rand(2000, generator=g, dtype=torch.float64) * fmax).tolist()
    ys = [v for v in grid + mids + rand if v == float(torch.tensor(v, dtype=torch.float32))]
    x = torch.tensor([fmax] + ys + [-y for y in ys], dtype=torch.float32)  # s = 1
    got = cc.codec("fp8", format=fmt, block=None).encode(x).data[4:].tolist()
    for y, code in zip(ys, got[1:1 + len(ys)]):
        best = min(values.values(), key=lambda v: abs(v - y))
        ties = [c for c, v in values.items() if abs(v - y) == abs(best - y)]
        assert code == min(ties, key=lambda c: c % 2), (y, code, ties)
    assert [c ^ 0x80 for c in got[1 + len(ys):]] == got[1:1 + len(ys)]  # sign bit


def test_topk_bytes():
    # ratio 0.5 of 5 -> k = 3: |-3|, |2|, |1| at indices 1, 3, 2 -> ascending 1, 2, 3
    x = [0.5, -3.0, 1.0, 2.0, -0.25]
    idx = le("i", 1, 2, 3)
    assert wire(x, "topk", ratio=0.5) == idx + le("f", -3.0, 1.0, 2.0)
    p = cc.codec("topk", ratio=0.5).encode(torch.tensor(x, dtype=torch.bfloat16))
    assert p.data.tolist() == idx + [0x40, 0xC0, 0x80, 0x3F, 0x00, 0x40]  # bfloat16 -3, 1, 2
    # NaN ranks above inf, inf above every number
    assert wire([1.0, math.nan, -math.inf, 5.0, math.inf, 2.0], "topk", ratio=0.5)[:12] == le("i", 1, 2, 4)


def test_nbytes_by_hand():
    assert cc.codec("int8").nbytes(1000) == 4 * 4 + 1000
    assert cc.codec("int8", scale_dtype=torch.float16).nbytes(1000) == 4 * 2 + 1000
    assert cc.codec("int8", block=None).nbytes(1000) == 4 + 1000
    assert cc.codec("int4").nbytes(1001) == 16 * 4 + 501
    assert cc.codec("int4", block=None, scale_dtype=torch.float16).nbytes(7) == 2 + 4
    assert cc.codec("fp8").nbytes(257, torch.bfloat16) == 2 * 4 + 257
    for name in ("int8", "int4", "fp8", "topk"):
        assert cc.codec(name).nbytes(0) == 0
        assert cc.codec(name, **({} if name == "topk" else {"block": None})).nbytes(0) == 0
    topk = cc.codec("topk")
    assert topk.nbytes(1000) == 10 * 8 and topk.nbytes(1000, torch.bfloat16) == 10 * 6
    assert topk.nbytes(1) == 8 and cc.codec("topk", ratio=1).nbytes(7, torch.float16) == 7 * 6
    assert cc.codec("topk", ratio=0.07).nbytes(100) == 8 * 8  # ceil(0.07 * 100 = 7.000000000000001)


# --- round trips ----------------------------------------------------------------------------------

def closed_form(x, block, qmax, r_rel, r_abs, dtype):
    """An error bound from the format alone: int codes err by half a scale, fp8 codes by half an
    ulp; 1% slack covers the float32 scale and arithmetic. For scales that are normal numbers."""
    ax = x.double().abs().view(-1)
    n = ax.numel()
    b = max(n, 1) if block is None else block
    padded = torch.cat([ax, ax.new_zeros(-n % b)]).view(-1, b)
    s = torch.repeat_interleave(padded.amax(dim=1) / qmax, b)[:n]
    e = 0.51 * s if r_rel == 0 else 1.01 * (r_rel * ax + 1.01 * r_abs * s)
    if dtype == torch.bfloat16:
        e = e + 1.01 * 2.0 ** -8 * (ax + e) + 2.0 ** -133
    elif dtype == torch.float16:
        e = e + 1.01 * 2.0 ** -11 * (ax + e) + 2.0 ** -24
    return e.view(x.shape)


def sample(n, qmax, dtype, seed):
    """Values of magnitude qmax/32 .. qmax/2, random signs: every block's scale is a normal
    number in float16 too."""
    g = torch.Generator().manual_seed(seed)
    mag = (0.25 + 3.75 * torch.rand(n, generator=g)) * qmax / 8
    return torch.where(torch.rand(n, generator=g) < 0.5, -mag, mag).to(dtype)


@pytest.mark.parametrize("name,opts,qmax,r_rel,r_abs", BLOCK_CODECS, ids=IDS)
@pytest.mark.parametrize("scale_dtype", SCALES, ids=["s32", "s16"])
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "bf16", "f16"])
def test_round_trip_within_bounds(name, opts, qmax, r_rel, r_abs, scale_dtype, dtype):
    for block in (None, 7, cc.codec(name, **opts).options["block"]):
        c = cc.codec(name, block=block, scale_dtype=scale_dtype, **opts)
        for n in SIZES:
            x = sample(n, qmax, dtype, seed=n).view(-1, 1) if n % 2 else sample(n, qmax, dtype, seed=n)
            p = c.encode(x)
            assert p.data.dtype == torch.uint8 and p.data.numel() == c.nbytes(n, dtype) == p.nbytes
            assert p.shape == x.shape and p.dtype == dtype and p.codec == c
            y = c.decode(p)
            assert y.shape == x.shape and y.dtype == dtype
            err = (y.double() - x.double()).abs()
            bound = c.bound(x)
            assert bound.dtype == torch.float32 and bound.shape == x.shape
            assert bool((err <= bound).all()), (c, n, (err - bound).max())
            assert bool((bound <= closed_form(x, block, qmax, r_rel, r_abs, dtype)).all()), (c, n)


@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "bf16", "f16"])
def test_topk_round_trip(dtype):
    g = torch.Generator().manual_seed(2)
    for ratio in (0.01, 0.3, 1.0):
        c = cc.codec("topk", ratio=ratio)
        for n in SIZES:
            x = torch.randn(n, generator=g).to(dtype)
            p = c.encode(x)
            k = 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))
            assert p.data.numel() == c.nbytes(n, dtype) == k * (4 + x.element_size())
            y = c.decode(p)
            assert y.dtype == dtype
            kept = y != 0
            assert int(kept.sum()) <= k and torch.equal(y[kept], x[kept])  # kept values exact
            kth = x.float().abs().sort(descending=True).values[k - 1] if k else 0.0
            err = (y.float() - x.float()).abs()
            assert bool((err <= kth).all()) and bool((err <= c.bound(x)).all())


def test_a_million_values():
    x = torch.randn(1000003, generator=torch.Generator().manual_seed(3))
    c = cc.codec("int8")
    p = c.encode(x)
    assert p.nbytes == c.nbytes(x.numel()) == 3907 * 4 + 1000003
    err = (c.decode(p) - x).abs()
    assert bool((err <= c.bound(x)).all())
    assert bool((err <= closed_form(x, 256, 127.0, 0.0, 0.5, torch.float32)).all())


@pytest.mark.parametrize("name,opts,qmax,r_rel,r_abs", BLOCK_CODECS, ids=IDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "bf16", "f16"])
def test_bound_holds_across_magnitudes(name, opts, qmax, r_rel, r_abs, dtype):
    """Blocks of every magnitude the dtype holds, including those whose scale is subnormal or
    underflows in float16, and the largest finite values (whose decode may overflow: bound inf)."""
    g = torch.Generator().manual_seed(4)
    info = torch.finfo(dtype)
    lo, hi = math.log10(info.tiny) - 2, math.log10(info.max)
    mag = 10 ** (lo + (hi - lo) * torch.rand(300, 1, generator=g, dtype=torch.float64))
    x = (torch.randn(300, 16, generator=g, dtype=torch.float64) * mag).clamp(-info.max, info.max)
    x[0], x[1, 3] = info.max, -info.max
    x = x.to(dtype)
    for scale_dtype in SCALES:
        c = cc.codec(name, block=16, scale_dtype=scale_dtype, **opts)
        y = c.decode(c.encode(x)).double()
        err = (y - x.double()).abs()
        bound = c.bound(x).double()
        finite = torch.isfinite(bound)
        assert bool((err[finite] <= bound[finite]).all()), (c, (err - bound)[finite].max())
        assert bool(y[bound.isnan()].isnan().all())  # float16 scale overflow: NaN, and said so
        assert float(bound.isinf().double().mean()) < 0.05  # inf only near the dtype's largest values


# --- non-finite values and float16 scales ---------------------------------------------------------

@pytest.mark.parametrize("name,opts,qmax,r_rel,r_abs", BLOCK_CODECS, ids=IDS)
@pytest.mark.parametrize("scale_dtype", SCALES, ids=["s32", "s16"])
def test_non_finite_block_decodes_nan(name, opts, qmax, r_rel, r_abs, scale_dtype):
    c = cc.codec(name, block=4, scale_dtype=scale_dtype, **opts)
    x = torch.tensor([1.0, 2.0, math.inf, 3.0, 1.0, 2.0, 3.0, 4.0, math.nan, 1.0, -2.0, 3.0])
    p = c.encode(x)
    nan_bytes = le("f", math.nan) if scale_dtype == torch.float32 else [0x00, 0x7E]
    ss = len(nan_bytes)
    assert p.data[:ss].tolist() == nan_bytes and p.data[2 * ss:3 * ss].tolist() == nan_bytes
    zero = 0x88 if name == "int4" else 0  # the zero codes
    payload = p.data[3 * ss:].tolist()
    if name == "int4":
        assert payload[0:2] == [zero, zero] and payload[4:6] == [zero, zero]
    else:
        assert payload[0:4] == [zero] * 4 and payload[8:12] == [zero] * 4
    y = c.decode(p)
    assert bool(y[:4].isnan().all()) and bool(y[8:].isnan().all())
    assert bool(((y[4:8] - x[4:8]).abs() <= c.bound(x)[4:8]).all())
    assert bool(c.bound(x)[:4].isnan().all()) and bool(c.bound(x)[8:].isnan().all())


@pytest.mark.parametrize("name,opts,qmax,r_rel,r_abs", BLOCK_CODECS, ids=IDS)
def test_float16_scale_overflow_and_underflow(name, opts, qmax, r_rel, r_abs):
    c = cc.codec(name, block=2, scale_dtype=torch.float16, **opts)
    # block 0: absmax/qmax = 1e6 overflows float16 -> NaN scale; block 1: ordinary;
    # block 2: absmax/qmax = 2^-26 underflows to 0 -> zero codes, decodes 0 (error |x| <= qmax*2^-25)
    x = torch.tensor([1e6 * qmax, 1.0, qmax / 2, -1.0, qmax * 2 ** -26, -qmax * 2 ** -27])
    p = c.encode(x)
    assert p.data[:6].tolist() == [0x00, 0x7E, 0x00, 0x38, 0x00, 0x00]  # NaN, 0.5, 0
    y = c.decode(p)
    assert bool(y[:2].isnan().all()) and y[2:4].tolist() == [qmax / 2, -1.0]
    assert y[4:].tolist() == [0.0, 0.0] and not bool(y[4:].signbit().any())
    bound = c.bound(x)
    assert bool(bound[:2].isnan().all()) and torch.equal(bound[4:], x[4:].abs())


# --- stochastic rounding --------------------------------------------------------------------------

@pytest.mark.parametrize("name,qmax", [("int8", 127.0), ("int4", 7.0)])
def test_stochastic_rounding(name, qmax):
    c = cc.codec(name, block=None, stochastic=True)
    n = 200_001
    x = torch.full((n,), 0.375)
    x[0] = qmax  # s = 1: every other value lies between the codes 0 and 1
    a = c.encode(x, generator=torch.Generator().manual_seed(5))
    b = c.encode(x, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.data, b.data)  # deterministic with a seeded generator
    assert not torch.equal(a.data, c.encode(x, generator=torch.Generator().manual_seed(6)).data)
    y = c.decode(a)[1:].double()
    u = torch.rand(n, generator=torch.Generator().manual_seed(5))[1:]
    assert torch.equal(y, (u >= 0.625).double())  # floor(0.375 + u), u drawn for all n in order
    sigma = math.sqrt(0.375 * 0.625 / (n - 1))
    assert abs(float(y.mean()) - 0.375) < 5 * sigma  # unbiased
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64 * 150, generator=g)
    c = cc.codec(name, block=64, stochastic=True)
    err = (c.decode(c.encode(x, generator=g)) - x).abs()
    s_q = torch.repeat_interleave(x.abs().view(-1, 64).amax(dim=1) / qmax, 64)
    assert bool((err < s_q * (1 + 2 ** -20) + 2 ** -22 * x.abs()).all())  # less than one step


# --- decode into out, accumulate, encode into a slice ---------------------------------------------

@pytest.mark.parametrize("name,opts", [("int8", {}), ("int4", {"block": 5}), ("fp8", {}), ("topk", {"ratio": 0.2})])
def test_decode_out_and_accumulate(name, opts):
    g = torch.Generator().manual_seed(8)
    c = cc.codec(name, **opts)
    x = torch.randn(3, 37, generator=g).to(torch.bfloat16)
    p = c.encode(x)
    exact = c.decode(p, out=torch.empty(111))  # float32 out: no rounding to bfloat16
    assert exact.shape == (111,) and torch.equal(exact.to(torch.bfloat16).view(3, 37), c.decode(p))
    base = torch.randn(3, 37, generator=g)
    out = base.clone()
    assert c.decode(p, out=out, accumulate=True) is out
    assert torch.equal(out, base + exact.view(3, 37))
    base16 = torch.randn(111, generator=g).half()
    out16 = base16.clone()
    c.decode(p, out=out16, accumulate=True)
    assert torch.equal(out16, (base16.float() + exact).half())  # one float32 add, one rounding


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "topk"])
def test_encode_into_a_slice_of_a_buffer(name):
    c = cc.codec(name, **({"block": 10} if name != "topk" else {"ratio": 0.3}))
    x = torch.randn(41, generator=torch.Generator().manual_seed(9))
    fresh = c.encode(x).data
    buf = torch.full((fresh.numel() + 4,), 0xAA, dtype=torch.uint8)
    p = c.encode(x, out=buf[1:1 + fresh.numel()])  # an odd offset: scales/indices unaligned
    assert p.data.data_ptr() == buf.data_ptr() + 1 and torch.equal(buf[1:-3], fresh)
    assert buf[0] == 0xAA and buf[-3:].tolist() == [0xAA] * 3
    assert torch.equal(c.decode(c.packed(buf[1:-3], (41,), torch.float32)), c.decode(c.encode(x)))


def test_non_contiguous_input():
    x = torch.randn(20, 30, generator=torch.Generator().manual_seed(10)).t()
    for name in ("int8", "topk"):
        c = cc.codec(name)
        assert torch.equal(c.encode(x).data, c.encode(x.contiguous()).data)
        assert c.decode(c.encode(x)).shape == (30, 20)


# --- error feedback -------------------------------------------------------------------------------

@pytest.mark.parametrize("name,opts,dtype", [("int8", {"block": None}, torch.float32),
                                             ("int4", {}, torch.bfloat16),
                                             ("topk", {"ratio": 0.1}, torch.bfloat16)])
def test_error_feedback_tracks_the_running_sum(name, opts, dtype):
    g = torch.Generator().manual_seed(11)
    c = cc.codec(name, **opts)
    ef = cc.ErrorFeedback()
    steps, n = 100, 64
    sum_x = torch.zeros(n, dtype=torch.float64)
    sum_y = torch.zeros(n, dtype=torch.float64)
    worst = torch.zeros(n, dtype=torch.float64)
    plain = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        x = (torch.randn(n, generator=g) * 0.01 + 0.05).to(dtype)
        x[0] = 10.0  # a large value that makes the small ones round to zero without feedback
        e = ef.residual("w")
        y = x.float() + (e if e is not None else 0)
        p = ef.encode(c, x, key="w")
        assert p.dtype == dtype and p.shape == x.shape
        decoded = c.decode(p, out=torch.empty(n))
        assert torch.equal(ef.residual("w"), y - decoded)  # the residual is what was not sent
        sum_x += x.double()
        sum_y += decoded.double()
        plain += c.decode(c.encode(x), out=torch.empty(n)).double()
        sent = y.to(dtype) if c.dtype_in_wire else y  # topk sends x's dtype: its rounding stays behind
        worst = torch.maximum(worst, c.bound(sent).double() + (y - sent.float()).abs().double())
    drift = (sum_x - sum_y).abs()
    assert bool((drift <= worst + steps * 2 ** -20 * sum_x.abs()).all())  # one step's bound
    assert float((sum_x - plain)[1:].abs().max()) > 2 * float(worst[1:].max())  # without: it adds up


def test_error_feedback_keys():
    ef = cc.ErrorFeedback()
    ef.encode("int8", torch.ones(10), key="a")
    ef.encode("int8", torch.ones(4), key="b")
    with raises(CommArgumentError, "key", "'a'", "reset"):
        ef.encode("int8", torch.ones(11), key="a")
    ef.reset("a")
    ef.encode("int8", torch.ones(11), key="a")
    assert ef.residual("a").shape == (11,) and ef.residual("b") is not None
    ef.reset()
    assert ef.residual("a") is None and ef.residual("b") is None
    with raises(CommTypeError, "x"):
        ef.encode("int8", torch.ones(3, dtype=torch.int32))


# --- identity, registry, the C fast path ----------------------------------------------------------

def test_codec_identity_and_repr():
    a, b = cc.codec("int8"), cc.codec("int8", block=256, scale_dtype=torch.float32)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != cc.codec("int8", block=128) and a != cc.codec("int4")
    assert repr(a) == "codec('int8', block=256, scale_dtype=torch.float32)"
    assert repr(cc.codec("int4", stochastic=True)) == (
        "codec('int4', block=64, scale_dtype=torch.float32, stochastic=True)")
    assert repr(cc.codec("fp8", format="e5m2", block=None)) == (
        "codec('fp8', format='e5m2', block=None, scale_dtype=torch.float32)")
    assert repr(cc.codec("topk")) == "codec('topk', ratio=0.01)"
    assert cc.as_codec("int8") == a and cc.as_codec(a) is a
    assert cc.names() == ["fp8", "int4", "int8", "topk"]
    assert all(cc.codec(n).lossy for n in cc.names())


def test_register_a_codec(monkeypatch):
    module = sys.modules["commlib.compress.codec"]  # the package's 'codec' is the function
    monkeypatch.setattr(module, "_REGISTRY", dict(module._REGISTRY))  # restored afterwards

    class Mine(type(cc.codec("int8"))):
        pass

    assert cc.register("mine", Mine) is Mine and "mine" in cc.names()
    mine = cc.codec("mine", block=4)
    assert mine.key == ("mine", ("block", 4), ("scale_dtype", torch.float32), ("stochastic", False))
    assert mine != cc.codec("int8", block=4) and cc.codec("int8").name == "int8"
    with raises(CommTypeError, "cls"):
        cc.register("bad", int)
    with raises(CommTypeError, "name"):
        cc.register("", Mine)


@pytest.fixture
def fast(monkeypatch):
    """A stand-in C path that records its calls, with COMMLIB_COMPRESS_IMPL in the option table."""
    calls = []
    monkeypatch.delenv("COMMLIB_COMPRESS_IMPL", raising=False)
    monkeypatch.setitem(config.OPTIONS, "compress_impl", config.Option("compress_impl", "auto", str, "test"))
    monkeypatch.setattr(_fast, "available", lambda: True, raising=False)
    monkeypatch.setattr(_fast, "encode", lambda *a: calls.append(("encode", *a)), raising=False)
    monkeypatch.setattr(_fast, "decode", lambda *a: calls.append(("decode", *a)), raising=False)
    return calls


def test_fast_path_contract(fast, monkeypatch):
    x = torch.randn(8, 5).t()  # non-contiguous: the C path gets a contiguous flat copy
    c = cc.codec("fp8", format="e5m2", block=None, scale_dtype=torch.float16)
    p = c.encode(x)
    kind, flat, out, block, scale_dtype = fast[0][1:]
    assert (kind, block, scale_dtype) == ("e5m2", 40, torch.float16) and out is p.data
    assert flat.is_contiguous() and flat.shape == (40,) and torch.equal(flat, x.reshape(-1))
    out = torch.empty(5, 8, dtype=torch.float16)
    c.decode(p, out=out, accumulate=True)
    assert fast[1][1] == "e5m2" and fast[1][2] is p.data and fast[1][4:] == (40, torch.float16, True)
    assert fast[1][3].data_ptr() == out.data_ptr() and fast[1][3].shape == (40,)
    cc.codec("int4").encode(torch.ones(3))
    assert fast[2][1] == "int4" and fast[2][4] == 64
    cc.codec("int8", stochastic=True).encode(torch.ones(3))  # stochastic: torch only
    cc.codec("topk").encode(torch.ones(3))  # topk: torch only
    monkeypatch.setenv("COMMLIB_COMPRESS_IMPL", "torch")
    cc.codec("int8").encode(torch.ones(3))
    assert len(fast) == 3
    monkeypatch.setenv("COMMLIB_COMPRESS_IMPL", "c")
    monkeypatch.setattr(_fast, "available", lambda: False)
    with pytest.raises(CommConfigError, match="Fix:"):
        cc.codec("int8").encode(torch.ones(3))


# --- argument checks ------------------------------------------------------------------------------

def test_option_errors():
    with raises(CommArgumentError, "name", "did you mean 'int8'", "['fp8', 'int4', 'int8', 'topk']"):
        cc.codec("int9")
    with raises(CommTypeError, "name"):
        cc.codec(8)
    with raises(CommArgumentError, "blok", "did you mean 'block'"):
        cc.codec("int8", blok=4)
    for bad in (0, -1, 1.5, True, "256"):
        with raises(CommArgumentError, "block", repr(bad)):
            cc.codec("int4", block=bad)
    with raises(CommArgumentError, "scale_dtype", "torch.bfloat16"):
        cc.codec("int8", scale_dtype=torch.bfloat16)
    with raises(CommArgumentError, "stochastic"):
        cc.codec("int8", stochastic=1)
    with raises(CommArgumentError, "format", "'e4m2'", "e5m2"):
        cc.codec("fp8", format="e4m2")
    with raises(CommArgumentError, "stochastic", "no stochastic rounding"):
        cc.codec("fp8", stochastic=True)
    for bad in (0, 1.5, -0.1, math.nan, True):
        with raises(CommArgumentError, "ratio"):
            cc.codec("topk", ratio=bad)
    with raises(CommTypeError, "codec"):
        cc.as_codec(3)


def test_call_errors():
    c = cc.codec("int8")
    x = torch.randn(300)
    with raises(CommTypeError, "x", "torch.int32", ".float()"):
        c.encode(torch.ones(3, dtype=torch.int32))
    with raises(CommTypeError, "x"):
        c.bound([1.0])
    with raises(CommTypeError, "out"):
        c.encode(x, out=torch.empty(c.nbytes(300)))
    with raises(CommArgumentError, "out", str(c.nbytes(300))):
        c.encode(x, out=torch.empty(c.nbytes(300) + 1, dtype=torch.uint8))
    with raises(CommArgumentError, "out"):
        c.encode(x, out=torch.empty(2 * c.nbytes(300), dtype=torch.uint8)[::2])
    p = c.encode(x)
    with raises(CommTypeError, "out"):
        c.decode(p, out=torch.empty(300, dtype=torch.int32))
    with raises(CommArgumentError, "out"):
        c.decode(p, out=torch.empty(301))
    with raises(CommArgumentError, "out"):
        c.decode(p, out=torch.empty(600)[::2])
    with raises(CommArgumentError, "accumulate"):
        c.decode(p, accumulate=True)
    with raises(CommArgumentError, "packed", "another codec"):
        cc.codec("int8", block=128).decode(p)
    with raises(CommTypeError, "packed"):
        c.decode(p.data)
    with raises(CommArgumentError, "data", str(c.nbytes(300))):
        c.packed(p.data[:-1], (300,), torch.float32)
    with raises(CommTypeError, "dtype"):
        c.packed(p.data, (300,), torch.float64)
    with raises(CommTypeError, "data"):
        c.packed(p.data.float(), (300,), torch.float32)
    assert c.packed(p.data, (10, 30), torch.bfloat16).shape == (10, 30)
    with raises(CommArgumentError, "numel"):
        c.nbytes(-1)
    with raises(CommTypeError, "dtype"):
        c.nbytes(4, torch.int8)
    with raises(CommArgumentError, "numel", str(2 ** 31 - 1)):
        cc.codec("topk").nbytes(2 ** 31)
