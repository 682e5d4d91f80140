/* commlib.transports._shm: the shared-memory collectives of ranks on one host (CPython extension). This file
 * is the CPython glue: the ShmOp type (one collective: call, start, test, wait), the Segment type
 * (mapping a group's segment, creating operations, shared buffers, settings) and the module
 * functions and init.
 *
 * Why compiled: on this machine kind an 8-byte all-reduce through MPI takes ~5 us; a Python
 * implementation spends more than that in the interpreter alone. Here the copy-in, the flag
 * handshake and the reduction are one C call (a pre-bound ShmOp called with no arguments).
 *
 * Unity build: setup.py compiles this file only, which includes the other parts below, in the
 * order of a single file. Every function stays static in one translation unit, so the compiler
 * inlines across the parts as before the split (op_start and check_usable into the ShmOp
 * methods, the futex sleep into op_run, a step's writes and the flag wake-ups into progress);
 * separate objects would turn those into calls between objects. The layout and the protocol
 * are described in protocol.c. */
#include "shm.h"

#include "wait.h"     /* waiting on a flag word: spin hint, futex sleep and wake */
#include "reduce.c"   /* the reductions and their dispatch table DTYPES */
#include "protocol.c" /* the segment layout, the protocol, the resumable operations */

static PyTypeObject SegmentType;
static PyTypeObject ShmOpType;

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

/* For test and wait_for: 1 when `op` is done, 0 when it is running on a usable segment, -1 with
 * an exception (not started, or the segment closed or broken). */
static int op_pending(ShmOp *op) {
    if (op->state == OP_DONE)
        return op->bad ? raise_mismatch(op) : 1;
    if (op->state == OP_NEW) {
        PyErr_SetString(PyExc_RuntimeError, "commlib.transports._shm: operation not started");
        return -1;
    }
    return check_usable(op->seg) < 0 ? -1 : 0;
}

static PyObject *ShmOp_test(ShmOp *op, PyObject *unused) {
    int state = op_pending(op);
    if (state != 0)
        return state > 0 ? Py_NewRef(Py_True) : NULL;
    Segment *g = op->seg;
    if (!lock_try(&g->lock))
        Py_RETURN_FALSE; /* another thread is advancing the segment right now */
    int done;
    if (op->count * op->es >= CL_NOGIL_BYTES) {
        /* copies worth a GIL release: the caller's thread computes meanwhile (the segment lock
         * is dropped before the GIL is taken back: a thread holding the GIL may be waiting for
         * it) */
        Py_BEGIN_ALLOW_THREADS
        done = progress(op);
        lock_drop(&g->lock);
        Py_END_ALLOW_THREADS
    } else {
        done = progress(op);
        lock_drop(&g->lock);
    }
    if (done) {
        sweep(g);
        if (op->bad)
            return raise_mismatch(op), NULL;
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
        PyErr_SetString(PyExc_RuntimeError, "commlib.transports._shm: operation not started");
        return NULL;
    }
    if (op->state != OP_DONE && (check_usable(op->seg) < 0 || op_run(op) < 0))
        return NULL;
    if (op->bad)
        return raise_mismatch(op), NULL;
    Py_RETURN_NONE;
}

/* wait_for(seconds): sleep (futex, the GIL released) until the lagging peer publishes a step or
 * `seconds` pass, without spinning and without advancing: commlib's progress thread advances in
 * its passes (test), which the caller's thread keeps it out of while it drives the operations
 * itself, so the two never contend for the segment. True when done. */
static PyObject *ShmOp_wait_for(ShmOp *op, PyObject *arg) {
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    int state = op_pending(op);
    if (state != 0)
        return state > 0 ? Py_NewRef(Py_True) : NULL;
    Segment *g = op->seg;
    int dead = dead_peer(g, (uint64_t)(op->s0 + op->cur));
    if (dead >= 0) {
        fail_dead(op, dead);
        return NULL;
    }
    long ns = seconds <= 0 ? 0 : seconds >= 0.5 ? 500000000L : (long)(seconds * 1e9);
    Py_BEGIN_ALLOW_THREADS
    sleep_on t;
    if (lagging_flag(g, &t)) {
        word_sleep(t.word, t.waiters, t.need, ns);
    } else { /* nothing to sleep on (this rank's own step is next): block briefly anyway */
        struct timespec ts = {0, ns < 50000 ? ns : 50000};
        nanosleep(&ts, NULL);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_FALSE;
}

static PyObject *ShmOp_steps(ShmOp *op, void *unused) { return PyLong_FromLongLong(op->total); }

static PyMethodDef ShmOp_methods[] = {
    {"start", (PyCFunction)ShmOp_start, METH_NOARGS, "Issue the operation (non-blocking)."},
    {"test", (PyCFunction)ShmOp_test, METH_NOARGS, "Advance; True when done (never blocks)."},
    {"Test", (PyCFunction)ShmOp_test, METH_NOARGS, "MPI-style alias of test()."},
    {"is_completed", (PyCFunction)ShmOp_test, METH_NOARGS, "torch-style alias of test()."},
    {"wait", (PyCFunction)ShmOp_wait, METH_NOARGS, "Block until done."},
    {"wait_for", (PyCFunction)ShmOp_wait_for, METH_O,
     "wait_for(seconds): sleep until a peer publishes (at most seconds); True when done."},
    {"Wait", (PyCFunction)ShmOp_wait, METH_NOARGS, "MPI-style alias of wait()."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ShmOp_getset[] = {
    {"steps", (getter)ShmOp_steps, NULL, "number of flag steps the operation takes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ShmOpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commlib.transports._shm.ShmOp",
    .tp_basicsize = sizeof(ShmOp),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One shared-memory collective on raw buffers (created by Segment.op).",
    .tp_dealloc = (destructor)ShmOp_dealloc,
    .tp_call = (ternaryfunc)ShmOp_call,
    .tp_methods = ShmOp_methods,
    .tp_getset = ShmOp_getset,
};

/* ----- Segment ------------------------------------------------------------------------------ */
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
        PyErr_Format(PyExc_ValueError, "commlib.transports._shm: %d ranks (at most %d), rank %d", n,
                     CL_MAX_RANKS, rank);
        return -1;
    }
    if (slot < 4096 || slot % 4096) {
        PyErr_Format(PyExc_ValueError, "commlib.transports._shm: slot %zd must be a multiple of 4096", slot);
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
        PyErr_Format(PyExc_OSError, "commlib.transports._shm: segment %s has the wrong size", name);
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
        PyErr_Format(PyExc_OSError, "commlib.transports._shm: segment %s does not match this group", name);
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
    Py_XDECREF(g->on_mismatch);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyObject *Segment_close(Segment *g, PyObject *unused) {
    segment_unmap(g);
    Segment_release_fifo(g);
    Py_CLEAR(g->on_mismatch); /* it may refer to the group that owns the segment */
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

/* op(kind, in_ptr, out_ptr, count, dtype, op, avg, root[, call_dtype]) -> ShmOp (not started).
 * count: all_reduce/broadcast elements; reduce_scatter output elements; all_gather input
 * elements. avg: the divisor of AVG (group size) or 0. call_dtype (0-255, default dtype): the
 * caller's dtype in the call the peers compare, where the data moves as bytes. */
static PyObject *Segment_op(Segment *g, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "op(kind, in_ptr, out_ptr, count, dtype, op, avg, root[, call_dtype])");
        return NULL;
    }
    long v[9];
    for (int i = 0; i < nargs; i++) {
        v[i] = PyLong_AsLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    if (check_usable(g) < 0)
        return NULL;
    if (v[0] < 0 || v[0] >= K_NKINDS || v[4] < 0 || v[4] >= CL_NDTYPES || v[5] < 0 ||
        v[5] > CL_BXOR || v[3] < 0 || v[7] < 0 || v[7] >= g->n ||
        (nargs == 9 && (v[8] < 0 || v[8] > 255))) {
        PyErr_SetString(PyExc_ValueError, "commlib.transports._shm: bad operation arguments");
        return NULL;
    }
    if (DTYPES[v[4]].floating && v[5] > CL_MAX) {
        PyErr_SetString(PyExc_ValueError, "commlib.transports._shm: bitwise op on a floating dtype");
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
    /* the call the peers compare (AVG as op 7); op_start adds the first step */
    op->call[0] = (uint64_t)op->count * op->es;
    op->call[1] = (uint64_t)op->kind | (uint64_t)(nargs == 9 ? v[8] : v[4]) << 8 |
                  (uint64_t)(op->avg ? 7 : op->op) << 16 | (uint64_t)op->root << 24;
    op->bad = 0;
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

static PyObject *Segment_get_on_mismatch(Segment *g, void *unused) {
    return Py_NewRef(g->on_mismatch ? g->on_mismatch : Py_None);
}

static int Segment_set_on_mismatch(Segment *g, PyObject *v, void *unused) {
    Py_XINCREF(v);
    Py_XSETREF(g->on_mismatch, v);
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
     "op(kind, in_ptr, out_ptr, count, dtype, op, avg, root[, call_dtype]) -> ShmOp"},
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
    {"on_mismatch", (getter)Segment_get_on_mismatch, (setter)Segment_set_on_mismatch,
     "on_mismatch(calls) -> exception: the error of an operation whose ranks called different "
     "collectives; calls[j] = (kind, dtype, op, root, bytes, first step) of rank j", NULL},
    {"sleep", (getter)Segment_get_sleep, (setter)Segment_set_sleep,
     "after spinning: True sleeps on the lagging peer's flag (futex), False calls sched_yield",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SegmentType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commlib.transports._shm.Segment",
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
        PyErr_SetString(PyExc_ValueError, "commlib.transports._shm.reduce: bad arguments");
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
        PyErr_SetString(PyExc_ValueError, "commlib.transports._shm.cast: float32 <-> float16/bfloat16 only");
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
    PyModuleDef_HEAD_INIT, "commlib.transports._shm",
    "Shared-memory collectives of ranks on one host (see csrc/shm/).", -1, module_methods,
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
