/* Copies for the CPU shared-memory path (csrc/shm/protocol.c): plain memcpy, or with non-temporal
 * (streaming) stores for destinations that will not be read again soon and are too large for the
 * caches anyway, such as the output of a large all-gather.
 *
 * Why: a normal store first reads the destination's cache line (read for ownership), so a copy
 * whose destination misses every cache moves three bytes of memory traffic per byte copied; a
 * streaming store writes the line without reading it, two bytes per byte. Streaming stores are
 * wrong for data a peer reads next (the shared regions: they would go to memory and be read back
 * from it) and for destinations that fit in cache (they evict them): callers choose per copy.
 *
 * SSE2 (baseline on x86-64); elsewhere memcpy. Streaming stores are weakly ordered: cl_nt_fence()
 * (sfence) orders them before the stores that follow, such as the flag that publishes a step. */
#ifndef COMMLIB_COPY_NT_H
#define COMMLIB_COPY_NT_H

#include <stdint.h>
#include <string.h>

/* The output size (bytes) from which copies into it stream, unless Segment.nt_min says otherwise:
 * measured in bench/README.md (all_gather at 2 ranks). */
#define CL_NT_MIN_DEFAULT (16L << 20)

/* Bytes copied to two destinations one piece at a time, the source read once (in L1). */
#define CL_COPY_PIECE ((size_t)16384)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>

static inline void cl_nt_fence(void) { _mm_sfence(); }

/* memcpy(dst, src, n) with streaming stores for the 16-byte-aligned middle of dst. */
static void cl_copy_nt(char *dst, const char *src, size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (n < head + 256) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
}
#define CL_HAVE_NT 1
#else
static inline void cl_nt_fence(void) {}
static void cl_copy_nt(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
#define CL_HAVE_NT 0
#endif

/* memcpy, or cl_copy_nt when `nt`. */
static inline void cl_copy(char *dst, const char *src, size_t n, int nt) {
    if (nt)
        cl_copy_nt(dst, src, n);
    else
        memcpy(dst, src, n);
}

#endif
