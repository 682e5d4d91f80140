/* AVX2 (+F16C) builds of the block loops of csrc/compress/codecs.c: absmax, divide, round, clamp,
 * pack (encode) and unpack, widen, multiply, add, narrow (decode), 8 lanes at a time.
 *
 * Why: the per-element math of codec_math.h has branches (fp8's three cases, float16's
 * subnormals) that the compiler does not vectorize; the scalar loops run at 1.5-5 GB/s on this
 * machine kind (EPYC), the AVX2 ones at 12-60 GB/s, against ~40 GB/s for an in-cache memcpy. Here each branch is computed for all
 * lanes and blended.
 *
 * The same bytes as the scalar path (tests/test_compress_c.py compares both): the same IEEE
 * float32 operations in the same order (a true division, _mm256_div_ps, no reciprocal; no FMA),
 * rounding to integers by the MXCSR's round-to-nearest-even (the default; the scalar path adds
 * and removes 1.5 * 2^23), the fp8 conversion as c10's integer steps on all lanes, and float16
 * NaN written as the scalar path's canonical sign | 0x7e00.
 *
 * Built with a target attribute and chosen at run time (cl_simd_usable of reduce_simd.h), so the
 * extension still builds and runs on x86-64 CPUs without AVX2/F16C and on other architectures. */
#ifndef COMMLIB_CODEC_SIMD_H
#define COMMLIB_CODEC_SIMD_H

#include "codec_math.h"
#include "../reduce_simd.h" /* CL_V3, cl_simd_usable, cl_ld8_f16, cl_ld8_bf16, cl_st8_bf16 */

#ifdef CL_HAVE_SIMD
/* inlined into the per-(kind, dtype) block functions of codecs.c, where kind and dtype are
 * constants: every switch below folds away */
#define CV_INLINE CL_V3 static inline __attribute__((always_inline))

#define CV_I32(c) _mm256_set1_epi32((int)(c))

/* 8 input values as float32 (exact) */
CV_INLINE __m256 cv_load8(int src, const void *x, size_t i) {
    if (src == CL_F32)
        return _mm256_loadu_ps((const float *)x + i);
    if (src == CL_F16)
        return cl_ld8_f16((const uint16_t *)x + i);
    return cl_ld8_bf16((const uint16_t *)x + i);
}

/* Horizontal max of 8 unsigned lanes. */
CV_INLINE cl_u32 cv_hmax_u32(__m256i v) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
    return (cl_u32)_mm_cvtsi128_si32(m);
}

/* The block's absmax as float32 bits (cl_abs_bits of codec_math.h: an integer max of |x|'s bits;
 * for float16/bfloat16 on the 16-bit patterns, whose order is also the value order, widened once
 * at the end). */
CV_INLINE cl_u32 cv_absmax(int src, const void *x, size_t lo, size_t m) {
    size_t i = 0;
    if (src == CL_F32) {
        const __m256i *p = (const __m256i *)((const float *)x + lo);
        const __m256i mask = CV_I32(0x7fffffff);
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 32 <= m; i += 32, p += 4) {
            a0 = _mm256_max_epu32(a0, _mm256_and_si256(_mm256_loadu_si256(p), mask));
            a1 = _mm256_max_epu32(a1, _mm256_and_si256(_mm256_loadu_si256(p + 1), mask));
            a2 = _mm256_max_epu32(a2, _mm256_and_si256(_mm256_loadu_si256(p + 2), mask));
            a3 = _mm256_max_epu32(a3, _mm256_and_si256(_mm256_loadu_si256(p + 3), mask));
        }
        for (; i + 8 <= m; i += 8, p++)
            a0 = _mm256_max_epu32(a0, _mm256_and_si256(_mm256_loadu_si256(p), mask));
        a0 = _mm256_max_epu32(_mm256_max_epu32(a0, a1), _mm256_max_epu32(a2, a3));
        cl_u32 r = cv_hmax_u32(a0);
        for (; i < m; i++) {
            cl_u32 b = cl_abs_bits(((const float *)x)[lo + i]);
            r = b > r ? b : r;
        }
        return r;
    }
    const uint16_t *h = (const uint16_t *)x + lo;
    const __m256i mask = _mm256_set1_epi16(0x7fff);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (; i + 32 <= m; i += 32) {
        a0 = _mm256_max_epu16(a0, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(h + i)), mask));
        a1 = _mm256_max_epu16(a1, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(h + i + 16)), mask));
    }
    for (; i + 16 <= m; i += 16)
        a0 = _mm256_max_epu16(a0, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(h + i)), mask));
    a0 = _mm256_max_epu16(a0, a1);
    __m128i v = _mm_max_epu16(_mm256_castsi256_si128(a0), _mm256_extracti128_si256(a0, 1));
    v = _mm_max_epu16(v, _mm_shuffle_epi32(v, 0x4e));
    v = _mm_max_epu16(v, _mm_shuffle_epi32(v, 0xb1));
    v = _mm_max_epu16(v, _mm_srli_epi32(v, 16));
    cl_u32 r = (cl_u32)_mm_cvtsi128_si32(v) & 0xffffu;
    for (; i < m; i++) {
        cl_u32 b = h[i] & 0x7fffu;
        r = b > r ? b : r;
    }
    return src == CL_F16 ? cl_f32_bits(cl_f16_to_f32((cl_u16)r)) : r << 16;
}

/* clamp(y, -q, q) (y is never NaN here; -0 stays -0) */
CV_INLINE __m256 cv_clamp(__m256 y, float q) {
    return _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-q)), _mm256_set1_ps(q));
}

/* clamp(y, -FMAX, FMAX) -> fp8 bits on 8 lanes: cl_q_e4m3 / cl_q_e5m2 with both remaining
 * branches of c10's conversion computed and blended (after the clamp there is no NaN, inf or
 * overflow: y is never NaN here), on |y| with the sign put back last. `nrm` = the smallest
 * normal, `den` = the float whose addition rounds subnormals, `shift` = 23 - mantissa bits,
 * `rebias` = (fp8 bias - 127) << 23. Written for few operations (the loop is bound by them). */
CV_INLINE __m256i cv_to_fp8(__m256 y, float fmax, float nrm, cl_u32 den, int shift, cl_u32 rebias) {
    __m256 a = _mm256_min_ps(_mm256_and_ps(y, _mm256_castsi256_ps(CV_I32(0x7fffffff))), _mm256_set1_ps(fmax));
    __m256i f = _mm256_castps_si256(a);
    __m256 dsum = _mm256_add_ps(a, _mm256_castsi256_ps(CV_I32(den)));
    __m256i rd = _mm256_sub_epi32(_mm256_castps_si256(dsum), CV_I32(den));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(f, shift), CV_I32(1));
    __m256i rn = _mm256_add_epi32(_mm256_add_epi32(f, CV_I32(rebias + ((1u << (shift - 1)) - 1u))), odd);
    rn = _mm256_srli_epi32(rn, shift);
    __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(rn), _mm256_castsi256_ps(rd),
                                _mm256_cmp_ps(a, _mm256_set1_ps(nrm), _CMP_LT_OQ));
    /* the sign: y's sign bit selects r | 0x80 */
    __m256 rs = _mm256_or_ps(r, _mm256_castsi256_ps(CV_I32(0x80)));
    return _mm256_castps_si256(_mm256_blendv_ps(r, rs, y));
}

/* The codes of 8 values y = x / s_q as int32 lanes in 0..255 (int8: the byte; int4: the nibble
 * q + 8). _mm256_cvtps_epi32 rounds by the MXCSR: to nearest even unless a caller changed it. */
CV_INLINE __m256i cv_codes8(int kind, __m256 y) {
    switch (kind) {
    case CL_INT8:
        return _mm256_and_si256(_mm256_cvtps_epi32(cv_clamp(y, 127.0f)), CV_I32(0xff));
    case CL_INT4:
        return _mm256_add_epi32(_mm256_cvtps_epi32(cv_clamp(y, 7.0f)), CV_I32(8));
    case CL_E4M3:
        return cv_to_fp8(y, 448.0f, 0.015625f, 141u << 23, 20, (cl_u32)((7 - 127) * (1 << 23)));
    default:
        return cv_to_fp8(y, 57344.0f, 6.103515625e-05f, 134u << 23, 21, (cl_u32)((15 - 127) * (1 << 23)));
    }
}

/* 4 x 8 int32 codes (0..255) -> 32 bytes in element order. The packs work within 128-bit
 * lanes; the permute puts the 4-byte groups back in order. */
CV_INLINE __m256i cv_bytes32(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 8 int32 codes -> 8 bytes (the low half of the result) */
CV_INLINE __m128i cv_bytes8(__m256i c) {
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    return _mm_packus_epi16(w, w);
}

/* int4: pairs of nibble bytes (element 2k low, 2k+1 high) -> one byte each, in 16-bit lanes. */
CV_INLINE __m256i cv_nibbles(__m256i b) {
    return _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16(0x00ff)),
                           _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi16(0x00f0)));
}

CV_INLINE __m128i cv_nibbles128(__m128i b) {
    return _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0x00ff)),
                        _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi16(0x00f0)));
}

/* Codes of elements [lo, lo + m) of one block with scale s_q (finite, non-zero) into the
 * payload: 32 at a time, then 8, then one by one (cl_put_code of codec_math.h). int4 starts on an even
 * element (an odd block start is finished by the scalar step first). */
CV_INLINE void cv_encode_block(int kind, int src, const void *x, size_t lo, size_t m, float s_q,
                               cl_u8 *pay) {
    const __m256 s = _mm256_set1_ps(s_q);
    size_t i = lo, end = lo + m;
    if (kind == CL_INT4 && (i & 1) && i < end) {
        cl_put_code(kind, pay, i, cl_quantize(kind, cl_load_as_f32(src, x, i) / s_q));
        i++;
    }
    for (; i + 32 <= end; i += 32) {
        __m256i c0 = cv_codes8(kind, _mm256_div_ps(cv_load8(src, x, i), s));
        __m256i c1 = cv_codes8(kind, _mm256_div_ps(cv_load8(src, x, i + 8), s));
        __m256i c2 = cv_codes8(kind, _mm256_div_ps(cv_load8(src, x, i + 16), s));
        __m256i c3 = cv_codes8(kind, _mm256_div_ps(cv_load8(src, x, i + 24), s));
        __m256i b = cv_bytes32(c0, c1, c2, c3);
        if (kind == CL_INT4) {
            __m256i p = _mm256_packus_epi16(cv_nibbles(b), cv_nibbles(b));
            p = _mm256_permute4x64_epi64(p, 0x08); /* qwords 0 and 2: the two lanes' bytes */
            _mm_storeu_si128((__m128i *)(pay + (i >> 1)), _mm256_castsi256_si128(p));
        } else {
            _mm256_storeu_si256((__m256i *)(pay + i), b);
        }
    }
    for (; i + 8 <= end; i += 8) {
        __m128i b = cv_bytes8(cv_codes8(kind, _mm256_div_ps(cv_load8(src, x, i), s)));
        if (kind == CL_INT4) {
            __m128i n = cv_nibbles128(b);
            int v = _mm_cvtsi128_si32(_mm_packus_epi16(n, n));
            memcpy(pay + (i >> 1), &v, 4);
        } else {
            _mm_storel_epi64((__m128i *)(pay + i), b);
        }
    }
    for (; i < end; i++)
        cl_put_code(kind, pay, i, cl_quantize(kind, cl_load_as_f32(src, x, i) / s_q));
}

/* fp8 -> float32 on 8 lanes through the F16C conversion (8 bytes in the low half of b).
 * e5m2: the float16 of bits byte << 8 (cl_e5m2_to_f32; a NaN comes out quiet where the scalar
 * path keeps it signalling, and the multiplication by the scale that follows quiets both alike).
 * e4m3: the float16 of bits sign << 15 | magnitude << 7 has the same fields with float16's bias,
 * 8 more than e4m3's: it is the value times 2^-8 (subnormals too), and the product with 2^8 is
 * exact; 0x7f / 0xff -> sign | 0x7e00, which widens to cl_e4m3_to_f32's sign | 0x7fc00000. */
CV_INLINE __m256 cv_from_fp8(__m128i b, int e5m2) {
    __m128i w = _mm_unpacklo_epi8(_mm_setzero_si128(), b); /* byte << 8 in 16-bit lanes */
    if (e5m2)
        return _mm256_cvtph_ps(w);
    __m128i sign = _mm_and_si128(w, _mm_set1_epi16((short)0x8000));
    __m128i mag = _mm_and_si128(_mm_srli_epi16(w, 1), _mm_set1_epi16(0x3f80));
    __m128i h = _mm_or_si128(sign, mag);
    __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x3f80));
    h = _mm_blendv_epi8(h, _mm_or_si128(sign, _mm_set1_epi16(0x7e00)), nan);
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

/* dequantize() of elements i..i+7 (int4: i even) */
CV_INLINE __m256 cv_deq8(int kind, const cl_u8 *pay, size_t i) {
    if (kind == CL_INT4) {
        int v;
        memcpy(&v, pay + (i >> 1), 4);
        __m128i b = _mm_cvtsi32_si128(v);
        __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
        __m256i q = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
        return _mm256_cvtepi32_ps(_mm256_sub_epi32(q, CV_I32(8)));
    }
    __m128i b = _mm_loadl_epi64((const __m128i *)(pay + i));
    if (kind == CL_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    return cv_from_fp8(b, kind == CL_E5M2);
}

/* float32 -> float16 on 8 lanes, NaN as cl_f32_to_f16's sign | 0x7e00 (the hardware keeps the
 * payload). */
CV_INLINE void cv_st8_f16(uint16_t *p, __m256 v) {
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (__builtin_expect(!_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)), 1)) {
        _mm_storeu_si128((__m128i *)p, h);
        return;
    }
    __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00));
    __m128i canon = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16((short)0x8000)), _mm_set1_epi16(0x7e00));
    _mm_storeu_si128((__m128i *)p, _mm_blendv_epi8(h, canon, nan));
}

/* cl_put on 8 lanes */
CV_INLINE void cv_put8(int dtype, void *out, size_t i, __m256 v, int accumulate) {
    if (dtype == CL_F32) {
        float *p = (float *)out + i;
        if (accumulate)
            v = _mm256_add_ps(_mm256_loadu_ps(p), v);
        _mm256_storeu_ps(p, v);
    } else if (dtype == CL_F16) {
        uint16_t *p = (uint16_t *)out + i;
        if (accumulate)
            v = _mm256_add_ps(cl_ld8_f16(p), v);
        cv_st8_f16(p, v);
    } else {
        uint16_t *p = (uint16_t *)out + i;
        if (accumulate)
            v = _mm256_add_ps(cl_ld8_bf16(p), v);
        cl_st8_bf16(p, v);
    }
}

/* Elements [lo, lo + m) of one block with scale s_q into `out`. */
CV_INLINE void cv_decode_block(int kind, int dst, const cl_u8 *pay, size_t lo, size_t m, float s_q,
                               void *out, int accumulate) {
    const __m256 s = _mm256_set1_ps(s_q);
    size_t i = lo, end = lo + m;
    if (kind == CL_INT4 && (i & 1) && i < end) {
        cl_put(dst, out, i, cl_dequantize(kind, cl_code_at(kind, pay, i)) * s_q, accumulate);
        i++;
    }
    for (; i + 16 <= end; i += 16) {
        cv_put8(dst, out, i, _mm256_mul_ps(cv_deq8(kind, pay, i), s), accumulate);
        cv_put8(dst, out, i + 8, _mm256_mul_ps(cv_deq8(kind, pay, i + 8), s), accumulate);
    }
    for (; i + 8 <= end; i += 8)
        cv_put8(dst, out, i, _mm256_mul_ps(cv_deq8(kind, pay, i), s), accumulate);
    for (; i < end; i++)
        cl_put(dst, out, i, cl_dequantize(kind, cl_code_at(kind, pay, i)) * s_q, accumulate);
}
#endif

#endif
