// kernels.cu: the CUDA counterparts of commlib.kernels (reduce_many, cast_), loaded through CuPy
// RawModule by commlib/kernels/cuda.py. Per-element math: csrc/reduce_math.h (shared with the
// CPU path, whose host build is tested against torch in tests/test_kernels.py).
#include "reduce_math.h"


__device__ __forceinline__ double cl_kcombine_d(double a, double b, int op) {
    switch (op) {
    case CL_PROD: return a * b;
    case CL_MIN: return cl_mind(a, b);
    case CL_MAX: return cl_maxd(a, b);
    default: return a + b;
    }
}

// out[i] = srcs[0][i] op srcs[1][i] op ... (list order), AVG divided by `avg` before the one
// rounding; srcs is a device array of nsrc pointers.
#define CL_DEFINE_REDUCE(SUFFIX, T, ACC, LD, ST, COMBINE)                                     \
    extern "C" __global__ void cl_reduce_##SUFFIX(T *out, const unsigned long long *srcs,     \
                                                  int nsrc, size_t n, int op, int avg) {      \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;                 \
             i += (size_t)gridDim.x * blockDim.x) {                                           \
            ACC acc = LD(((const T *)srcs[0])[i]);                                            \
            for (int j = 1; j < nsrc; j++) acc = COMBINE(acc, LD(((const T *)srcs[j])[i]), op); \
            if (avg) acc = acc / (ACC)avg;                                                    \
            out[i] = ST(acc);                                                                 \
        }                                                                                     \
    }

#define CL_ID(x) (x)
CL_DEFINE_REDUCE(f32, float, float, CL_ID, CL_ID, cl_combinef)
CL_DEFINE_REDUCE(f64, double, double, CL_ID, CL_ID, cl_kcombine_d)
CL_DEFINE_REDUCE(f16, cl_u16, float, cl_f16_to_f32, cl_f32_to_f16, cl_combinef)
CL_DEFINE_REDUCE(bf16, cl_u16, float, cl_bf16_to_f32, cl_f32_to_bf16, cl_combinef)

// float32 <-> float16 / bfloat16 (round to nearest even down, exact up).
#define CL_DEFINE_CAST(name, To, From, conv)                                                     \
    extern "C" __global__ void cl_cast_##name(To *out, const From *in, size_t n) {             \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;                   \
             i += (size_t)gridDim.x * blockDim.x)                                               \
            out[i] = conv(in[i]);                                                               \
    }
CL_DEFINE_CAST(f32_f16, cl_u16, float, cl_f32_to_f16)
CL_DEFINE_CAST(f32_bf16, cl_u16, float, cl_f32_to_bf16)
CL_DEFINE_CAST(f16_f32, float, cl_u16, cl_f16_to_f32)
CL_DEFINE_CAST(bf16_f32, float, cl_u16, cl_bf16_to_f32)
