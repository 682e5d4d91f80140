/* The reductions of commlib.transports._shm: one kernel per dtype (out = srcs[0] op srcs[1] op ..., in
 * blocks that stay in L1), the float16/bfloat16 SUM/AVG switch to the vectorized kernels of
 * reduce_simd.h (use_simd), and the dispatch table DTYPES (dtype code -> element size,
 * reduction). The per-element math is reduce_math.h, shared with the CUDA kernels. Part of the
 * unity build of module.c (see shm.h). */
#include "shm.h"

#define CL_BLK 512 /* elements per reduction block (stays in L1) */

/* Every kernel is a reduce_fn (shm.h): out[i] = srcs[0][i] op srcs[1][i] op ... (rank order,
 * accumulation type ACC), divided by `avg` when it is non-zero, converted back to T once, and
 * copied to `out2` too when that is not NULL (the two-shot's reduced slice: to the rank's output
 * and to its region for the peers).
 * Blocks of CL_BLK elements keep the accumulator in L1 and let the compiler vectorize each
 * (accumulator, source) stream. No `restrict`: a source may be the output itself (the two-shot
 * and the reduce-scatter read the rank's own part from its input, which an in-place call also
 * writes); every element is read before it is written, and the accumulator is a local array. */
#define LD_ID(x) (x)
#define ST_ID(x) (x)
#define LD_F16(x) cl_f16_to_f32(x)
#define ST_F16(x) cl_f32_to_f16(x)
#define LD_BF16(x) cl_bf16_to_f32(x)
#define ST_BF16(x) cl_f32_to_bf16(x)

#define DEFINE_FLOAT_REDUCE(NAME, T, ACC, LD, ST, MINF, MAXF)                                 \
    static void NAME(char *out, char *out2, char *const *srcs, int ns, size_t len, int op,   \
                     int avg) {                                                               \
        ACC acc[CL_BLK];                                                                      \
        for (size_t o = 0; o < len; o += CL_BLK) {                                            \
            size_t m = len - o < CL_BLK ? len - o : CL_BLK;                                   \
            const T *s0 = (const T *)srcs[0] + o;                                             \
            for (size_t i = 0; i < m; i++) acc[i] = LD(s0[i]);                                \
            for (int j = 1; j < ns; j++) {                                                    \
                const T *sj = (const T *)srcs[j] + o;                                         \
                if (op == CL_SUM) {                                                           \
                    for (size_t i = 0; i < m; i++) acc[i] += LD(sj[i]);                       \
                } else if (op == CL_PROD) {                                                   \
                    for (size_t i = 0; i < m; i++) acc[i] *= LD(sj[i]);                       \
                } else if (op == CL_MIN) {                                                    \
                    for (size_t i = 0; i < m; i++) acc[i] = MINF(acc[i], LD(sj[i]));          \
                } else {                                                                      \
                    for (size_t i = 0; i < m; i++) acc[i] = MAXF(acc[i], LD(sj[i]));          \
                }                                                                             \
            }                                                                                 \
            T *d = (T *)out + o;                                                              \
            if (avg) {                                                                        \
                ACC div = (ACC)avg;                                                           \
                for (size_t i = 0; i < m; i++) d[i] = ST(acc[i] / div);                       \
            } else {                                                                          \
                for (size_t i = 0; i < m; i++) d[i] = ST(acc[i]);                             \
            }                                                                                 \
            if (out2)                                                                         \
                memcpy((T *)out2 + o, d, m * sizeof(T));                                      \
        }                                                                                     \
    }

/* Integers wrap: SUM and PRODUCT run on the unsigned type U (at least 32 bits, so that the
 * promotion of 8/16-bit operands cannot overflow a signed int). */
#define EACH(STMT) do { for (size_t i = 0; i < m; i++) { STMT; } } while (0)

#define DEFINE_INT_REDUCE(NAME, T, U)                                                         \
    static void NAME(char *out, char *out2, char *const *srcs, int ns, size_t len, int op,   \
                     int avg) {                                                               \
        (void)avg;                                                                            \
        T acc[CL_BLK];                                                                        \
        for (size_t o = 0; o < len; o += CL_BLK) {                                            \
            size_t m = len - o < CL_BLK ? len - o : CL_BLK;                                   \
            const T *s0 = (const T *)srcs[0] + o;                                             \
            EACH(acc[i] = s0[i]);                                                             \
            for (int j = 1; j < ns; j++) {                                                    \
                const T *sj = (const T *)srcs[j] + o;                                         \
                switch (op) {                                                                 \
                case CL_SUM: EACH(acc[i] = (T)((U)acc[i] + (U)sj[i])); break;                 \
                case CL_PROD: EACH(acc[i] = (T)((U)acc[i] * (U)sj[i])); break;                \
                case CL_MIN: EACH(acc[i] = sj[i] < acc[i] ? sj[i] : acc[i]); break;           \
                case CL_MAX: EACH(acc[i] = sj[i] > acc[i] ? sj[i] : acc[i]); break;           \
                case CL_BAND: EACH(acc[i] &= sj[i]); break;                                   \
                case CL_BOR: EACH(acc[i] |= sj[i]); break;                                    \
                default: EACH(acc[i] ^= sj[i]); break;                                        \
                }                                                                             \
            }                                                                                 \
            memcpy((T *)out + o, acc, m * sizeof(T));                                         \
            if (out2)                                                                         \
                memcpy((T *)out2 + o, acc, m * sizeof(T));                                    \
        }                                                                                     \
    }

DEFINE_FLOAT_REDUCE(reduce_f32, float, float, LD_ID, ST_ID, cl_minf, cl_maxf)
DEFINE_FLOAT_REDUCE(reduce_f64, double, double, LD_ID, ST_ID, cl_mind, cl_maxd)
DEFINE_FLOAT_REDUCE(reduce_f16_scalar, uint16_t, float, LD_F16, ST_F16, cl_minf, cl_maxf)
DEFINE_FLOAT_REDUCE(reduce_bf16_scalar, uint16_t, float, LD_BF16, ST_BF16, cl_minf, cl_maxf)

/* 1: SUM/AVG of float16/bfloat16 take the vectorized kernels of reduce_simd.h (set at import
 * from the CPU's features; commlib.transports._shm.simd() reads or changes it, for tests). */
static int use_simd;

#ifdef CL_HAVE_SIMD
#define DEFINE_HALF_REDUCE(NAME, SIMD, SCALAR)                                                \
    static void NAME(char *out, char *out2, char *const *srcs, int ns, size_t len, int op,   \
                     int avg) {                                                               \
        if (use_simd && op == CL_SUM)                                                         \
            SIMD(out, out2, srcs, ns, len, avg);                                              \
        else                                                                                  \
            SCALAR(out, out2, srcs, ns, len, op, avg);                                        \
    }
DEFINE_HALF_REDUCE(reduce_f16, sum_f16_simd, reduce_f16_scalar)
DEFINE_HALF_REDUCE(reduce_bf16, sum_bf16_simd, reduce_bf16_scalar)
#else
#define reduce_f16 reduce_f16_scalar
#define reduce_bf16 reduce_bf16_scalar
#endif
DEFINE_INT_REDUCE(reduce_i8, int8_t, uint32_t)
DEFINE_INT_REDUCE(reduce_u8, uint8_t, uint32_t)
DEFINE_INT_REDUCE(reduce_i16, int16_t, uint32_t)
DEFINE_INT_REDUCE(reduce_i32, int32_t, uint32_t)
DEFINE_INT_REDUCE(reduce_i64, int64_t, uint64_t)

/* dtype code -> (element size, reduction, floating); indexed by the CL_* dtype codes */
static const dtype_info DTYPES[CL_NDTYPES] = {
    [CL_F32] = {4, reduce_f32, 1}, [CL_F64] = {8, reduce_f64, 1},
    [CL_F16] = {2, reduce_f16, 1}, [CL_BF16] = {2, reduce_bf16, 1},
    [CL_I8] = {1, reduce_i8, 0},   [CL_U8] = {1, reduce_u8, 0},
    [CL_I16] = {2, reduce_i16, 0}, [CL_I32] = {4, reduce_i32, 0},
    [CL_I64] = {8, reduce_i64, 0},
};
