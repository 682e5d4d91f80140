// compress.cu: the CUDA kernels of commlib.compress's block quantizers (int8, int4, fp8
// e4m3/e5m2), loaded through CuPy RawModule by commlib/compress/cuda.py. The per-element math is
// csrc/compress/codec_math.h, shared with the CPU fast path (csrc/compress/codecs.c), whose host
// build is tested against the torch definition bit for bit (tests/test_compress_c.py). These
// kernels are compile-tested for sm_80 and sm_90 (tests/test_csrc.py); no GPU ran them here.
//
// Encode is two launches on the caller's stream:
//   cl_compress_scales_<src>(x, n, block, kind, scale_f16, wire): one thread block per codec
//       block (grid-stride over blocks): the block's absmax as the integer max of |x|'s bits
//       (cl_abs_bits: NaN above inf, so "non-finite block" is "max >= 0x7f800000"), reduced in
//       warps by shuffles and across warps in shared memory; thread 0 stores the scale.
//   cl_compress_encode_<kind>_<src>(x, n, block, scale_f16, wire): one thread per payload byte
//       (int4: two elements, possibly of two codec blocks) reads its block's stored scale and
//       writes the code (ZERO for a NaN or zero scale).
// Decode is one launch: cl_compress_decode_<kind>_<dst>(wire, n, block, scale_f16, out,
// accumulate), one thread per element.
//
// A per-tensor scale (block = n) makes the scales kernel reduce the whole tensor in one thread
// block: correct, not fast; large per-tensor blocks are the place for a grid-wide reduction.
#include "compress/codec_math.h"

#define CL_THREADS 256 // threads per block of the scales kernel (a multiple of 32, at most 1024)

__device__ __forceinline__ size_t cl_nblocks(size_t n, size_t block) { return n ? (n - 1) / block + 1 : 0; }

__device__ __forceinline__ cl_u32 cl_load_scale(const cl_u8 *wire, size_t b, int scale_f16) {
    return scale_f16 ? (cl_u32)((const cl_u16 *)wire)[b] : ((const cl_u32 *)wire)[b];
}

// The wire buffer's scales are read and written as 2- or 4-byte words: the buffer must be
// aligned to the scale size (torch allocations and the slices the codecs make of them are).
#define CL_DEFINE_SCALES(SUF, T, SRC)                                                           \
    extern "C" __global__ void cl_compress_scales_##SUF(const T *x, size_t n, size_t block,     \
                                                        int kind, int scale_f16, cl_u8 *wire) { \
        __shared__ cl_u32 warp_max[CL_THREADS / 32];                                             \
        size_t nb = cl_nblocks(n, block);                                                        \
        for (size_t b = blockIdx.x; b < nb; b += gridDim.x) {                                    \
            size_t lo = b * block, hi = lo + block < n ? lo + block : n;                         \
            cl_u32 a = 0;                                                                        \
            for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {                         \
                cl_u32 v = cl_abs_bits(cl_load_as_f32(SRC, x, i));                               \
                a = v > a ? v : a;                                                               \
            }                                                                                    \
            for (int off = 16; off > 0; off >>= 1) {                                             \
                cl_u32 o = __shfl_down_sync(0xffffffffu, a, off);                                \
                a = o > a ? o : a;                                                               \
            }                                                                                    \
            if ((threadIdx.x & 31) == 0)                                                         \
                warp_max[threadIdx.x >> 5] = a;                                                  \
            __syncthreads();                                                                     \
            if (threadIdx.x == 0) {                                                              \
                for (unsigned w = 1; w < blockDim.x / 32; w++)                                   \
                    a = warp_max[w] > a ? warp_max[w] : a;                                       \
                cl_u32 st = cl_scale_store(a, cl_qmax(kind), scale_f16);                         \
                if (scale_f16)                                                                   \
                    ((cl_u16 *)wire)[b] = (cl_u16)st;                                            \
                else                                                                             \
                    ((cl_u32 *)wire)[b] = st;                                                    \
            }                                                                                    \
            __syncthreads();                                                                     \
        }                                                                                        \
    }

CL_DEFINE_SCALES(f32, float, CL_F32)
CL_DEFINE_SCALES(f16, cl_u16, CL_F16)
CL_DEFINE_SCALES(bf16, cl_u16, CL_BF16)

// The code of element i (its block's scale already stored).
__device__ __forceinline__ cl_u32 cl_code_of(int kind, int src, const void *x, size_t i, size_t block,
                                             int scale_f16, const cl_u8 *wire) {
    float s_q = cl_scale_load(cl_load_scale(wire, i / block, scale_f16), scale_f16);
    if (cl_scale_zero_codes(s_q))
        return cl_zero_code(kind);
    return cl_quantize(kind, cl_load_as_f32(src, x, i) / s_q);
}

#define CL_DEFINE_ENCODE(KSUF, KIND, SUF, T, SRC)                                                \
    extern "C" __global__ void cl_compress_encode_##KSUF##_##SUF(const T *x, size_t n, size_t block, \
                                                                 int scale_f16, cl_u8 *wire) {   \
        size_t nb = cl_nblocks(n, block);                                                        \
        cl_u8 *pay = wire + nb * (scale_f16 ? 2 : 4);                                            \
        size_t nbytes = KIND == CL_INT4 ? (n + 1) / 2 : n;                                       \
        for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < nbytes;               \
             j += (size_t)gridDim.x * blockDim.x) {                                              \
            if (KIND == CL_INT4) {                                                               \
                cl_u32 lo = cl_code_of(KIND, SRC, x, 2 * j, block, scale_f16, wire);             \
                cl_u32 hi = 2 * j + 1 < n ? cl_code_of(KIND, SRC, x, 2 * j + 1, block, scale_f16, wire) \
                                          : 8u;                                                  \
                pay[j] = (cl_u8)(lo | (hi << 4));                                                \
            } else {                                                                             \
                pay[j] = (cl_u8)cl_code_of(KIND, SRC, x, j, block, scale_f16, wire);             \
            }                                                                                    \
        }                                                                                        \
    }

#define CL_DEFINE_DECODE(KSUF, KIND, SUF, T, DST)                                                \
    extern "C" __global__ void cl_compress_decode_##KSUF##_##SUF(const cl_u8 *wire, size_t n,    \
                                                                 size_t block, int scale_f16,    \
                                                                 T *out, int accumulate) {       \
        size_t nb = cl_nblocks(n, block);                                                        \
        const cl_u8 *pay = wire + nb * (scale_f16 ? 2 : 4);                                      \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;                    \
             i += (size_t)gridDim.x * blockDim.x) {                                              \
            float s_q = cl_scale_load(cl_load_scale(wire, i / block, scale_f16), scale_f16);     \
            float v = s_q != s_q ? s_q : __fmul_rn(cl_dequantize(KIND, cl_code_at(KIND, pay, i)), s_q); \
            cl_put(DST, out, i, v, accumulate);                                                  \
        }                                                                                        \
    }

#define CL_DEFINE_KIND(KSUF, KIND)                                                               \
    CL_DEFINE_ENCODE(KSUF, KIND, f32, float, CL_F32)                                             \
    CL_DEFINE_ENCODE(KSUF, KIND, f16, cl_u16, CL_F16)                                            \
    CL_DEFINE_ENCODE(KSUF, KIND, bf16, cl_u16, CL_BF16)                                          \
    CL_DEFINE_DECODE(KSUF, KIND, f32, float, CL_F32)                                             \
    CL_DEFINE_DECODE(KSUF, KIND, f16, cl_u16, CL_F16)                                            \
    CL_DEFINE_DECODE(KSUF, KIND, bf16, cl_u16, CL_BF16)

CL_DEFINE_KIND(int8, CL_INT8)
CL_DEFINE_KIND(int4, CL_INT4)
CL_DEFINE_KIND(e4m3, CL_E4M3)
CL_DEFINE_KIND(e5m2, CL_E5M2)
