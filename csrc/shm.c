/* commlib._shm: the shared-memory collectives of ranks on one host (CPython extension).
 *
 * Why compiled: on this machine kind an 8-byte all-reduce through MPI takes ~5 us; a Python
 * implementation spends more than that in the interpreter alone. Here the copy-in, the flag
 * handshake and the reduction are one C call (a pre-bound ShmOp called with no arguments).
 *
 * Segment layout (one POSIX shared-memory object per group, created by group rank 0, mapped by
 * every rank, and unlinked as soon as all ranks have mapped it, so that nothing is left in
 * /dev/shm even when a rank is killed):
 *
 *   header: magic, nranks, slot bytes, data offset, the pid of every rank
 *   flags:  one 128-byte line per rank: its step counter, its read counter (the last step it
 *           has finished reading) and, per parity, where its data of the step is
 *   data:   2 regions ("parities") of `slot` bytes per rank
 *
 * Protocol. Every collective is a sequence of steps numbered 1, 2, 3, ... on the group (the same
 * numbers on every rank, since ranks issue collectives in the same order). In step s a rank
 *   1. writes its contribution into its own region of parity s & 1,
 *   2. publishes flag[rank] = s with a release store,
 *   3. waits until flag[j] >= s for every rank j (acquire loads), and
 *   4. reads the peers' regions of parity s & 1 (reduce or copy into its output).
 * Step s + 2 reuses the region of step s. That is safe without a closing barrier: a rank writes
 * step s + 2 only after completing step s + 1, i.e. after seeing every peer publish s + 1, and a
 * peer publishes s + 1 only after it finished reading step s. Release/acquire on the flags orders
 * the data writes before the flag on every architecture (no reliance on x86's store order).
 *
 * Shared buffers (Segment.share, commlib.shared_empty): memory every rank of the group maps.
 * When the data a rank provides (the all-gather's or reduce-scatter's input, the broadcast root's
 * buffer) lies in one, each step publishes where its data is (buffer and offset, in the flag
 * line, before the release store of the step) instead of copying it into the region, and the
 * peers read it in place: one copy instead of two. The buffer belongs to the caller again when
 * the operation returns, so that rank completes only once every peer's read counter (stored with
 * release after its reads of a step) has reached the operation's last step.
 *
 * Operations are resumable state machines (ShmOp): progress() advances as far as possible without
 * blocking, so the same code serves a blocking call (spin briefly, then sched_yield with the GIL
 * released, because ranks may outnumber cores) and an asynchronous one (Test() polls). The
 * operations of a segment complete in issue order: each segment keeps a FIFO of started
 * operations and progressing one progresses the ones issued before it.
 *
 * A peer that dies is detected while waiting (kill(pid, 0) on the peers whose flag is behind):
 * the waiting rank raises instead of spinning forever.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#endif

#include "reduce_math.h"
#include "reduce_simd.h"
#include "copy_nt.h"

#define CL_MAX_RANKS 64
#define CL_LINE 128
#define CL_MAGIC 0x31626c6d6d6f63ULL /* "commlb1" */
#define CL_BLK 512                   /* elements per reduction block (stays in L1) */

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

typedef struct {
    _Atomic uint64_t step;
    _Atomic uint32_t waiters;     /* ranks asleep in futex_wait on `step` */
    _Atomic uint32_t ack_waiters; /* ranks asleep in futex_wait on `read_step` */
    _Atomic uint64_t read_step;   /* the last step whose reads this rank has finished */
    /* Per parity: where the peers find this rank's data of the step, when it is not in the
     * rank's region: shared buffer `buf - 1` (an index of Segment.share; 0, as in the new
     * segment: the region) at byte `off`. Plain fields, published by the release store of
     * `step`. */
    int64_t buf[2];
    uint64_t off[2];
    char pad[CL_LINE - 6 * sizeof(uint64_t)];
} flag_t;

/* ----- sleeping on a flag ------------------------------------------------------------------ */
/* A rank that has spun long enough sleeps in FUTEX_WAIT on the low 32 bits of the flag it waits
 * for; the owner of that flag wakes it after publishing a step. Measured on 4 ranks over 2 cores:
 * sched_yield hands the core to whichever task is next (often another waiting rank), while a
 * sleeping waiter leaves it to the rank that has work (see docs/shm.md, "Waiting").
 * No lost wake-up: the waiter increments `waiters` then re-reads the flag, the owner stores the
 * flag then reads `waiters`, all sequentially consistent, so one of them sees the other; and the
 * kernel re-checks the flag word before sleeping. Sleeps are bounded (CL_SLEEP_NS) so that dead
 * peers and signals are still noticed. */
#define CL_SLEEP_NS 2000000L
#ifdef __linux__
static inline uint32_t *low_word(_Atomic uint64_t *w) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)w + 1;
#else
    return (uint32_t *)w;
#endif
}

/* Wake the ranks asleep on counter `w` (`waiters` of them), after storing it. */
static void word_wake(_Atomic uint64_t *w, _Atomic uint32_t *waiters) {
    if (atomic_load_explicit(waiters, memory_order_seq_cst) != 0)
        syscall(SYS_futex, low_word(w), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Sleep until counter `w` may have reached `need` (or CL_SLEEP_NS passed). */
static void word_sleep(_Atomic uint64_t *w, _Atomic uint32_t *waiters, uint64_t need) {
    atomic_fetch_add_explicit(waiters, 1, memory_order_seq_cst);
    uint64_t seen = atomic_load_explicit(w, memory_order_seq_cst);
    if (seen < need) {
        struct timespec ts = {0, CL_SLEEP_NS};
        syscall(SYS_futex, low_word(w), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
    }
    atomic_fetch_sub_explicit(waiters, 1, memory_order_seq_cst);
}
#else
static void word_wake(_Atomic uint64_t *w, _Atomic uint32_t *waiters) { (void)w, (void)waiters; }
static void word_sleep(_Atomic uint64_t *w, _Atomic uint32_t *waiters, uint64_t need) {
    (void)w, (void)waiters, (void)need;
    sched_yield();
}
#endif

typedef struct {
    uint64_t magic;
    uint64_t nranks;
    uint64_t slot;
    uint64_t data_off;
    int32_t pid[CL_MAX_RANKS];
} header_t;

#define CL_FLAGS_OFF 512 /* sizeof(header_t) rounded up to a multiple of CL_LINE */
#define CL_DATA_OFF ((CL_FLAGS_OFF + CL_MAX_RANKS * CL_LINE + 4095) & ~(size_t)4095)

/* ----- reductions -------------------------------------------------------------------------- */
/* out[i] = srcs[0][i] op srcs[1][i] op ... (rank order, accumulation type ACC), divided by
 * `avg` when it is non-zero, converted back to T once, and copied to `out2` too when that is not
 * NULL (the two-shot's reduced slice: to the rank's output and to its region for the peers).
 * Blocks of CL_BLK elements keep the accumulator in L1 and let the compiler vectorize each
 * (accumulator, source) stream. No `restrict`: a source may be the output itself (the two-shot
 * and the reduce-scatter read the rank's own part from its input, which an in-place call also
 * writes); every element is read before it is written, and the accumulator is a local array. */
typedef void (*reduce_fn)(char *out, char *out2, char *const *srcs, int ns, size_t len, int op,
                          int avg);

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
 * from the CPU's features; commlib._shm.simd() reads or changes it, for tests). */
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

/* dtype code -> (element size, reduction); indexed by the CL_* dtype codes */
static const struct { size_t size; reduce_fn reduce; int floating; } DTYPES[CL_NDTYPES] = {
    [CL_F32] = {4, reduce_f32, 1}, [CL_F64] = {8, reduce_f64, 1},
    [CL_F16] = {2, reduce_f16, 1}, [CL_BF16] = {2, reduce_bf16, 1},
    [CL_I8] = {1, reduce_i8, 0},   [CL_U8] = {1, reduce_u8, 0},
    [CL_I16] = {2, reduce_i16, 0}, [CL_I32] = {4, reduce_i32, 0},
    [CL_I64] = {8, reduce_i64, 0},
};

/* ----- objects ----------------------------------------------------------------------------- */
enum { K_AR1 = 0, K_AR2 = 1, K_RS = 2, K_AG = 3, K_BC = 4, K_NKINDS = 5 };
static const char *const KIND_NAMES[K_NKINDS] = {
    "all_reduce", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast"};
static const int STEPS_PER_CHUNK[K_NKINDS] = {1, 2, 1, 1, 1};

typedef struct ShmOp ShmOp;

typedef struct {
    PyObject_HEAD
    char *base;
    size_t maplen;
    header_t *hdr;
    flag_t *flags;
    char *data;
    int n, rank;
    size_t slot;
    long spin;         /* polls before giving the core away */
    long yield_us;     /* then sched_yield for this long before sleeping (sleep == 1) */
    int sleep;         /* 1: wait in futex on the lagging flag; 0: sched_yield */
    long nt_min;       /* outputs of at least this many bytes are written with streaming stores */
    int64_t next_step; /* first step of the next operation issued */
    int64_t done_step; /* last step this rank has completed (read) */
    ShmOp **fifo;      /* started, unfinished operations in issue order (strong references) */
    Py_ssize_t fifo_head, fifo_len, fifo_cap;
    int broken;
    PyObject *broken_msg;
    PyObject *error_cls; /* raised when a peer died or the segment is unusable */
    PyObject *name;      /* the group's name, for messages */
    /* Shared buffers (Segment.share): buffer k of rank j is mapped here at shared[k * n + j],
     * `shared_len[k]` bytes; 0 once this rank's own buffer k is gone (its address may be reused). */
    char **shared;
    size_t *shared_len;
    Py_ssize_t nshared;
} Segment;

enum { OP_NEW = 0, OP_RUNNING = 1, OP_DONE = 2 };

struct ShmOp {
    PyObject_HEAD
    Segment *seg;
    int kind, dtype, op, avg, root;
    char *in, *out;
    size_t count, es, chunk, nchunks;
    int64_t s0, total, cur;
    int phase; /* 0: write and publish step s0 + cur next; 1: wait for the peers */
    int nt;    /* copies into the output use streaming stores (a large output: see copy_nt.h) */
    int64_t shared;    /* the shared buffer holding the data this rank provides, or -1 */
    size_t shared_off; /* its byte offset in that buffer */
    int state;
    unsigned long polls;
};

static PyTypeObject SegmentType;
static PyTypeObject ShmOpType;

static inline char *region(Segment *g, int r, int parity) {
    return g->data + ((size_t)r * 2 + (size_t)parity) * g->slot;
}

/* The part [a, b) of a chunk of `len` elements that rank j reduces in a two-shot all-reduce:
 * equal slices rounded up to 16 elements (whole cache lines for 4-byte types). */
static inline void slice_of(size_t len, int n, int j, size_t *a, size_t *b) {
    size_t per = (len + (size_t)n - 1) / (size_t)n;
    per = (per + 15) & ~(size_t)15;
    size_t lo = per * (size_t)j, hi = lo + per;
    *a = lo < len ? lo : len;
    *b = hi < len ? hi : len;
}

/* This rank's block of the all-gather's output, from element `lo`. */
static inline char *own_out(ShmOp *op, size_t lo) {
    return op->out + ((size_t)op->seg->rank * op->count + lo) * op->es;
}

/* The all-gather's own `len` elements from `lo`: input to output (nothing in place). */
static inline void copy_own(ShmOp *op, size_t lo, size_t len) {
    char *dst = own_out(op, lo), *src = op->in + lo * op->es;
    if (dst != src) /* in place: the input is this part of the output already */
        cl_copy(dst, src, len * op->es, op->nt);
}

/* Publish where the peers find this rank's data of the step of parity `p`: byte `off` of the
 * source in its shared buffer (returns 1: nothing to copy), or its region (returns 0). */
static inline int publish_data(ShmOp *op, int p, size_t off) {
    flag_t *f = &op->seg->flags[op->seg->rank];
    f->buf[p] = op->shared + 1;
    f->off[p] = op->shared_off + off;
    return op->shared >= 0;
}

/* Rank j's data of the step of parity `p`: in its shared buffer at the published offset plus
 * `extra`, or in its region plus `region_off`. */
static inline char *peer_data(Segment *g, int j, int p, size_t extra, size_t region_off) {
    flag_t *f = &g->flags[j];
    int64_t k = f->buf[p] - 1;
    return k >= 0 ? g->shared[k * g->n + j] + f->off[p] + extra : region(g, j, p) + region_off;
}

static void do_write(ShmOp *op, int64_t idx) {
    Segment *g = op->seg;
    int spc = STEPS_PER_CHUNK[op->kind];
    size_t c = (size_t)(idx / spc), sub = (size_t)(idx % spc);
    int p = (int)((op->s0 + idx) & 1);
    size_t lo = c * op->chunk, es = op->es;
    size_t len = op->count - lo < op->chunk ? op->count - lo : op->chunk;
    char *mine = region(g, g->rank, p);
    switch (op->kind) {
    case K_AR1:
        memcpy(mine, op->in + lo * es, len * es);
        break;
    case K_AG: { /* my block into my region; with streaming stores (a large output: memory
                  * bound) also into my part of the output, in pieces that stay in L1 between the
                  * two copies (the input is read once); else that copy follows the flag
                  * (do_own), while the peers copy their blocks in. An input in a shared buffer
                  * is read in place by the peers. With streaming stores my copy of it comes
                  * first, so that the peers read it from my cache and not from memory a second
                  * time (measured at 2 ranks: 32-256 MiB took 10-20% longer than the two-copy
                  * path with the copy after the flag, 14-18% less with it before); in cache
                  * (do_own) it does not matter. */
        if (publish_data(op, p, lo * es)) {
            if (op->nt)
                copy_own(op, lo, len);
            break;
        }
        char *src = op->in + lo * es;
        if (!op->nt) {
            memcpy(mine, src, len * es);
            break;
        }
        char *dst = own_out(op, lo);
        for (size_t at = 0, nb = len * es; at < nb; at += CL_COPY_PIECE) {
            size_t m = nb - at < CL_COPY_PIECE ? nb - at : CL_COPY_PIECE;
            memcpy(mine + at, src + at, m);
            if (dst != src) /* in place: the input is this part of the output already */
                cl_copy_nt(dst + at, src + at, m);
        }
        break;
    }
    case K_AR2:
        if (sub == 0) { /* the slices the peers reduce; my own slice is read from my input */
            for (int j = 0; j < g->n; j++) {
                size_t a, b;
                slice_of(len, g->n, j, &a, &b);
                if (j != g->rank && b > a)
                    memcpy(mine + a * es, op->in + (lo + a) * es, (b - a) * es);
            }
        }
        break; /* sub 1: the reduced slice was written while reading sub 0 */
    case K_RS: /* the parts the peers reduce (in place when the input is in a shared buffer);
                * mine is read from my input */
        if (publish_data(op, p, lo * es))
            break;
        for (int j = 0; j < g->n; j++)
            if (j != g->rank)
                memcpy(mine + (size_t)j * op->chunk * es,
                       op->in + ((size_t)j * op->count + lo) * es, len * es);
        break;
    case K_BC:
        if (g->rank == op->root && !publish_data(op, p, lo * es))
            memcpy(mine, op->out + lo * es, len * es);
        break;
    }
}

/* Work of step `idx` that needs no peer, done after publishing it: the all-gather's own block
 * into the output when do_write did not already. */
static void do_own(ShmOp *op, int64_t idx) {
    if (op->kind != K_AG || op->nt)
        return;
    size_t lo = (size_t)idx * op->chunk;
    copy_own(op, lo, op->count - lo < op->chunk ? op->count - lo : op->chunk);
}

static void do_read(ShmOp *op, int64_t idx) {
    Segment *g = op->seg;
    int n = g->n, me = g->rank;
    int spc = STEPS_PER_CHUNK[op->kind];
    size_t c = (size_t)(idx / spc), sub = (size_t)(idx % spc);
    int p = (int)((op->s0 + idx) & 1);
    size_t lo = c * op->chunk, es = op->es;
    size_t len = op->count - lo < op->chunk ? op->count - lo : op->chunk;
    char *srcs[CL_MAX_RANKS];
    reduce_fn reduce = DTYPES[op->dtype].reduce;
    switch (op->kind) {
    case K_AR1:
        for (int j = 0; j < n; j++) srcs[j] = region(g, j, p);
        reduce(op->out + lo * es, NULL, srcs, n, len, op->op, op->avg);
        break;
    case K_AR2: {
        size_t a, b;
        if (sub == 0) { /* reduce my slice of every rank's chunk into my output and my next
                         * region (in rank order, my own part from my input: the same sources
                         * in the same order on every rank) */
            slice_of(len, n, me, &a, &b);
            if (b > a) {
                for (int j = 0; j < n; j++)
                    srcs[j] = j == me ? op->in + (lo + a) * es : region(g, j, p) + a * es;
                reduce(op->out + (lo + a) * es, region(g, me, p ^ 1) + a * es, srcs, n, b - a,
                       op->op, op->avg);
            }
        } else { /* gather the peers' reduced slices */
            for (int j = 0; j < n; j++) {
                slice_of(len, n, j, &a, &b);
                if (j != me && b > a)
                    memcpy(op->out + (lo + a) * es, region(g, j, p) + a * es, (b - a) * es);
            }
        }
        break;
    }
    case K_RS:
        for (int j = 0; j < n; j++)
            srcs[j] = j == me ? op->in + ((size_t)me * op->count + lo) * es
                              : peer_data(g, j, p, (size_t)me * op->count * es,
                                          (size_t)me * op->chunk * es);
        reduce(op->out + lo * es, NULL, srcs, n, len, op->op, op->avg);
        break;
    case K_AG: /* the peers' blocks (mine: do_write or do_own) */
        for (int j = 0; j < n; j++)
            if (j != me)
                cl_copy(op->out + ((size_t)j * op->count + lo) * es, peer_data(g, j, p, 0, 0),
                        len * es, op->nt);
        break;
    case K_BC:
        if (me != op->root)
            memcpy(op->out + lo * es, peer_data(g, op->root, p, 0, 0), len * es);
        break;
    }
    if (op->nt)
        cl_nt_fence(); /* the streaming stores land before the op reports this step done */
}

/* A peer that has not finished reading step `s`, or -1. */
static int lagging_reader(Segment *g, uint64_t s) {
    for (int j = 0; j < g->n; j++)
        if (atomic_load_explicit(&g->flags[j].read_step, memory_order_acquire) < s)
            return j;
    return -1;
}

/* Advance `op` as far as possible without blocking (no Python API: may run without the GIL).
 * Returns 1 when it is done. */
static int advance(ShmOp *op) {
    Segment *g = op->seg;
    while (op->cur < op->total) {
        int64_t s = op->s0 + op->cur;
        if (op->phase == 0) {
            if (g->done_step != s - 1)
                return 0; /* an earlier operation of this segment is still running */
            do_write(op, op->cur);
            flag_t *mine = &g->flags[g->rank];
            atomic_store_explicit(&mine->step, (uint64_t)s, memory_order_seq_cst);
            word_wake(&mine->step, &mine->waiters);
            do_own(op, op->cur);
            op->phase = 1;
        }
        for (int j = 0; j < g->n; j++)
            if (atomic_load_explicit(&g->flags[j].step, memory_order_acquire) < (uint64_t)s)
                return 0;
        do_read(op, op->cur);
        flag_t *mine = &g->flags[g->rank];
        atomic_store_explicit(&mine->read_step, (uint64_t)s, memory_order_seq_cst);
        word_wake(&mine->read_step, &mine->ack_waiters);
        g->done_step = s;
        op->phase = 0;
        op->cur++;
    }
    /* The peers read my shared buffer in place: it stays untouched until they have all finished
     * reading (the caller may write it as soon as the operation returns). */
    if (op->shared >= 0 && lagging_reader(g, (uint64_t)(op->s0 + op->total - 1)) >= 0)
        return 0;
    op->state = OP_DONE;
    return 1;
}

/* Progress the segment's FIFO up to `op`; 1 when `op` is done. No Python API. */
static int progress(ShmOp *op) {
    Segment *g = op->seg;
    while (g->fifo_head < g->fifo_len) {
        ShmOp *o = g->fifo[g->fifo_head];
        if (o->state == OP_DONE || advance(o)) {
            g->fifo_head++;
            if (o == op)
                return 1;
            continue;
        }
        return 0;
    }
    return op->state == OP_DONE;
}

/* Drop the references of finished operations (needs the GIL). */
static void sweep(Segment *g) {
    if (g->fifo_head == 0)
        return;
    Py_ssize_t head = g->fifo_head, len = g->fifo_len;
    ShmOp **done = g->fifo;
    Py_ssize_t k = 0;
    ShmOp *tmp[64];
    /* move the live tail to the front first: a DECREF may run arbitrary code */
    Py_ssize_t ndone = head;
    ShmOp **dead = ndone <= 64 ? tmp : PyMem_Malloc(sizeof(ShmOp *) * (size_t)ndone);
    if (dead == NULL)
        return;
    memcpy(dead, done, sizeof(ShmOp *) * (size_t)ndone);
    for (Py_ssize_t i = head; i < len; i++) g->fifo[k++] = g->fifo[i];
    g->fifo_head = 0;
    g->fifo_len = k;
    for (Py_ssize_t i = 0; i < ndone; i++) Py_DECREF(dead[i]);
    if (dead != tmp)
        PyMem_Free(dead);
}

/* Whether process `pid` has ended: gone (ESRCH), or a zombie its parent has not reaped yet
 * (kill(pid, 0) still succeeds on those; /proc/<pid>/stat says 'Z' or 'X'). */
static int process_ended(pid_t pid) {
    if (kill(pid, 0) == -1)
        return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return 0; /* no /proc: only ESRCH can tell */
    ssize_t k = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (k <= 0)
        return 0;
    buf[k] = 0;
    const char *paren = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return paren != NULL && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

/* A peer whose flag is below `need` and whose process is gone, or -1. */
static int dead_peer(Segment *g, uint64_t need) {
    for (int j = 0; j < g->n; j++) {
        if (j == g->rank)
            continue;
        if (atomic_load_explicit(&g->flags[j].step, memory_order_acquire) >= need)
            continue;
        pid_t pid = (pid_t)g->hdr->pid[j];
        if (pid > 0 && process_ended(pid))
            return j;
    }
    return -1;
}

static PyObject *raise_broken(Segment *g) {
    PyErr_SetObject(g->error_cls, g->broken_msg);
    return NULL;
}

static int fail_dead(ShmOp *op, int j) {
    Segment *g = op->seg;
    PyObject *msg = PyUnicode_FromFormat(
        "commlib.%s: rank %d of group %R (pid %d) exited during a shared-memory collective "
        "(step %lld); rank %d cannot complete it. Fix: see that rank's own error output for why "
        "it died, and restart the job",
        KIND_NAMES[op->kind], j, g->name, (int)g->hdr->pid[j],
        (long long)(op->s0 + op->cur), g->rank);
    if (msg == NULL)
        return -1;
    g->broken = 1;
    Py_XSETREF(g->broken_msg, msg);
    Py_INCREF(msg);
    PyErr_SetObject(g->error_cls, msg);
    Py_DECREF(msg);
    return -1;
}

static int check_usable(Segment *g) {
    if (g->base == NULL) {
        PyErr_Format(g->error_cls, "commlib: the shared-memory segment of group %R is closed "
                     "(commlib.finalize() released it). Fix: create groups again after "
                     "commlib.init()", g->name);
        return -1;
    }
    if (g->broken) {
        raise_broken(g);
        return -1;
    }
    return 0;
}

static int op_start(ShmOp *op) {
    Segment *g = op->seg;
    if (check_usable(g) < 0)
        return -1;
    if (op->state == OP_RUNNING) {
        PyErr_SetString(PyExc_RuntimeError, "commlib._shm: operation already running");
        return -1;
    }
    if (g->fifo_len == g->fifo_cap) {
        Py_ssize_t cap = g->fifo_cap ? g->fifo_cap * 2 : 16;
        ShmOp **f = PyMem_Realloc(g->fifo, sizeof(ShmOp *) * (size_t)cap);
        if (f == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        g->fifo = f;
        g->fifo_cap = cap;
    }
    op->s0 = g->next_step;
    g->next_step += op->total;
    op->cur = 0;
    op->phase = 0;
    op->polls = 0;
    op->state = op->total ? OP_RUNNING : OP_DONE;
    if (op->state == OP_RUNNING) {
        Py_INCREF(op);
        g->fifo[g->fifo_len++] = op;
    }
    return 0;
}

/* Sleep on the first peer flag behind the step this rank is in (done_step + 1); when the
 * running operation has read every step, on the read counter of the first peer still reading
 * this rank's shared buffer. */
static void wait_for_peers(Segment *g) {
    ShmOp *op = g->fifo_head < g->fifo_len ? g->fifo[g->fifo_head] : NULL;
    if (op != NULL && op->cur == op->total) {
        int j = lagging_reader(g, (uint64_t)g->done_step);
        if (j >= 0)
            word_sleep(&g->flags[j].read_step, &g->flags[j].ack_waiters, (uint64_t)g->done_step);
        return;
    }
    uint64_t need = (uint64_t)(g->done_step + 1);
    for (int j = 0; j < g->n; j++) {
        if (atomic_load_explicit(&g->flags[j].step, memory_order_acquire) < need) {
            word_sleep(&g->flags[j].step, &g->flags[j].waiters, need);
            return;
        }
    }
}

/* Block until `op` is done: spin `spin` polls, then yield (sleep == 0, or for the first
 * `yield_us` microseconds of the wait), then sleep on the lagging peer's flag (futex)
 * with the GIL released (the watchdog thread of COMMLIB_TIMEOUT_MODE=abort runs meanwhile),
 * looking for dead peers. */
static int op_run(ShmOp *op) {
    Segment *g = op->seg;
    if (progress(op)) {
        sweep(g);
        return 0;
    }
    PyThreadState *ts = NULL;
    unsigned long polls = 0;
    int dead = -1, yielding = !g->sleep || g->yield_us > 0;
    struct timespec t0 = {0, 0};
    for (;;) {
        if (progress(op))
            break;
        polls++;
        if (polls < (unsigned long)g->spin) {
            cpu_relax();
            continue;
        }
        if (ts == NULL) {
            ts = PyEval_SaveThread();
            clock_gettime(CLOCK_MONOTONIC, &t0);
        }
        if (yielding && g->sleep) { /* yield while the wait is short, then sleep */
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            long long us = (long long)(now.tv_sec - t0.tv_sec) * 1000000LL +
                           (now.tv_nsec - t0.tv_nsec) / 1000;
            yielding = us < g->yield_us;
        }
        if (yielding)
            sched_yield();
        else
            wait_for_peers(g);
        if ((polls & 15) == 0) {
            dead = dead_peer(g, (uint64_t)(op->s0 + op->cur));
            if (dead >= 0)
                break;
        }
        if ((polls & 255) == 0) {
            PyEval_RestoreThread(ts);
            ts = NULL;
            if (PyErr_CheckSignals() < 0)
                return -1;
        }
    }
    if (ts != NULL)
        PyEval_RestoreThread(ts);
    if (dead >= 0)
        return fail_dead(op, dead);
    sweep(g);
    return 0;
}

/* ----- ShmOp methods ----------------------------------------------------------------------- */
static void ShmOp_dealloc(ShmOp *op) {
    Py_XDECREF(op->seg);
    Py_TYPE(op)->tp_free((PyObject *)op);
}

/* op(): start and complete (the latency path: one call, no arguments). */
static PyObject *ShmOp_call(ShmOp *op, PyObject *args, PyObject *kw) {
    if (op_start(op) < 0 || op_run(op) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ShmOp_start(ShmOp *op, PyObject *unused) {
    if (op_start(op) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ShmOp_test(ShmOp *op, PyObject *unused) {
    if (op->state == OP_DONE)
        Py_RETURN_TRUE;
    if (op->state == OP_NEW) {
        PyErr_SetString(PyExc_RuntimeError, "commlib._shm: operation not started");
        return NULL;
    }
    Segment *g = op->seg;
    if (check_usable(g) < 0)
        return NULL;
    if (progress(op)) {
        sweep(g);
        Py_RETURN_TRUE;
    }
    if ((++op->polls & 1023) == 0) {
        int dead = dead_peer(g, (uint64_t)(op->s0 + op->cur));
        if (dead >= 0) {
            fail_dead(op, dead);
            return NULL;
        }
    }
    Py_RETURN_FALSE;
}

static PyObject *ShmOp_wait(ShmOp *op, PyObject *unused) {
    if (op->state == OP_NEW) {
        PyErr_SetString(PyExc_RuntimeError, "commlib._shm: operation not started");
        return NULL;
    }
    if (op->state != OP_DONE && (check_usable(op->seg) < 0 || op_run(op) < 0))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ShmOp_steps(ShmOp *op, void *unused) { return PyLong_FromLongLong(op->total); }

static PyMethodDef ShmOp_methods[] = {
    {"start", (PyCFunction)ShmOp_start, METH_NOARGS, "Issue the operation (non-blocking)."},
    {"test", (PyCFunction)ShmOp_test, METH_NOARGS, "Advance; True when done (never blocks)."},
    {"Test", (PyCFunction)ShmOp_test, METH_NOARGS, "MPI-style alias of test()."},
    {"is_completed", (PyCFunction)ShmOp_test, METH_NOARGS, "torch-style alias of test()."},
    {"wait", (PyCFunction)ShmOp_wait, METH_NOARGS, "Block until done."},
    {"Wait", (PyCFunction)ShmOp_wait, METH_NOARGS, "MPI-style alias of wait()."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ShmOp_getset[] = {
    {"steps", (getter)ShmOp_steps, NULL, "number of flag steps the operation takes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ShmOpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commlib._shm.ShmOp",
    .tp_basicsize = sizeof(ShmOp),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One shared-memory collective on raw buffers (created by Segment.op).",
    .tp_dealloc = (destructor)ShmOp_dealloc,
    .tp_call = (ternaryfunc)ShmOp_call,
    .tp_methods = ShmOp_methods,
    .tp_getset = ShmOp_getset,
};

/* ----- Segment ------------------------------------------------------------------------------ */
static size_t segment_bytes(int n, size_t slot) { return CL_DATA_OFF + (size_t)n * 2 * slot; }

static void segment_unmap(Segment *g) {
    if (g->base != NULL) {
        munmap(g->base, g->maplen);
        g->base = NULL;
        g->hdr = NULL;
        g->flags = NULL;
        g->data = NULL;
    }
}

/* Segment(name, rank, size, slot, create, spin, group_name, error_cls) */
static int Segment_init(Segment *g, PyObject *args, PyObject *kw) {
    const char *name;
    int rank, n, create;
    Py_ssize_t slot;
    long spin;
    PyObject *group_name, *error_cls;
    if (!PyArg_ParseTuple(args, "siinplOO", &name, &rank, &n, &slot, &create, &spin, &group_name,
                          &error_cls))
        return -1;
    if (n < 1 || n > CL_MAX_RANKS || rank < 0 || rank >= n) {
        PyErr_Format(PyExc_ValueError, "commlib._shm: %d ranks (at most %d), rank %d", n,
                     CL_MAX_RANKS, rank);
        return -1;
    }
    if (slot < 4096 || slot % 4096) {
        PyErr_Format(PyExc_ValueError, "commlib._shm: slot %zd must be a multiple of 4096", slot);
        return -1;
    }
    size_t bytes = segment_bytes(n, (size_t)slot);
    int fd = shm_open(name, create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        return -1;
    }
    if (create && ftruncate(fd, (off_t)bytes) != 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        close(fd);
        shm_unlink(name);
        return -1;
    }
    struct stat st;
    if (!create && (fstat(fd, &st) != 0 || (size_t)st.st_size != bytes)) {
        close(fd);
        PyErr_Format(PyExc_OSError, "commlib._shm: segment %s has the wrong size", name);
        return -1;
    }
    void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        if (create)
            shm_unlink(name);
        return -1;
    }
    segment_unmap(g);
    g->base = base;
    g->maplen = bytes;
    g->hdr = (header_t *)base;
    g->flags = (flag_t *)((char *)base + CL_FLAGS_OFF);
    g->data = (char *)base + CL_DATA_OFF;
    if (create) {
        g->hdr->nranks = (uint64_t)n;
        g->hdr->slot = (uint64_t)slot;
        g->hdr->data_off = CL_DATA_OFF;
        g->hdr->magic = CL_MAGIC;
    } else if (g->hdr->magic != CL_MAGIC || g->hdr->nranks != (uint64_t)n ||
               g->hdr->slot != (uint64_t)slot) {
        segment_unmap(g);
        PyErr_Format(PyExc_OSError, "commlib._shm: segment %s does not match this group", name);
        return -1;
    }
    g->hdr->pid[rank] = (int32_t)getpid();
    g->n = n;
    g->rank = rank;
    g->slot = (size_t)slot;
    g->spin = spin;
    g->yield_us = 0;
    g->sleep = 1;
    g->nt_min = CL_NT_MIN_DEFAULT;
    g->next_step = 1;
    g->done_step = 0;
    Py_INCREF(group_name);
    Py_XSETREF(g->name, group_name);
    Py_INCREF(error_cls);
    Py_XSETREF(g->error_cls, error_cls);
    return 0;
}

static void Segment_release_fifo(Segment *g) {
    for (Py_ssize_t i = 0; i < g->fifo_len; i++) Py_DECREF(g->fifo[i]);
    g->fifo_len = g->fifo_head = 0;
}

static void Segment_dealloc(Segment *g) {
    segment_unmap(g);
    Segment_release_fifo(g);
    PyMem_Free(g->fifo);
    PyMem_Free(g->shared);
    PyMem_Free(g->shared_len);
    Py_XDECREF(g->name);
    Py_XDECREF(g->error_cls);
    Py_XDECREF(g->broken_msg);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyObject *Segment_close(Segment *g, PyObject *unused) {
    segment_unmap(g);
    Segment_release_fifo(g);
    Py_RETURN_NONE;
}

/* This rank's shared buffer holding the bytes [p, p + nbytes), or -1; the offset in *off. */
static int64_t find_shared(Segment *g, const char *p, size_t nbytes, size_t *off) {
    for (Py_ssize_t k = 0; k < g->nshared; k++) {
        const char *b = g->shared[k * g->n + g->rank];
        size_t len = g->shared_len[k];
        if (len && p >= b && nbytes <= len && (size_t)(p - b) <= len - nbytes) {
            *off = (size_t)(p - b);
            return k;
        }
    }
    return -1;
}

/* op(kind, in_ptr, out_ptr, count, dtype, op, avg, root) -> ShmOp (not started).
 * count: all_reduce/broadcast elements; reduce_scatter output elements; all_gather input
 * elements. avg: the divisor of AVG (group size) or 0. */
static PyObject *Segment_op(Segment *g, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "op(kind, in_ptr, out_ptr, count, dtype, op, avg, root)");
        return NULL;
    }
    long v[8];
    for (int i = 0; i < 8; i++) {
        v[i] = PyLong_AsLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    if (check_usable(g) < 0)
        return NULL;
    if (v[0] < 0 || v[0] >= K_NKINDS || v[4] < 0 || v[4] >= CL_NDTYPES || v[5] < 0 ||
        v[5] > CL_BXOR || v[3] < 0 || v[7] < 0 || v[7] >= g->n) {
        PyErr_SetString(PyExc_ValueError, "commlib._shm: bad operation arguments");
        return NULL;
    }
    if (DTYPES[v[4]].floating && v[5] > CL_MAX) {
        PyErr_SetString(PyExc_ValueError, "commlib._shm: bitwise op on a floating dtype");
        return NULL;
    }
    ShmOp *op = PyObject_New(ShmOp, &ShmOpType);
    if (op == NULL)
        return NULL;
    Py_INCREF(g);
    op->seg = g;
    op->kind = (int)v[0];
    op->in = (char *)(uintptr_t)(unsigned long)v[1];
    op->out = (char *)(uintptr_t)(unsigned long)v[2];
    op->count = (size_t)v[3];
    op->dtype = (int)v[4];
    op->op = (int)v[5];
    op->avg = (int)v[6];
    op->root = (int)v[7];
    op->es = DTYPES[op->dtype].size;
    op->chunk = g->slot / op->es / (op->kind == K_RS ? (size_t)g->n : 1);
    op->nchunks = (op->count + op->chunk - 1) / op->chunk;
    op->total = (int64_t)op->nchunks * STEPS_PER_CHUNK[op->kind];
    /* streaming stores for the all-gather's output copies only: measured 1.4-2x faster from
     * 16 MiB at 2 ranks; the two-shot all-reduce's gather was 8-20% slower with them (its output
     * half written by the reduction with normal stores) and broadcast measured unevenly (faster
     * at 64-256 MiB, 4x slower once at 16 MiB): both keep normal stores */
    op->nt = CL_HAVE_NT && op->kind == K_AG &&
             op->count * op->es * (size_t)g->n >= (size_t)g->nt_min;
    /* the data the peers read from this rank, in place when it lies in a shared buffer */
    op->shared = -1;
    op->shared_off = 0;
    if (op->kind == K_AG || op->kind == K_RS)
        op->shared = find_shared(g, op->in, op->count * op->es * (op->kind == K_RS ? g->n : 1),
                                 &op->shared_off);
    else if (op->kind == K_BC && op->root == g->rank)
        op->shared = find_shared(g, op->out, op->count * op->es, &op->shared_off);
    op->state = OP_NEW;
    op->cur = op->s0 = 0;
    op->phase = 0;
    op->polls = 0;
    return (PyObject *)op;
}

/* share(addresses, nbytes) -> index: a shared buffer of `nbytes`, rank j's copy mapped here at
 * addresses[j] (collective: every rank registers its buffers in the same order, so the index
 * names the same buffer on every rank). The all-gather, reduce-scatter and broadcast read the
 * data of a rank whose input lies in one in place, from the peers' mappings. */
static PyObject *Segment_share(Segment *g, PyObject *args) {
    PyObject *seq;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "On", &seq, &nbytes) || check_usable(g) < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "share: addresses must be a sequence");
    if (fast == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != g->n || nbytes <= 0) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "share: %d addresses and a positive size needed", g->n);
        return NULL;
    }
    char **a = PyMem_Realloc(g->shared, sizeof(char *) * (size_t)(g->nshared + 1) * (size_t)g->n);
    if (a == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    g->shared = a;
    size_t *l = PyMem_Realloc(g->shared_len, sizeof(size_t) * (size_t)(g->nshared + 1));
    if (l == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    g->shared_len = l;
    for (int j = 0; j < g->n; j++) {
        void *p = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(fast, j));
        if (p == NULL) {
            Py_DECREF(fast);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "share: a null address");
            return NULL;
        }
        a[g->nshared * g->n + j] = p;
    }
    Py_DECREF(fast);
    l[g->nshared] = (size_t)nbytes;
    return PyLong_FromSsize_t(g->nshared++);
}

/* unshare(index): this rank's buffer `index` is gone; its address range may hold other data
 * from now on, so operations no longer look it up (the peers' mappings stay valid). */
static PyObject *Segment_unshare(Segment *g, PyObject *arg) {
    Py_ssize_t k = PyLong_AsSsize_t(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    if (k < 0 || k >= g->nshared) {
        PyErr_Format(PyExc_IndexError, "unshare: no shared buffer %zd", k);
        return NULL;
    }
    g->shared_len[k] = 0;
    Py_RETURN_NONE;
}

static PyObject *Segment_idle(Segment *g, PyObject *unused) {
    return PyBool_FromLong(g->done_step == g->next_step - 1);
}

/* The non-negative long attributes: spin (which 0), yield_us (which 1) and nt_min (which 2). */
static long *segment_long(Segment *g, void *which) {
    switch ((intptr_t)which) {
    case 0: return &g->spin;
    case 1: return &g->yield_us;
    default: return &g->nt_min;
    }
}

static const char *const LONG_NAMES[] = {"spin", "yield_us", "nt_min"};

static PyObject *Segment_get_long(Segment *g, void *which) {
    return PyLong_FromLong(*segment_long(g, which));
}

static int Segment_set_long(Segment *g, PyObject *v, void *which) {
    long s = v ? PyLong_AsLong(v) : -1;
    if (s < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s must be >= 0", LONG_NAMES[(intptr_t)which]);
        return -1;
    }
    *segment_long(g, which) = s;
    return 0;
}

static PyObject *Segment_get_sleep(Segment *g, void *unused) { return PyBool_FromLong(g->sleep); }

static int Segment_set_sleep(Segment *g, PyObject *v, void *unused) {
    int b = v ? PyObject_IsTrue(v) : -1;
    if (b < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "sleep must be a bool");
        return -1;
    }
    g->sleep = b;
    return 0;
}

static PyObject *Segment_get_int(Segment *g, void *which) {
    switch ((intptr_t)which) {
    case 0: return PyLong_FromLong(g->n);
    case 1: return PyLong_FromLong(g->rank);
    case 2: return PyLong_FromSize_t(g->slot);
    case 3: return PyLong_FromSize_t(g->maplen);
    case 4: return PyLong_FromLongLong(g->next_step);
    default: return PyBool_FromLong(g->base == NULL);
    }
}

static PyMethodDef Segment_methods[] = {
    {"op", (PyCFunction)(void (*)(void))Segment_op, METH_FASTCALL,
     "op(kind, in_ptr, out_ptr, count, dtype, op, avg, root) -> ShmOp"},
    {"close", (PyCFunction)Segment_close, METH_NOARGS, "Unmap the segment."},
    {"share", (PyCFunction)Segment_share, METH_VARARGS,
     "share(addresses, nbytes) -> index: register a shared buffer (rank j's at addresses[j])"},
    {"unshare", (PyCFunction)Segment_unshare, METH_O,
     "unshare(index): this rank's shared buffer is gone"},
    {"idle", (PyCFunction)Segment_idle, METH_NOARGS, "True when no operation is in flight."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Segment_getset[] = {
    {"size", (getter)Segment_get_int, NULL, "ranks", (void *)0},
    {"rank", (getter)Segment_get_int, NULL, "this rank", (void *)1},
    {"slot", (getter)Segment_get_int, NULL, "bytes of one region", (void *)2},
    {"nbytes", (getter)Segment_get_int, NULL, "bytes mapped", (void *)3},
    {"next_step", (getter)Segment_get_int, NULL, "first step of the next operation", (void *)4},
    {"closed", (getter)Segment_get_int, NULL, "unmapped", (void *)5},
    {"spin", (getter)Segment_get_long, (setter)Segment_set_long,
     "polls before giving the core away", (void *)0},
    {"yield_us", (getter)Segment_get_long, (setter)Segment_set_long,
     "with sleep True: microseconds of sched_yield after spinning, before sleeping", (void *)1},
    {"nt_min", (getter)Segment_get_long, (setter)Segment_set_long,
     "outputs of at least this many bytes are written with streaming stores", (void *)2},
    {"sleep", (getter)Segment_get_sleep, (setter)Segment_set_sleep,
     "after spinning: True sleeps on the lagging peer's flag (futex), False calls sched_yield",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SegmentType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commlib._shm.Segment",
    .tp_basicsize = sizeof(Segment),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Segment(name, rank, size, slot, create, spin, group_name, error_cls): a group's "
              "shared-memory segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Segment_init,
    .tp_dealloc = (destructor)Segment_dealloc,
    .tp_methods = Segment_methods,
    .tp_getset = Segment_getset,
};

/* ----- module functions -------------------------------------------------------------------- */
static PyObject *mod_unlink(PyObject *m, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    if (shm_unlink(name) != 0 && errno != ENOENT)
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
    Py_RETURN_NONE;
}

/* reduce(out_ptr, [src_ptr, ...], count, dtype, op, avg): the host build of the reduction,
 * exposed for tests against commlib.kernels (torch). */
static PyObject *mod_reduce(PyObject *m, PyObject *args) {
    unsigned long out;
    PyObject *list;
    Py_ssize_t count;
    int dtype, op, avg;
    if (!PyArg_ParseTuple(args, "kO!niii", &out, &PyList_Type, &list, &count, &dtype, &op, &avg))
        return NULL;
    Py_ssize_t ns = PyList_GET_SIZE(list);
    if (ns < 1 || ns > CL_MAX_RANKS || dtype < 0 || dtype >= CL_NDTYPES || op < 0 || op > CL_BXOR
        || count < 0 || (DTYPES[dtype].floating && op > CL_MAX)) {
        PyErr_SetString(PyExc_ValueError, "commlib._shm.reduce: bad arguments");
        return NULL;
    }
    char *srcs[CL_MAX_RANKS];
    for (Py_ssize_t i = 0; i < ns; i++) {
        unsigned long p = PyLong_AsUnsignedLong(PyList_GET_ITEM(list, i));
        if (PyErr_Occurred())
            return NULL;
        srcs[i] = (char *)(uintptr_t)p;
    }
    Py_BEGIN_ALLOW_THREADS
    DTYPES[dtype].reduce((char *)(uintptr_t)out, NULL, srcs, (int)ns, (size_t)count, op, avg);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* cast(out_ptr, in_ptr, count, to): float32 -> float16 (to=2) / bfloat16 (to=3), or back
 * (to=0 from `from`... ) -- see commlib.kernels.cast_ */
static PyObject *mod_cast(PyObject *m, PyObject *args) {
    unsigned long out, in;
    Py_ssize_t count;
    int src, dst;
    if (!PyArg_ParseTuple(args, "kknii", &out, &in, &count, &src, &dst))
        return NULL;
    float *f = NULL;
    uint16_t *h = NULL;
    if (src == CL_F32 && (dst == CL_F16 || dst == CL_BF16)) {
        f = (float *)(uintptr_t)in;
        h = (uint16_t *)(uintptr_t)out;
        for (Py_ssize_t i = 0; i < count; i++)
            h[i] = dst == CL_F16 ? cl_f32_to_f16(f[i]) : cl_f32_to_bf16(f[i]);
    } else if (dst == CL_F32 && (src == CL_F16 || src == CL_BF16)) {
        f = (float *)(uintptr_t)out;
        h = (uint16_t *)(uintptr_t)in;
        for (Py_ssize_t i = 0; i < count; i++)
            f[i] = src == CL_F16 ? cl_f16_to_f32(h[i]) : cl_bf16_to_f32(h[i]);
    } else {
        PyErr_SetString(PyExc_ValueError, "commlib._shm.cast: float32 <-> float16/bfloat16 only");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* simd([on]): whether float16/bfloat16 SUM/AVG use the vectorized kernels; with an argument,
 * turns them on (where the CPU has them) or off. Returns the setting in effect. */
static PyObject *mod_simd(PyObject *m, PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|p", &on))
        return NULL;
    if (on >= 0)
        use_simd = on && cl_simd_usable();
    return PyBool_FromLong(use_simd);
}

static PyMethodDef module_methods[] = {
    {"simd", mod_simd, METH_VARARGS, "simd([on]) -> whether the vectorized kernels are in use"},
    {"unlink", mod_unlink, METH_O, "shm_unlink(name); a missing name is not an error."},
    {"reduce", mod_reduce, METH_VARARGS, "reduce(out_ptr, src_ptrs, count, dtype, op, avg)"},
    {"cast", mod_cast, METH_VARARGS, "cast(out_ptr, in_ptr, count, src_dtype, dst_dtype)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "commlib._shm",
    "Shared-memory collectives of ranks on one host (see csrc/shm.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__shm(void) {
    if (PyType_Ready(&SegmentType) < 0 || PyType_Ready(&ShmOpType) < 0)
        return NULL;
    use_simd = cl_simd_usable();
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SegmentType);
    Py_INCREF(&ShmOpType);
    if (PyModule_AddObject(m, "Segment", (PyObject *)&SegmentType) < 0 ||
        PyModule_AddObject(m, "ShmOp", (PyObject *)&ShmOpType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_RANKS", CL_MAX_RANKS) < 0 ||
        PyModule_AddIntConstant(m, "ALIGN", CL_LINE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
