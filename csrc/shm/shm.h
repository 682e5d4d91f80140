/* What the parts of commlib.transports._shm share: the includes, the segment layout (header, flag lines,
 * offsets), the Segment and ShmOp objects, and the declarations of what one part defines and
 * another uses. The layout and the protocol are described in protocol.c.
 *
 * The parts are compiled as one translation unit (module.c includes them in this order):
 *   wait.h      sleeping on and waking a flag word (futex)
 *   reduce.c    the reductions: per-dtype kernels and their dispatch table
 *   protocol.c  the segment layout and the protocol: steps, flags, resumable operations
 *   module.c    the CPython glue: the ShmOp and Segment types, module functions and init
 * so that every function stays static and the compiler inlines across the parts (a step's
 * writes and the flag wake-ups into progress, the futex sleep into op_run, op_start into the
 * ShmOp methods) as in one file. */
#ifndef COMMLIB_SHM_H
#define COMMLIB_SHM_H

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
#include <time.h>
#include <unistd.h>

#include "reduce_math.h"
#include "reduce_simd.h"
#include "copy_nt.h"

#define CL_MAX_RANKS 64
#define CL_LINE 128
#define CL_MAGIC 0x31626c6d6d6f63ULL /* "commlb1" */

/* ShmOp.test releases the GIL around its progress from this many bytes on (the progress thread
 * tests large operations while the caller's thread computes; below, the release costs more than
 * the copies). */
#define CL_NOGIL_BYTES (64 * 1024)

/* ----- the segment layout ------------------------------------------------------------------ */
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
    /* Per parity: the call of the step (ShmOp.call: its bytes; its kind, dtype, op, root and
     * first step), written with buf/off before the release store of `step`; every rank compares
     * all of them with its own before it reads the step's data (calls_agree). */
    uint64_t call[2][2];
    char pad[CL_LINE - 11 * sizeof(uint64_t)];
} flag_t;
_Static_assert(sizeof(flag_t) == CL_LINE, "a flag line is one CL_LINE");

typedef struct {
    uint64_t magic;
    uint64_t nranks;
    uint64_t slot;
    uint64_t data_off;
    int32_t pid[CL_MAX_RANKS];
} header_t;

#define CL_FLAGS_OFF 512 /* sizeof(header_t) rounded up to a multiple of CL_LINE */
#define CL_DATA_OFF ((CL_FLAGS_OFF + CL_MAX_RANKS * CL_LINE + 4095) & ~(size_t)4095)

/* ----- objects ----------------------------------------------------------------------------- */
enum { K_AR1 = 0, K_AR2 = 1, K_RS = 2, K_AG = 3, K_BC = 4, K_NKINDS = 5 };

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
    /* Held while a thread advances the operations or changes the FIFO: the caller's thread may
     * run a blocking operation without the GIL (op_run) while commlib's progress thread tests an
     * asynchronous one (commlib/runtime/progress.py). 0 free, 1 held. */
    _Atomic int lock;
    ShmOp **fifo;      /* started, unfinished operations in issue order (strong references) */
    Py_ssize_t fifo_head, fifo_len, fifo_cap;
    int broken;
    PyObject *broken_msg;
    PyObject *error_cls; /* raised when a peer died or the segment is unusable */
    PyObject *name;      /* the group's name, for messages */
    /* on_mismatch(calls) -> exception: the error of an operation whose ranks disagreed, built
     * from every rank's call of the step (`seen`, kept by mismatch()); None: a plain one. */
    PyObject *on_mismatch;
    uint64_t seen[CL_MAX_RANKS][2];
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
    int bad;          /* ended without reading: the ranks disagreed on the call (mismatch()) */
    uint64_t call[2]; /* what the peers compare (flag_t.call): bytes; kind | dtype << 8 | op << 16
                       * | root << 24 | first step << 32 (set by op_start) */
    unsigned long polls;
};

/* ----- reduce.c ---------------------------------------------------------------------------- */
/* out[i] = srcs[0][i] op srcs[1][i] op ..., divided by `avg` when it is non-zero, copied to
 * `out2` too when that is not NULL (see reduce.c). */
typedef void (*reduce_fn)(char *out, char *out2, char *const *srcs, int ns, size_t len, int op,
                          int avg);

/* dtype code -> (element size, reduction, floating); indexed by the CL_* dtype codes */
typedef struct { size_t size; reduce_fn reduce; int floating; } dtype_info;

/* (Tentative definitions: reduce.c gives the values.) */
static const dtype_info DTYPES[CL_NDTYPES];
static int use_simd; /* float16/bfloat16 SUM/AVG take the vectorized kernels (reduce_simd.h) */

/* ----- protocol.c -------------------------------------------------------------------------- */
static const int STEPS_PER_CHUNK[K_NKINDS]; /* flag steps per chunk of each kind */

static size_t segment_bytes(int n, size_t slot);
static int progress(ShmOp *op);
static void sweep(Segment *g);
static int dead_peer(Segment *g, uint64_t need);
static int fail_dead(ShmOp *op, int j);
static int check_usable(Segment *g);
static int op_start(ShmOp *op);
static int op_run(ShmOp *op);
static int raise_mismatch(ShmOp *op);

#endif
