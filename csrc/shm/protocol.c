/* The segment layout and the protocol of commlib.transports._shm: where each rank's flags and data are, the
 * steps of every collective (write, publish, wait, read), the resumable operations that run them
 * (advance, progress, op_start, op_run) and the detection of dead peers. Part of the unity build
 * of module.c (see shm.h), so that a step's writes and the flag wake-ups (wait.h) inline into
 * progress, the futex sleep into op_run, and op_start into the ShmOp methods, as in one file.
 *
 * Segment layout (one POSIX shared-memory object per group, created by group rank 0, mapped by
 * every rank, and unlinked as soon as all ranks have mapped it, so that nothing is left in
 * /dev/shm even when a rank is killed):
 *
 *   header: magic, nranks, slot bytes, data offset, the pid of every rank
 *   flags:  one 128-byte line per rank: its step counter, its read counter (the last step it
 *           has finished reading) and, per parity, where its data of the step is and the call
 *           it belongs to
 *   data:   2 regions ("parities") of `slot` bytes per rank
 *
 * Protocol. Every collective is a sequence of steps numbered 1, 2, 3, ... on the group (the same
 * numbers on every rank, since ranks issue collectives in the same order). In step s a rank
 *   1. writes its contribution into its own region of parity s & 1,
 *   2. publishes flag[rank] = s with a release store,
 *   3. waits until flag[j] >= s for every rank j (acquire loads),
 *   4. compares every rank's call of the step (published with the flag: bytes, kind, dtype, op,
 *      root, first step; two words per rank) with its own, and
 *   5. reads the peers' regions of parity s & 1 (reduce or copy into its output).
 * Step s + 2 reuses the region of step s. That is safe without a closing barrier: a rank writes
 * step s + 2 only after completing step s + 1, i.e. after seeing every peer publish s + 1, and a
 * peer publishes s + 1 only after it finished reading step s. Release/acquire on the flags orders
 * the data writes before the flag on every architecture (no reliance on x86's store order).
 *
 * Agreement (step 4). Ranks that called different collectives (another size, dtype, op, root or
 * kind) must not read each other's regions: the reads would run past a peer's data or reduce
 * other types. Every rank sees the same calls of step s (a rank rewrites its call of parity s & 1
 * only at step s + 2, after every rank has passed s + 1), so either all ranks find a difference
 * or none; ranks that agree on an operation's first step agree on all its steps. On a difference
 * every rank ends the operation, and those issued after it, without reading (mismatch()), keeps
 * every rank's call for the error (ShmOp raises it: Segment.on_mismatch builds it), and the
 * next operation starts at step s + 1 on every rank: the group stays usable.
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
#include "shm.h"
#include "wait.h"

static const char *const KIND_NAMES[K_NKINDS] = {
    "all_reduce", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast"};
static const int STEPS_PER_CHUNK[K_NKINDS] = {1, 2, 1, 1, 1};

static inline char *region(Segment *g, int r, int parity) {
    return g->data + ((size_t)r * 2 + (size_t)parity) * g->slot;
}

/* Bytes of the segment of `n` ranks with regions of `slot` bytes. */
static size_t segment_bytes(int n, size_t slot) { return CL_DATA_OFF + (size_t)n * 2 * slot; }

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

/* Whether every rank's call of the step of parity `p` is `op`'s (after the acquire loads of the
 * peers' step flags): two words per rank, or-ed together, one branch. */
static inline int calls_agree(ShmOp *op, int p) {
    Segment *g = op->seg;
    uint64_t d = 0;
    for (int j = 0; j < g->n; j++)
        d |= (g->flags[j].call[p][0] ^ op->call[0]) | (g->flags[j].call[p][1] ^ op->call[1]);
    return d == 0;
}

/* The ranks disagree on the call of step `s` (see Agreement above): keep their calls for the
 * error, end `op` and the operations issued after it without reading, and finish the step as
 * every rank does, so that the next operation starts at step s + 1 on every rank. */
static void mismatch(ShmOp *op, int64_t s) {
    Segment *g = op->seg;
    int p = (int)(s & 1);
    for (int j = 0; j < g->n; j++) {
        g->seen[j][0] = g->flags[j].call[p][0];
        g->seen[j][1] = g->flags[j].call[p][1];
    }
    for (Py_ssize_t i = g->fifo_head; i < g->fifo_len; i++) {
        g->fifo[i]->bad = 1;
        g->fifo[i]->state = OP_DONE;
    }
    g->next_step = s + 1;
    g->done_step = s;
    flag_t *mine = &g->flags[g->rank];
    atomic_store_explicit(&mine->read_step, (uint64_t)s, memory_order_seq_cst);
    word_wake(&mine->read_step, &mine->ack_waiters);
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
            mine->call[s & 1][0] = op->call[0];
            mine->call[s & 1][1] = op->call[1];
            atomic_store_explicit(&mine->step, (uint64_t)s, memory_order_seq_cst);
            word_wake(&mine->step, &mine->waiters);
            do_own(op, op->cur);
            op->phase = 1;
        }
        for (int j = 0; j < g->n; j++)
            if (atomic_load_explicit(&g->flags[j].step, memory_order_acquire) < (uint64_t)s)
                return 0;
        if (!calls_agree(op, (int)(s & 1))) {
            mismatch(op, s);
            return 1;
        }
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

/* Progress the segment's FIFO up to `op`; 1 when `op` is done. No Python API. The caller holds
 * the segment lock (locked_progress, or ShmOp.test's try). */
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

/* Progress under the segment lock (blocking: the lock is held only for moments). */
static int locked_progress(ShmOp *op) {
    lock_take(&op->seg->lock);
    int done = progress(op);
    lock_drop(&op->seg->lock);
    return done;
}

/* Drop the references of finished operations (needs the GIL). */
static void sweep(Segment *g) {
    if (g->fifo_head == 0)
        return;
    ShmOp *tmp[64];
    ShmOp **dead = tmp;
    lock_take(&g->lock);
    /* move the live tail to the front first, under the lock; DECREF after (it may run code) */
    Py_ssize_t ndone = g->fifo_head, len = g->fifo_len, k = 0;
    if (ndone > 64 && (dead = PyMem_Malloc(sizeof(ShmOp *) * (size_t)ndone)) == NULL) {
        lock_drop(&g->lock);
        return; /* retried by the next sweep */
    }
    memcpy(dead, g->fifo, sizeof(ShmOp *) * (size_t)ndone);
    for (Py_ssize_t i = ndone; i < len; i++) g->fifo[k++] = g->fifo[i];
    g->fifo_head = 0;
    g->fifo_len = k;
    lock_drop(&g->lock);
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

/* Raise the error of an operation whose ranks disagreed (op->bad): on_mismatch's, given every
 * rank's call as (kind, dtype, op, root, bytes, first step), or a plain one. */
static int raise_mismatch(ShmOp *op) {
    Segment *g = op->seg;
    if (g->on_mismatch == NULL || g->on_mismatch == Py_None) {
        PyErr_Format(g->error_cls, "commlib.%s: the ranks of group %R called different "
                     "collectives (step %lld). Fix: make every rank call the same collective "
                     "with the same size, dtype, op and root", KIND_NAMES[op->kind], g->name,
                     (long long)op->s0);
        return -1;
    }
    PyObject *calls = PyList_New(g->n);
    if (calls == NULL)
        return -1;
    for (int j = 0; j < g->n; j++) {
        uint64_t w = g->seen[j][1];
        PyObject *row = Py_BuildValue("(iiiiKK)", (int)(w & 255), (int)(w >> 8 & 255),
                                      (int)(w >> 16 & 255), (int)(w >> 24 & 255),
                                      (unsigned long long)g->seen[j][0],
                                      (unsigned long long)(w >> 32));
        if (row == NULL) {
            Py_DECREF(calls);
            return -1;
        }
        PyList_SET_ITEM(calls, j, row);
    }
    PyObject *exc = PyObject_CallOneArg(g->on_mismatch, calls);
    Py_DECREF(calls);
    if (exc == NULL)
        return -1;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
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
        PyErr_SetString(PyExc_RuntimeError, "commlib.transports._shm: operation already running");
        return -1;
    }
    lock_take(&g->lock);
    if (g->fifo_len == g->fifo_cap) {
        Py_ssize_t cap = g->fifo_cap ? g->fifo_cap * 2 : 16;
        ShmOp **f = PyMem_Realloc(g->fifo, sizeof(ShmOp *) * (size_t)cap);
        if (f == NULL) {
            lock_drop(&g->lock);
            PyErr_NoMemory();
            return -1;
        }
        g->fifo = f;
        g->fifo_cap = cap;
    }
    op->s0 = g->next_step;
    op->call[1] = (op->call[1] & 0xffffffffULL) | (uint64_t)op->s0 << 32;
    op->bad = 0;
    g->next_step += op->total;
    op->cur = 0;
    op->phase = 0;
    op->polls = 0;
    op->state = op->total ? OP_RUNNING : OP_DONE;
    if (op->state == OP_RUNNING) {
        Py_INCREF(op);
        g->fifo[g->fifo_len++] = op;
    }
    lock_drop(&g->lock);
    return 0;
}

/* What to sleep on (under the segment lock): the first peer flag behind the step this rank is in
 * (done_step + 1); when the running operation has read every step, the read counter of the first
 * peer still reading this rank's shared buffer. 0 when nothing is behind. */
typedef struct { _Atomic uint64_t *word; _Atomic uint32_t *waiters; uint64_t need; } sleep_on;

static int lagging_flag(Segment *g, sleep_on *t) {
    lock_take(&g->lock);
    ShmOp *op = g->fifo_head < g->fifo_len ? g->fifo[g->fifo_head] : NULL;
    int found = 0;
    if (op != NULL && op->cur == op->total) {
        int j = lagging_reader(g, (uint64_t)g->done_step);
        if (j >= 0) {
            *t = (sleep_on){&g->flags[j].read_step, &g->flags[j].ack_waiters, (uint64_t)g->done_step};
            found = 1;
        }
    } else {
        uint64_t need = (uint64_t)(g->done_step + 1);
        for (int j = 0; j < g->n && !found; j++) {
            if (atomic_load_explicit(&g->flags[j].step, memory_order_acquire) < need) {
                *t = (sleep_on){&g->flags[j].step, &g->flags[j].waiters, need};
                found = 1;
            }
        }
    }
    lock_drop(&g->lock);
    return found;
}

/* Sleep (futex, at most `ns`) until the lagging peer publishes; no Python API. */
static void wait_for_peers(Segment *g, long ns) {
    sleep_on t;
    if (lagging_flag(g, &t))
        word_sleep(t.word, t.waiters, t.need, ns);
}

/* Block until `op` is done: spin `spin` polls, then yield (sleep == 0, or for the first
 * `yield_us` microseconds of the wait), then sleep on the lagging peer's flag (futex)
 * with the GIL released (the watchdog thread of COMMLIB_TIMEOUT_MODE=abort runs meanwhile),
 * looking for dead peers. */
static int op_run(ShmOp *op) {
    Segment *g = op->seg;
    if (locked_progress(op)) {
        sweep(g);
        return op->bad ? raise_mismatch(op) : 0;
    }
    PyThreadState *ts = NULL;
    unsigned long polls = 0;
    int dead = -1, yielding = !g->sleep || g->yield_us > 0, timed = 0;
    struct timespec t0 = {0, 0};
    for (;;) {
        if (locked_progress(op))
            break;
        polls++;
        if (polls < (unsigned long)g->spin) {
            cpu_relax();
            continue;
        }
        if (ts == NULL)
            ts = PyEval_SaveThread();
        if (!timed) { /* the wait's start: the signal checks below do not restart it */
            clock_gettime(CLOCK_MONOTONIC, &t0);
            timed = 1;
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
            wait_for_peers(g, CL_SLEEP_NS);
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
    return op->bad ? raise_mismatch(op) : 0;
}
