"""The C fast path of the int8 / int4 / fp8 codecs (commlib.compress._codecs, csrc/compress/)
against their torch definition (commlib.compress with COMMLIB_COMPRESS_IMPL=torch), bit for bit:
every kind x input dtype x scale dtype x block x size, special values (zeros of both signs,
subnormals, rounding ties, the formats' extremes, inf, NaN, scales that overflow or underflow
float16), decode with and without accumulation into every output dtype; a dense float32 sweep
around every fp8 rounding boundary and every fp8 byte decoded, against torch's own fp8
conversion; the AVX2 and scalar builds writing identical bytes; the switch and its errors."""

import math
import shutil
import subprocess
import sys

import pytest
import torch

import commlib.compress as cc
from commlib import config
from commlib.compress import _fast, cuda
from commlib.errors import CommArgumentError, CommBackendError, CommConfigError, CommTypeError
from commlib.kernels import nvrtc

ext = pytest.importorskip("commlib.compress._codecs",
                          reason="the C codecs are not built (pip install -e . with a C compiler)")

KINDS = {"int8": ("int8", {}), "int4": ("int4", {}), "e4m3": ("fp8", {"format": "e4m3"}),
         "e5m2": ("fp8", {"format": "e5m2"})}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALES = [torch.float32, torch.float16]
SIZES = [0, 1, 7, 255, 256, 257, 4097, (1 << 20) + 3]
BLOCKS = [1, 3, 64, 256, None]
F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("COMMLIB_COMPRESS_IMPL", raising=False)


def make(kind, scale_dtype=torch.float32, block="default"):
    name, opts = KINDS[kind]
    if block != "default":
        opts = {**opts, "block": block}
    return cc.codec(name, scale_dtype=scale_dtype, **opts)


def run(monkeypatch, impl, fn, *args, **kw):
    """fn(*args, **kw) with the codecs forced to implementation ``impl``."""
    monkeypatch.setenv("COMMLIB_COMPRESS_IMPL", impl)
    try:
        return fn(*args, **kw)
    finally:
        monkeypatch.delenv("COMMLIB_COMPRESS_IMPL")


def assert_bytes(torch_bytes, c_bytes, what):
    if not torch.equal(torch_bytes, c_bytes):
        bad = (torch_bytes != c_bytes).nonzero().flatten()[:6].tolist()
        raise AssertionError(f"{what}: {int((torch_bytes != c_bytes).sum())} bytes differ, first at "
                             f"{bad}: torch {torch_bytes[bad].tolist()} vs C {c_bytes[bad].tolist()}")


def assert_values(ref, got, what):
    """NaN at the same places, the same bits everywhere else (so -0 and +0 differ)."""
    assert ref.dtype == got.dtype and ref.shape == got.shape, what
    nan_r, nan_g = ref.isnan(), got.isnan()
    if not torch.equal(nan_r, nan_g):
        bad = (nan_r != nan_g).nonzero().flatten()[:6].tolist()
        raise AssertionError(f"{what}: NaN-ness differs at {bad}: torch {ref[bad].tolist()} vs C {got[bad].tolist()}")
    r, g = ref.view(INT[ref.dtype])[~nan_r], got.view(INT[got.dtype])[~nan_g]
    if not torch.equal(r, g):
        bad = (r != g).nonzero().flatten()[:6].tolist()
        raise AssertionError(f"{what}: {int((r != g).sum())} values differ: torch "
                             f"{ref[~nan_r][bad].tolist()} vs C {got[~nan_g][bad].tolist()}")


# Finite values that every input gets where it is long enough: zeros of both signs, float32
# subnormals, float16/bfloat16 extremes, the fp8 maxima and what lies beyond them.
FINITE_SPECIALS = [0.0, -0.0, 1e-40, -1.4e-45, 6e-8, -1e-5, 448.0, -464.0, 480.0, 57344.0, -61440.0,
                   65504.0, -3e38, 1.5, -2.5, 1e-30, 2.0 ** -126]


def values(n, dtype, seed, nonfinite=False):
    """n values of ``dtype``: normal samples spread over 2^-12..2^12 within a block, every 256
    values at another magnitude (whole blocks tiny or huge, so that float16 scales underflow to 0
    or subnormals, or overflow), the specials above at fixed places, and with ``nonfinite`` inf,
    -inf and NaN at three places (their blocks decode to NaN, the others stay finite)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-12, 13, (n,), generator=g, dtype=torch.float64)
    mags = torch.tensor([1.0, 1e-38, 1e-30, 1e-9, 3e-7, 1e-3, 1e4, 1e8, 1e30, 1e33], dtype=torch.float64)
    x *= mags[(torch.arange(n) // 256) % len(mags)]
    for i, v in enumerate(FINITE_SPECIALS):
        if 2 * i + 1 < n:
            x[2 * i + 1] = v
    fmax = torch.finfo(dtype).max
    x = x.clamp(-fmax, fmax).to(dtype)  # finite in dtype (float16: beyond 65504 is the clamp)
    if nonfinite and n:
        for pos, v in zip((n // 2, n - 1, 5 % n), (math.inf, -math.inf, math.nan)):
            x[pos] = v
    return x


def outputs(n, dtype, seed):
    """What decode(accumulate=True) adds into: normal values, zeros, a NaN and an inf."""
    g = torch.Generator().manual_seed(seed + 1)
    o = (torch.randn(n, generator=g) * 100).to(dtype)
    if n > 20:
        o[3], o[11], o[17] = math.nan, -math.inf, -0.0
    return o


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"block{b}")
@pytest.mark.parametrize("scale_dtype", SCALES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_c_matches_torch(monkeypatch, kind, dtype, scale_dtype, block):
    codec = make(kind, scale_dtype, block)
    for n in SIZES:
        big = n > 1 << 16
        for nonfinite in (False, True) if not big else (False,):
            x = values(n, dtype, seed=n * 7 + nonfinite, nonfinite=nonfinite)
            what = f"{codec!r} n={n} {dtype}{' non-finite' if nonfinite else ''}"
            p_t = run(monkeypatch, "torch", codec.encode, x)
            p_c = run(monkeypatch, "c", codec.encode, x)
            assert p_c.data.numel() == codec.nbytes(n, dtype)
            assert_bytes(p_t.data, p_c.data, f"encode {what}")
            for out_dtype in DTYPES if not big else (dtype,):
                for acc in (False, True):
                    base = outputs(n, out_dtype, seed=n)
                    ref = run(monkeypatch, "torch", codec.decode, p_t, base.clone(), accumulate=acc)
                    got = run(monkeypatch, "c", codec.decode, p_t, base.clone(), accumulate=acc)
                    assert_values(ref, got, f"decode {what} -> {out_dtype} accumulate={acc}")


def test_c_path_is_the_one_that_runs(monkeypatch):
    """COMMLIB_COMPRESS_IMPL=c (and auto, the extension being built) calls the extension; torch
    does not."""
    calls = []
    real = _fast.encode
    monkeypatch.setattr(_fast, "encode", lambda *a: calls.append(a[0]) or real(*a))
    x = torch.randn(1000)
    for impl, expect in (("c", 1), ("auto", 2), ("torch", 2)):
        run(monkeypatch, impl, make("int8").encode, x)
        assert len(calls) == expect, impl
    assert calls == ["int8", "int8"]


# (dtype, scale dtype, e): the scale 2^e must be a number of the scale dtype, and the values
# (k + 1/2) * 2^e with |k| <= 127 numbers of the input dtype.
TIE_CASES = [(d, s, e) for d in DTYPES for s in SCALES for e in (-130, -20, -8, 0, 8, 30)
             if (s != torch.float16 or -24 <= e <= 15) and (d != torch.float16 or -14 <= e <= 8)]


@pytest.mark.parametrize("dtype, scale_dtype, e", TIE_CASES, ids=str)
def test_integer_ties_round_to_even(monkeypatch, dtype, scale_dtype, e):
    """Values exactly at k + 1/2 times the scale (a power of two, so the division is exact):
    round half to even, in both implementations; the codes asserted."""
    for kind, qmax in (("int8", 127), ("int4", 7)):
        k = torch.arange(-qmax, qmax, dtype=torch.float64)
        x64 = torch.cat([torch.tensor([qmax, -qmax], dtype=torch.float64), k + 0.5])
        x = (x64 * 2.0 ** e).to(dtype)
        codec = make(kind, scale_dtype, block=None)
        expect = torch.cat([torch.tensor([qmax, -qmax]), 2 * torch.round((k + 0.5) / 2)]).to(torch.int64)
        assert torch.equal(torch.round(k + 0.5), expect[2:].double())  # torch.round is half-even
        for impl in ("torch", "c"):
            p = run(monkeypatch, impl, codec.encode, x)
            pay = p.data[scale_dtype.itemsize:]
            if kind == "int8":
                codes = pay.view(torch.int8).long()
            else:
                codes = torch.stack([pay & 15, pay >> 4], 1).flatten()[:x.numel()].long() - 8
            assert torch.equal(codes, expect), (impl, kind, codes.tolist())


def fp8_sweep(fmt, ulps):
    """float32 values around every rounding boundary of the format (the midpoints of adjacent
    non-negative fp8 values, from 0 to FMAX), +-ulps float32 ulps each, both signs."""
    finite = torch.arange(256, dtype=torch.uint8).view(F8[fmt]).float()
    pos = torch.unique(finite[torch.isfinite(finite) & (finite >= 0)])  # sorted
    mids = (pos[1:] + pos[:-1]) / 2  # exact: fp8 values have at most 4 significant bits
    bits = mids.view(torch.int32)[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    v = torch.cat([bits.flatten().view(torch.float32), pos])
    return torch.cat([v, -v])


@pytest.mark.parametrize("scale_dtype", SCALES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_dense_sweep_around_every_rounding_boundary(monkeypatch, fmt, scale_dtype):
    """Every block starts with FMAX, so its scale is exactly 1 and the codes are torch's own
    conversion of the values (``x.to(torch.float8_*)``): checked against both that and the torch
    codec, for ~260k values."""
    fmax = torch.finfo(F8[fmt]).max
    sweep = fp8_sweep(fmt, ulps=512)
    sweep = sweep[sweep.abs() <= fmax]
    pad = -len(sweep) % 255
    body = torch.cat([sweep, torch.zeros(pad)]).view(-1, 255)
    x = torch.cat([torch.full((body.shape[0], 1), fmax), body], 1).flatten()
    codec = make(fmt, scale_dtype, block=256)
    p_t = run(monkeypatch, "torch", codec.encode, x)
    p_c = run(monkeypatch, "c", codec.encode, x)
    assert_bytes(p_t.data, p_c.data, f"encode sweep {fmt}")
    nb = body.shape[0]
    scales = p_c.data[:nb * scale_dtype.itemsize].view(scale_dtype)
    assert torch.equal(scales.float(), torch.ones(nb))
    codes = p_c.data[nb * scale_dtype.itemsize:].view(-1, 256)[:, 1:].flatten()
    assert_bytes(body.flatten().to(F8[fmt]).view(torch.uint8), codes, f"codes vs torch .to({F8[fmt]})")


@pytest.mark.parametrize("scale_dtype", SCALES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_fp8_byte_decodes_like_torch(monkeypatch, fmt, scale_dtype):
    """The 256 bytes with a scale of 1 and of 2^-3, into every output dtype, with and without
    accumulation: the exact widening (NaN bytes: NaN, e5m2's inf: inf)."""
    codec = make(fmt, scale_dtype, block=256)
    every = torch.arange(256, dtype=torch.uint8)
    for scale in (1.0, 0.125):
        data = torch.cat([torch.tensor([scale], dtype=scale_dtype).view(torch.uint8), every])
        p = codec.packed(data, (256,), torch.float32)
        got = run(monkeypatch, "c", codec.decode, p)
        assert_values(every.view(F8[fmt]).float() * scale, got, f"{fmt} bytes x {scale}")
        for out_dtype in DTYPES:
            for acc in (False, True):
                base = outputs(256, out_dtype, seed=scale == 1.0)
                ref = run(monkeypatch, "torch", codec.decode, p, base.clone(), accumulate=acc)
                got = run(monkeypatch, "c", codec.decode, p, base.clone(), accumulate=acc)
                assert_values(ref, got, f"{fmt} bytes x {scale} -> {out_dtype} accumulate={acc}")


@pytest.fixture
def simd_on():
    before = ext.simd()
    if not ext.simd(True):
        pytest.skip("this CPU has no AVX2/F16C: only the scalar build runs here")
    yield
    ext.simd(before)


def test_simd_is_on_where_the_cpu_has_it():
    flags = open("/proc/cpuinfo").read().split() if sys.platform.startswith("linux") else []
    if "avx2" in flags and "f16c" in flags:
        assert ext.simd() is True


@pytest.mark.parametrize("scale_dtype", SCALES, ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_simd_and_scalar_builds_write_the_same_bytes(simd_on, kind, scale_dtype):
    """Encode and decode (every dtype, accumulate or not) with the AVX2 loops and with the
    portable ones: identical bytes, NaN payloads included."""
    for dtype in DTYPES:
        for n in (0, 1, 7, 31, 33, 255, 257, 4097, 70001):
            for block in (1, 3, 8, 64, 256, max(n, 1)):
                x = values(n, dtype, seed=n + block, nonfinite=n % 2 == 1)
                size = _fast.nbytes(kind, n, block, scale_dtype)
                wires = []
                for on in (True, False):
                    ext.simd(on)
                    w = torch.empty(size, dtype=torch.uint8)
                    _fast.encode(kind, x, w, block, scale_dtype)
                    wires.append(w)
                what = f"{kind} {dtype} n={n} block={block}"
                assert_bytes(wires[1], wires[0], f"encode simd vs scalar {what}")
                for out_dtype in DTYPES:
                    for acc in (False, True):
                        outs = []
                        for on in (True, False):
                            ext.simd(on)
                            o = outputs(n, out_dtype, seed=n)
                            _fast.decode(kind, wires[0], o, block, scale_dtype, acc)
                            outs.append(o.view(INT[out_dtype]))
                        assert torch.equal(outs[0], outs[1]), f"decode simd vs scalar {what} {out_dtype} {acc}"


# --- the switch, the contract's checks, the CUDA loader ------------------------------------------

def test_option_parses_and_rejects_typos(monkeypatch):
    assert config.get("compress_impl") == "auto"
    for text, value in (("c", "c"), (" Torch ", "torch"), ("AUTO", "auto")):
        monkeypatch.setenv("COMMLIB_COMPRESS_IMPL", text)
        assert config.get("compress_impl") == value
    monkeypatch.setenv("COMMLIB_COMPRESS_IMPL", "cc")
    with pytest.raises(CommConfigError, match="COMMLIB_COMPRESS_IMPL='cc'.*'auto', 'torch' or 'c'"):
        config.get("compress_impl")


def test_c_without_the_extension_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(_fast, "_c_encode", None)
    monkeypatch.setattr(_fast, "_c_decode", None)
    assert not _fast.available()
    x = torch.randn(10)
    assert torch.equal(make("int8").encode(x).data, run(monkeypatch, "torch", make("int8").encode, x).data)
    with pytest.raises(CommConfigError, match=r"COMMLIB_COMPRESS_IMPL.*pip install -e \."):
        run(monkeypatch, "c", make("int8").encode, x)
    with pytest.raises(CommConfigError, match=r"not built.*pip install -e \. on a machine with a C compiler"):
        _fast.encode("int8", x, torch.empty(14, dtype=torch.uint8), 256, torch.float32)


def test_contract_checks_its_arguments():
    x, w = torch.randn(10), torch.empty(4 + 10, dtype=torch.uint8)
    _fast.encode("int8", x, w, 256, torch.float32)
    assert _fast.nbytes("int4", 11, 4, torch.float16) == 3 * 2 + 6 == ext.nbytes(ext.INT4, 11, 4, True)
    with pytest.raises(CommArgumentError, match="'kind' = 'int2'"):
        _fast.encode("int2", x, w, 256, torch.float32)
    with pytest.raises(CommTypeError, match="float32, bfloat16 or float16"):
        _fast.encode("int8", x.double(), w, 256, torch.float32)
    with pytest.raises(CommArgumentError, match="14 bytes long"):
        _fast.encode("int8", x, w[:-1], 256, torch.float32)
    with pytest.raises(CommArgumentError, match="contiguous"):
        _fast.decode("int8", w, torch.empty(20)[::2], 256, torch.float32, False)
    with pytest.raises(CommArgumentError, match="'block' = 0"):
        _fast.decode("int8", w, x, 0, torch.float32, False)
    with pytest.raises(CommArgumentError, match="'scale_dtype'"):
        _fast.decode("int8", w, x, 256, torch.bfloat16, False)
    with pytest.raises(ValueError, match="bad arguments"):  # the extension's own last line
        ext.encode(7, x.data_ptr(), ext.F32, 10, 256, False, w.data_ptr())
    assert (_fast.KINDS, _fast.DTYPES[torch.float16]) == (
        {"int8": ext.INT8, "int4": ext.INT4, "e4m3": ext.E4M3, "e5m2": ext.E5M2}, ext.F16)


def test_cuda_loader_without_cupy_says_so(monkeypatch):
    monkeypatch.setattr(nvrtc, "_MODULES", {})  # nothing compiled yet
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(CommBackendError, match=r"CuPy is not installed.*commlib\[cuda\]"):
        cuda.load_module()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is absent on this machine")
def test_cuda_source_defines_every_kernel_the_loader_launches(tmp_path):
    src = cuda._CSRC / "compress.cu"
    obj = tmp_path / "compress.o"
    proc = subprocess.run(["nvcc", "-arch=sm_80", f"-I{cuda._CSRC}", "-c", str(src), "-o", str(obj)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    symbols = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    defined = {line.split()[-1] for line in symbols.splitlines() if " T cl_compress_" in line}
    assert defined == set(cuda.kernel_names())
