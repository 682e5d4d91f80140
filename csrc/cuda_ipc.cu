// cuda_ipc.cu: one-shot and two-shot all-reduce over CUDA IPC buffers (commlib's cuda_ipc
// backend; host side in commlib/backends/cuda_ipc.py, loaded through CuPy RawModule).
//
// Requirements: GPUs of one node with peer access (a real P2P test runs first, see the host
// side), buffers registered through cudaIpcGetMemHandle / cudaIpcOpenMemHandle, byte counts a
// multiple of 16, world size <= CL_IPC_MAX_RANKS. Compiles with nvcc -arch=sm_80 / sm_90 (CI)
// and NVRTC.
//
// Design (as vLLM's custom all-reduce): every rank's buffer is readable by every rank. Each
// block synchronizes with the same block on every peer through per-block flags (no peer
// atomics: PCIe may not have them): block b of rank r writes `flag` into signal[peer].start[b][r]
// with a release store at system scope, then waits for signal[r].start[b][peer] == flag with
// acquire loads. `flag` grows by one per launch (host counter), so flags are never reset.
//
//  - one-shot: barrier, then every rank reduces all peers' inputs in rank order into its output:
//    identical bits on every rank; then an end barrier. Without it a fast rank could (a) stage its
//    next input over data a slow peer is still reading, and (b) publish the next launch's start
//    flag before the slow peer saw this one (the peer would wait for a value that never comes
//    back). Block b of every rank touches the same element indices, so per-block flags suffice;
//  - two-shot: barrier, rank r reduces slice r of all inputs into its tmp buffer, barrier
//    (end flags, after __threadfence_system), then every rank copies every peer's slice.
//
// float16 / bfloat16 accumulate in float32 and round once; the per-element math is
// csrc/reduce_math.h, the same code as the CPU path and tested on the host against torch.
#include "reduce_math.h"

#define CL_IPC_MAX_RANKS 8
#define CL_IPC_MAX_BLOCKS 64

struct ClSignal {
    unsigned int start[CL_IPC_MAX_BLOCKS][CL_IPC_MAX_RANKS];
    unsigned int end[CL_IPC_MAX_BLOCKS][CL_IPC_MAX_RANKS];
};

__device__ __forceinline__ void st_release_sys(unsigned int *addr, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int ld_acquire_sys(const unsigned int *addr) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
    return v;
}

// Block-level barrier with the same block of every peer. `end` selects the second flag set.
// The end barrier first waits for every thread of the block (their reads of the peers' buffers,
// or their writes followed by __threadfence_system, must come before the flag store).
__device__ __forceinline__ void block_barrier(ClSignal *const *sigs, int rank, int ngpus,
                                              unsigned int flag, bool end) {
    if (end)
        __syncthreads();
    if (threadIdx.x < ngpus) {
        int peer = threadIdx.x;
        unsigned int *to = end ? &sigs[peer]->end[blockIdx.x][rank]
                               : &sigs[peer]->start[blockIdx.x][rank];
        const unsigned int *mine = end ? &sigs[rank]->end[blockIdx.x][peer]
                                       : &sigs[rank]->start[blockIdx.x][peer];
        st_release_sys(to, flag);
        while (ld_acquire_sys(mine) != flag) {
        }
    }
    __syncthreads();
}

// Per-dtype load/store to and from the accumulation type (float for half types).
#define CL_LD_F32(p, i) (((const float *)(p))[i])
#define CL_ST_F32(p, i, v) (((float *)(p))[i] = (v))
#define CL_LD_F16(p, i) cl_f16_to_f32(((const cl_u16 *)(p))[i])
#define CL_ST_F16(p, i, v) (((cl_u16 *)(p))[i] = cl_f32_to_f16(v))
#define CL_LD_BF16(p, i) cl_bf16_to_f32(((const cl_u16 *)(p))[i])
#define CL_ST_BF16(p, i, v) (((cl_u16 *)(p))[i] = cl_f32_to_bf16(v))


// Reduce elements [lo, hi) of every peer's buffer (rank order) into dst; grid-stride loop.
#define CL_DEFINE_IPC(SUFFIX, LD, ST)                                                          \
    __device__ __forceinline__ void cl_reduce_range_##SUFFIX(                                  \
        void *dst, const unsigned long long *ptrs, int ngpus, size_t lo, size_t hi, int op,    \
        int avg) {                                                                             \
        for (size_t i = lo + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < hi;            \
             i += (size_t)gridDim.x * blockDim.x) {                                            \
            float acc = LD((const void *)ptrs[0], i);                                          \
            for (int j = 1; j < ngpus; j++) acc = cl_combinef(acc, LD((const void *)ptrs[j], i), op); \
            if (avg) acc = acc / (float)avg;                                                   \
            ST(dst, i, acc);                                                                   \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void cl_ipc_oneshot_##SUFFIX(                                        \
        const unsigned long long *ptrs, ClSignal *const *sigs, void *out, size_t n, int rank,  \
        int ngpus, unsigned int flag, int op, int avg) {                                       \
        block_barrier(sigs, rank, ngpus, flag, false);                                         \
        cl_reduce_range_##SUFFIX(out, ptrs, ngpus, 0, n, op, avg);                             \
        block_barrier(sigs, rank, ngpus, flag, true);                                          \
    }                                                                                          \
    extern "C" __global__ void cl_ipc_twoshot_##SUFFIX(                                        \
        const unsigned long long *ptrs, const unsigned long long *tmps, ClSignal *const *sigs, \
        void *out, size_t n, int rank, int ngpus, unsigned int flag, int op, int avg) {        \
        size_t per = (n + ngpus - 1) / ngpus;                                                  \
        size_t lo = per * rank < n ? per * rank : n;                                           \
        size_t hi = lo + per < n ? lo + per : n;                                               \
        block_barrier(sigs, rank, ngpus, flag, false);                                         \
        cl_reduce_range_##SUFFIX((void *)tmps[rank], ptrs, ngpus, lo, hi, op, avg);            \
        __threadfence_system();                                                                \
        block_barrier(sigs, rank, ngpus, flag, true);                                          \
        for (int j = 0; j < ngpus; j++) {                                                      \
            size_t a = per * j < n ? per * j : n, b = a + per < n ? a + per : n;               \
            for (size_t i = a + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < b;          \
                 i += (size_t)gridDim.x * blockDim.x)                                          \
                ST(out, i, LD((const void *)tmps[j], i));                                      \
        }                                                                                      \
    }

CL_DEFINE_IPC(f32, CL_LD_F32, CL_ST_F32)
CL_DEFINE_IPC(f16, CL_LD_F16, CL_ST_F16)
CL_DEFINE_IPC(bf16, CL_LD_BF16, CL_ST_BF16)
