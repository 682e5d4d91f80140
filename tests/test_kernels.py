"""The host build of csrc/reduce_math.h (through commlib.transports._shm, built by the package install)
against the torch reference of commlib.kernels: every dtype x op, bit for bit."""

import sys

import pytest
import torch

from commlib.transports import shm
from commlib.kernels import cast_, reduce_many
from commlib.ops import ReduceOp

ext = pytest.importorskip("commlib.transports._shm", reason="the C extension is not built (pip install -e .)")

FLOAT_OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
INT_OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
           ReduceOp.BOR, ReduceOp.BXOR]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def inputs(dtype, k, count=2053, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        xs = [(torch.randn(count, generator=g, dtype=torch.float64) * 100).to(dtype) for _ in range(k)]
        xs[0][5] = float("nan")  # MIN/MAX propagate NaN, SUM too
        xs[-1][7] = float("inf")
        return xs
    info = torch.iinfo(dtype)
    return [torch.randint(info.min, info.max, (count,), generator=g, dtype=torch.int64).to(dtype)
            for _ in range(k)]  # full range: SUM and PRODUCT wrap


def same_bits(a, b):
    if a.dtype.is_floating_point:
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
    return torch.equal(a, b)


@pytest.fixture(params=["simd", "scalar"])
def kernels(request):
    """Both builds of the float16/bfloat16 SUM: the vectorized one (AVX2/F16C, where the CPU has
    it) and the portable scalar one."""
    before = ext.simd()
    on = ext.simd(request.param == "simd")
    if request.param == "simd" and not on:
        pytest.skip("this CPU has no AVX2/F16C: only the scalar kernels run here")
    yield request.param
    ext.simd(before)


def test_simd_kernels_are_on_where_the_cpu_has_them():
    flags = open("/proc/cpuinfo").read().split() if sys.platform.startswith("linux") else []
    if "avx2" in flags and "f16c" in flags:
        assert ext.simd() is True


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_reduce_matches_torch(dtype, k, kernels):
    ops = FLOAT_OPS if dtype.is_floating_point else INT_OPS
    for op in ops:
        xs = inputs(dtype, k, seed=k)
        got = torch.empty_like(xs[0])
        ext.reduce(got.data_ptr(), [x.data_ptr() for x in xs], got.numel(), shm.DTYPE_CODES[dtype],
                   shm.OP_CODES[op], k if op is ReduceOp.AVG else 0)
        want = reduce_many(torch.empty_like(xs[0]), xs, op)
        assert same_bits(got, want), (dtype, op, k, (got != want).nonzero()[:5])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cast_matches_torch(dtype):
    # every float16/bfloat16 bit pattern up, and float32 values around every rounding boundary
    # (ties, subnormals, overflow to inf) down
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    up = torch.empty(every.numel(), dtype=torch.float32)
    ext.cast(up.data_ptr(), every.data_ptr(), every.numel(), shm.DTYPE_CODES[dtype], 0)
    assert same_bits(up, cast_(torch.empty_like(up), every))
    mid = up[~up.isnan()].sort().values
    ties = (mid[1:].double() + mid[:-1].double()) / 2
    probes = torch.cat([ties.float(), torch.nextafter(ties.float(), torch.tensor(0.0)),
                        torch.tensor([65504.0, 65519.0, 65520.0, 1e-8, -1e-8, 3.0e38, 2.0**-24,
                                      2.0**-25, 3 * 2.0**-26, float("inf"), float("nan")])])
    down = torch.empty(probes.numel(), dtype=dtype)
    ext.cast(down.data_ptr(), probes.data_ptr(), probes.numel(), 0, shm.DTYPE_CODES[dtype])
    assert same_bits(down.float(), cast_(torch.empty_like(down), probes).float())


def test_bad_arguments_raise():
    x = torch.zeros(4)
    with pytest.raises(ValueError):
        ext.reduce(x.data_ptr(), [x.data_ptr()], 4, shm.DTYPE_CODES[torch.float32],
                   shm.OP_CODES[ReduceOp.BAND], 0)  # bitwise op on a float
    with pytest.raises(ValueError):
        ext.cast(x.data_ptr(), x.data_ptr(), 4, 0, 0)
