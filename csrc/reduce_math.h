/* Per-element math of commlib's reductions: one definition for the CPU shared-memory path
 * (csrc/shm/reduce.c, built by gcc) and the CUDA kernels (csrc/cuda_ipc.cu, csrc/kernels.cu,
 * built by nvcc/NVRTC). The semantics are those of commlib.kernels (torch):
 *
 *   - float16 and bfloat16 are read as float32, accumulated in float32, and rounded once to
 *     nearest-even at the end (torch's .to(torch.float16 / torch.bfloat16));
 *   - MIN/MAX on floating types propagate NaN (torch.minimum / torch.maximum);
 *   - integer SUM/PRODUCT wrap around (two's complement), like torch's integer add_/mul_;
 *   - AVG is a SUM divided once by the group size in the accumulation type.
 *
 * Everything here is CL_HD (host and device) and free of library calls, so that a host build is
 * tested against torch (tests/test_kernels.py) and the device build is the same code.
 */
#ifndef COMMLIB_REDUCE_MATH_H
#define COMMLIB_REDUCE_MATH_H

#ifdef __CUDACC__
#define CL_HD __host__ __device__ __forceinline__
#else
#define CL_HD static inline
#endif

#ifdef __CUDACC_RTC__
typedef unsigned short cl_u16;
typedef unsigned int cl_u32;
#else
#include <stdint.h>
typedef uint16_t cl_u16;
typedef uint32_t cl_u32;
#endif

/* Operation codes, shared with commlib/backends/shm.py and commlib/backends/cuda_ipc.py. */
enum { CL_SUM = 0, CL_PROD = 1, CL_MIN = 2, CL_MAX = 3, CL_BAND = 4, CL_BOR = 5, CL_BXOR = 6 };

/* Dtype codes, shared with the same Python modules. */
enum { CL_F32 = 0, CL_F64 = 1, CL_F16 = 2, CL_BF16 = 3, CL_I8 = 4, CL_U8 = 5, CL_I16 = 6,
       CL_I32 = 7, CL_I64 = 8, CL_NDTYPES = 9 };

CL_HD float cl_bits_f32(cl_u32 u) {
    union { cl_u32 u; float f; } v;
    v.u = u;
    return v.f;
}

CL_HD cl_u32 cl_f32_bits(float f) {
    union { cl_u32 u; float f; } v;
    v.f = f;
    return v.u;
}

/* bfloat16 <-> float32 */
CL_HD float cl_bf16_to_f32(cl_u16 h) { return cl_bits_f32((cl_u32)h << 16); }

CL_HD cl_u16 cl_f32_to_bf16(float f) {
    cl_u32 u = cl_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)      /* NaN: torch's canonical bfloat16 NaN */
        return (cl_u16)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);          /* round to nearest, ties to even */
    return (cl_u16)(u >> 16);
}

/* float16 <-> float32 (IEEE binary16), exact conversion up and round-to-nearest-even down,
 * subnormals included. */
CL_HD float cl_f16_to_f32(cl_u16 h) {
    cl_u32 sign = (cl_u32)(h & 0x8000u) << 16;
    cl_u32 exp = (h >> 10) & 0x1fu;
    cl_u32 man = h & 0x3ffu;
    if (exp == 0x1fu)                          /* inf / NaN */
        return cl_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return cl_bits_f32(sign);
        /* subnormal: man * 2^-24, exact in float32 */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return cl_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

CL_HD cl_u16 cl_f32_to_f16(float f) {
    cl_u32 u = cl_f32_bits(f);
    cl_u16 sign = (cl_u16)((u >> 16) & 0x8000u);
    cl_u32 a = u & 0x7fffffffu;
    if (a > 0x7f800000u)                       /* NaN: torch's canonical quiet NaN, signed */
        return (cl_u16)(sign | 0x7e00u);
    if (a >= 0x477ff000u)                      /* rounds to >= 65520: inf */
        return (cl_u16)(sign | 0x7c00u);
    if (a < 0x38800000u) {                     /* below 2^-14: subnormal or zero */
        /* adding 0.5 shifts the mantissa so that the FPU's own rounding (to nearest even)
         * lands the subnormal's bits in the low mantissa bits */
        float v = cl_bits_f32(a) + 0.5f;
        return (cl_u16)(sign | (cl_u16)(cl_f32_bits(v) - 0x3f000000u));
    }
    cl_u32 odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd;                    /* rebias exponent (-112 << 23) and round */
    return (cl_u16)(sign | (cl_u16)(a >> 13));
}

/* NaN-propagating min / max (torch.minimum / torch.maximum). */
CL_HD float cl_minf(float a, float b) { return a != a ? a : (b != b ? b : (b < a ? b : a)); }
CL_HD float cl_maxf(float a, float b) { return a != a ? a : (b != b ? b : (b > a ? b : a)); }
CL_HD double cl_mind(double a, double b) { return a != a ? a : (b != b ? b : (b < a ? b : a)); }
CL_HD double cl_maxd(double a, double b) { return a != a ? a : (b != b ? b : (b > a ? b : a)); }

/* The floating ops in float accumulation (SUM and AVG add; AVG divides once at the end). */
CL_HD float cl_combinef(float a, float b, int op) {
    switch (op) {
    case CL_PROD: return a * b;
    case CL_MIN: return cl_minf(a, b);
    case CL_MAX: return cl_maxf(a, b);
    default: return a + b;
    }
}

#endif
