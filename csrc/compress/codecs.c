/* The codecs of commlib.compress._codecs: fused quantize + pack (encode) and unpack + dequantize
 * (+ accumulate) (decode) of the block quantizers int8, int4, fp8 e4m3 / e5m2, from and to float32,
 * bfloat16 and float16 buffers, in the wire format of commlib/compress (scales first, then the
 * payload). Part of the unity build of module.c.
 *
 * Layout of the work: the encode driver walks groups of blocks (CL_GROUP_VALUES values); for each
 * block of a group it takes the absmax and computes and stores the scale (scalar, once per
 * block), then for each block runs one block function that divides, quantizes and packs its
 * values (or fills ZERO codes). The input is read twice, the second time from L1. Decode runs one
 * block function per block (unpack, widen, multiply, add, narrow). The block functions exist per
 * (kind, dtype) in two builds, scalar (codec_math.h) and AVX2 (codec_simd.h), chosen by
 * use_simd; both write the same bytes. Single-threaded: the callers run beside communication
 * threads on few cores. */
#include "codec_simd.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "the wire format stores little-endian scales; this build writes them with memcpy"
#endif

typedef cl_u32 (*absmax_fn)(const void *x, size_t lo, size_t m);
typedef void (*enc_block_fn)(const void *x, size_t lo, size_t m, float s_q, cl_u8 *pay);
typedef void (*dec_block_fn)(const cl_u8 *pay, size_t lo, size_t m, float s_q, void *out, int acc);

/* 1: the AVX2 block functions (set at import from the CPU's features; commlib.compress._codecs.simd()
 * reads or changes it, for tests). */
static int use_simd;

/* ----- scalar block functions ---------------------------------------------------------------- */
static inline __attribute__((always_inline)) cl_u32 cs_absmax(int src, const void *x, size_t lo,
                                                              size_t m) {
    cl_u32 r = 0;
    for (size_t i = lo; i < lo + m; i++) {
        cl_u32 b = cl_abs_bits(cl_load_as_f32(src, x, i));
        r = b > r ? b : r;
    }
    return r;
}

static inline __attribute__((always_inline)) void cs_encode_block(int kind, int src, const void *x,
                                                                  size_t lo, size_t m, float s_q,
                                                                  cl_u8 *pay) {
    for (size_t i = lo; i < lo + m; i++)
        cl_put_code(kind, pay, i, cl_quantize(kind, cl_load_as_f32(src, x, i) / s_q));
}

static inline __attribute__((always_inline)) void cs_decode_block(int kind, int dst, const cl_u8 *pay,
                                                                  size_t lo, size_t m, float s_q,
                                                                  void *out, int acc) {
    for (size_t i = lo; i < lo + m; i++)
        cl_put(dst, out, i, cl_dequantize(kind, cl_code_at(kind, pay, i)) * s_q, acc);
}

/* ----- one function per (kind, dtype) and build ---------------------------------------------- */
#define DEFINE_ABSMAX(SUF, SRC)                                                                  \
    static cl_u32 absmax_s_##SUF(const void *x, size_t lo, size_t m) { return cs_absmax(SRC, x, lo, m); }
#define DEFINE_BLOCKS(KSUF, KIND, SUF, T)                                                        \
    static void enc_s_##KSUF##_##SUF(const void *x, size_t lo, size_t m, float s, cl_u8 *pay) {  \
        cs_encode_block(KIND, T, x, lo, m, s, pay);                                              \
    }                                                                                            \
    static void dec_s_##KSUF##_##SUF(const cl_u8 *pay, size_t lo, size_t m, float s, void *out,  \
                                     int acc) {                                                  \
        cs_decode_block(KIND, T, pay, lo, m, s, out, acc);                                       \
    }
#ifdef CL_HAVE_SIMD
#define DEFINE_ABSMAX_V(SUF, SRC)                                                                \
    CL_V3 static cl_u32 absmax_v_##SUF(const void *x, size_t lo, size_t m) { return cv_absmax(SRC, x, lo, m); }
#define DEFINE_BLOCKS_V(KSUF, KIND, SUF, T)                                                      \
    CL_V3 static void enc_v_##KSUF##_##SUF(const void *x, size_t lo, size_t m, float s, cl_u8 *pay) { \
        cv_encode_block(KIND, T, x, lo, m, s, pay);                                              \
    }                                                                                            \
    CL_V3 static void dec_v_##KSUF##_##SUF(const cl_u8 *pay, size_t lo, size_t m, float s,       \
                                           void *out, int acc) {                                 \
        cv_decode_block(KIND, T, pay, lo, m, s, out, acc);                                       \
    }
#else
#define DEFINE_ABSMAX_V(SUF, SRC)
#define DEFINE_BLOCKS_V(KSUF, KIND, SUF, T)
#endif

#define DEFINE_KIND(KSUF, KIND)                                                                  \
    DEFINE_BLOCKS(KSUF, KIND, f32, CL_F32) DEFINE_BLOCKS(KSUF, KIND, f16, CL_F16)                \
    DEFINE_BLOCKS(KSUF, KIND, bf16, CL_BF16) DEFINE_BLOCKS_V(KSUF, KIND, f32, CL_F32)            \
    DEFINE_BLOCKS_V(KSUF, KIND, f16, CL_F16) DEFINE_BLOCKS_V(KSUF, KIND, bf16, CL_BF16)

DEFINE_ABSMAX(f32, CL_F32)
DEFINE_ABSMAX(f16, CL_F16)
DEFINE_ABSMAX(bf16, CL_BF16)
DEFINE_ABSMAX_V(f32, CL_F32)
DEFINE_ABSMAX_V(f16, CL_F16)
DEFINE_ABSMAX_V(bf16, CL_BF16)
DEFINE_KIND(int8, CL_INT8)
DEFINE_KIND(int4, CL_INT4)
DEFINE_KIND(e4m3, CL_E4M3)
DEFINE_KIND(e5m2, CL_E5M2)

/* Tables indexed by [build][kind][dtype code] (dtype codes of reduce_math.h: CL_F32 = 0,
 * CL_F16 = 2, CL_BF16 = 3; 1, float64, is not a codec input). */
#define ROW(B, K) {[CL_F32] = B##_##K##_f32, [CL_F16] = B##_##K##_f16, [CL_BF16] = B##_##K##_bf16}
#define KINDS(B) {[CL_INT8] = ROW(B, int8), [CL_INT4] = ROW(B, int4), [CL_E4M3] = ROW(B, e4m3),   \
                  [CL_E5M2] = ROW(B, e5m2)}
#define SRC_DTYPES 4
static const absmax_fn ABSMAX[2][SRC_DTYPES] = {
    {[CL_F32] = absmax_s_f32, [CL_F16] = absmax_s_f16, [CL_BF16] = absmax_s_bf16},
#ifdef CL_HAVE_SIMD
    {[CL_F32] = absmax_v_f32, [CL_F16] = absmax_v_f16, [CL_BF16] = absmax_v_bf16},
#endif
};
static const enc_block_fn ENCODE[2][CL_NKINDS][SRC_DTYPES] = {
    KINDS(enc_s),
#ifdef CL_HAVE_SIMD
    KINDS(enc_v),
#endif
};
static const dec_block_fn DECODE[2][CL_NKINDS][SRC_DTYPES] = {
    KINDS(dec_s),
#ifdef CL_HAVE_SIMD
    KINDS(dec_v),
#endif
};

/* 1 when `dtype` is a codec input / output dtype (float32, float16, bfloat16). */
static int codec_dtype_ok(int dtype) { return dtype == CL_F32 || dtype == CL_F16 || dtype == CL_BF16; }

static size_t codec_nblocks(size_t n, size_t block) { return n ? (n - 1) / block + 1 : 0; }

/* Wire bytes of n values: scales, then the payload. */
static size_t codec_nbytes(int kind, size_t n, size_t block, int scale_f16) {
    return codec_nblocks(n, block) * (scale_f16 ? 2 : 4) + (kind == CL_INT4 ? (n + 1) / 2 : n);
}

/* ZERO codes for elements [lo, lo + m) */
static void zero_codes(int kind, cl_u8 *pay, size_t lo, size_t m) {
    if (kind != CL_INT4) {
        memset(pay + lo, 0, m);
        return;
    }
    size_t i = lo, end = lo + m;
    if ((i & 1) && i < end)
        cl_put_code(kind, pay, i++, 8u);
    size_t pairs = (end - i) / 2;
    memset(pay + (i >> 1), 0x88, pairs);
    for (i += 2 * pairs; i < end; i++)
        cl_put_code(kind, pay, i, 8u);
}

/* Values per group of blocks: the scales of a group are computed first (independent absmax and
 * division chains that overlap, where one block at a time would wait for each), then its blocks
 * are quantized, re-reading the group from L1/L2. */
#define CL_GROUP_VALUES 2048

/* encode n values of dtype `src` at x into the wire buffer dst (codec_nbytes bytes). */
static void codec_encode(int kind, const void *x, int src, size_t n, size_t block, int scale_f16,
                         cl_u8 *dst) {
    size_t nb = codec_nblocks(n, block), ss = scale_f16 ? 2 : 4;
    size_t group = block >= CL_GROUP_VALUES ? 1 : CL_GROUP_VALUES / block;
    cl_u8 *pay = dst + nb * ss;
    absmax_fn absmax = ABSMAX[use_simd][src];
    enc_block_fn enc = ENCODE[use_simd][kind][src];
    float qmax = cl_qmax(kind);
    float s_q[CL_GROUP_VALUES];
    for (size_t b0 = 0; b0 < nb; b0 += group) {
        size_t b1 = nb - b0 < group ? nb : b0 + group;
        for (size_t b = b0; b < b1; b++) {
            size_t lo = b * block, m = n - lo < block ? n - lo : block;
            cl_u32 st = cl_scale_store(absmax(x, lo, m), qmax, scale_f16);
            if (scale_f16) {
                cl_u16 h = (cl_u16)st;
                memcpy(dst + 2 * b, &h, 2);
            } else {
                memcpy(dst + 4 * b, &st, 4);
            }
            s_q[b - b0] = cl_scale_load(st, scale_f16);
        }
        for (size_t b = b0; b < b1; b++) {
            size_t lo = b * block, m = n - lo < block ? n - lo : block;
            if (cl_scale_zero_codes(s_q[b - b0]))
                zero_codes(kind, pay, lo, m);
            else
                enc(x, lo, m, s_q[b - b0], pay);
        }
    }
}

/* decode the wire buffer `wire` of n values into `out` (dtype `dst`), accumulating if asked. A
 * block with a NaN scale decodes to NaN (one scalar loop, the same in both builds). */
static void codec_decode(int kind, const cl_u8 *wire, size_t n, size_t block, int scale_f16,
                         void *out, int dst, int acc) {
    size_t nb = codec_nblocks(n, block), ss = scale_f16 ? 2 : 4;
    const cl_u8 *pay = wire + nb * ss;
    dec_block_fn dec = DECODE[use_simd][kind][dst];
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * block, m = n - lo < block ? n - lo : block;
        cl_u32 st = 0;
        if (scale_f16) {
            cl_u16 h;
            memcpy(&h, wire + 2 * b, 2);
            st = h;
        } else {
            memcpy(&st, wire + 4 * b, 4);
        }
        float s_q = cl_scale_load(st, scale_f16);
        if (s_q != s_q) {
            float nan = cl_bits_f32(0x7fc00000u);
            for (size_t i = lo; i < lo + m; i++)
                cl_put(dst, out, i, nan, acc);
        } else {
            dec(pay, lo, m, s_q, out, acc);
        }
    }
}
