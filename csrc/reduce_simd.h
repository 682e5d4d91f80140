/* Vectorized SUM (and AVG) of float16 and bfloat16 for the CPU shared-memory path
 * (csrc/shm/reduce.c).
 *
 * Why: the portable per-element conversions of reduce_math.h do not vectorize (float16 has
 * branches for subnormals, inf and NaN), so a float16 reduction ran at ~1.6 GB/s and a bfloat16
 * one at ~13 GB/s against ~20 GB/s for float32 on this machine kind (EPYC, AVX-512). With AVX2 and
 * F16C the conversions are single instructions (float16) or a few integer ops (bfloat16).
 *
 * Same semantics as the scalar path, bit for bit: every source is widened to float32 exactly,
 * added in rank order (acc = s0 + s1 + ...; the same IEEE additions, no FMA), divided once by
 * `avg` when non-zero, and rounded once to nearest-even. NaN stays NaN (float16: the hardware
 * keeps the payload, the scalar path a canonical NaN; tests compare NaN-ness, as the torch
 * reference does not fix a payload either).
 *
 * Built with a target attribute and chosen at run time (cl_simd_usable), so the extension still
 * builds and runs on x86-64 CPUs without AVX2/F16C and on other architectures. */
#ifndef COMMLIB_REDUCE_SIMD_H
#define COMMLIB_REDUCE_SIMD_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CL_HAVE_SIMD 1
#define CL_V3 __attribute__((target("avx2,f16c")))

static int cl_simd_usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

CL_V3 static inline __m256 cl_ld8_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

CL_V3 static inline void cl_st8_f16(uint16_t *p, __m256 v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

CL_V3 static inline __m256 cl_ld8_bf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* cl_f32_to_bf16 on 8 lanes: NaN -> 0x7fc0, else round to nearest even. */
CL_V3 static inline void cl_st8_bf16(uint16_t *p, __m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    /* every lane is in [0, 0xffff]: the unsigned-saturating pack keeps it as is */
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}

/* out = (srcs[0] + srcs[1] + ... ) [/ avg], and the same into out2 when it is not NULL; 32
 * elements per iteration in four independent accumulators, the tail through the scalar
 * conversions. */
#define DEFINE_SIMD_SUM(NAME, LD8, ST8, LD1, ST1)                                             \
    CL_V3 __attribute__((unused)) static void NAME(char *out, char *out2, char *const *srcs,  \
                           int ns, size_t len, int avg) {                                     \
        const uint16_t *s0 = (const uint16_t *)srcs[0];                                       \
        uint16_t *d = (uint16_t *)out;                                                        \
        const __m256 div = _mm256_set1_ps((float)avg);                                        \
        size_t i = 0;                                                                         \
        for (; i + 32 <= len; i += 32) {                                                      \
            __m256 a0 = LD8(s0 + i), a1 = LD8(s0 + i + 8);                                    \
            __m256 a2 = LD8(s0 + i + 16), a3 = LD8(s0 + i + 24);                              \
            for (int j = 1; j < ns; j++) {                                                    \
                const uint16_t *sj = (const uint16_t *)srcs[j] + i;                           \
                a0 = _mm256_add_ps(a0, LD8(sj));                                              \
                a1 = _mm256_add_ps(a1, LD8(sj + 8));                                          \
                a2 = _mm256_add_ps(a2, LD8(sj + 16));                                         \
                a3 = _mm256_add_ps(a3, LD8(sj + 24));                                         \
            }                                                                                 \
            if (avg) {                                                                        \
                a0 = _mm256_div_ps(a0, div);                                                  \
                a1 = _mm256_div_ps(a1, div);                                                  \
                a2 = _mm256_div_ps(a2, div);                                                  \
                a3 = _mm256_div_ps(a3, div);                                                  \
            }                                                                                 \
            ST8(d + i, a0);                                                                   \
            ST8(d + i + 8, a1);                                                               \
            ST8(d + i + 16, a2);                                                              \
            ST8(d + i + 24, a3);                                                              \
            if (out2)                                                                         \
                memcpy((uint16_t *)out2 + i, d + i, 32 * sizeof(uint16_t));                   \
        }                                                                                     \
        for (; i < len; i++) {                                                                \
            float acc = LD1(s0[i]);                                                           \
            for (int j = 1; j < ns; j++) acc += LD1(((const uint16_t *)srcs[j])[i]);          \
            d[i] = ST1(avg ? acc / (float)avg : acc);                                         \
            if (out2)                                                                         \
                ((uint16_t *)out2)[i] = d[i];                                                 \
        }                                                                                     \
    }

DEFINE_SIMD_SUM(sum_f16_simd, cl_ld8_f16, cl_st8_f16, cl_f16_to_f32, cl_f32_to_f16)
DEFINE_SIMD_SUM(sum_bf16_simd, cl_ld8_bf16, cl_st8_bf16, cl_bf16_to_f32, cl_f32_to_bf16)

#else
static int cl_simd_usable(void) { return 0; }
#endif

#endif
