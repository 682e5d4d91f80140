/* commlib.compress._codecs: the C fast path of commlib.compress's block quantizers (CPython
 * extension; commlib/compress/_fast.py is its Python face and the only caller).
 *
 * Why compiled: the torch definition of a codec is a dozen tensor passes (abs, amax, divide, round,
 * clamp, cast, pack) with temporaries; the fused loops here read the input once and write the wire
 * bytes once, at a large fraction of memcpy bandwidth (tests/test_compress_c.py checks the bytes
 * against the torch definition).
 *
 * The functions take raw addresses (tensor.data_ptr()) and sizes; _fast.py validates the tensors.
 * The GIL is released during the loops: the codecs run beside commlib's communication threads.
 *
 * Unity build: setup.py compiles this file only, which includes codecs.c (the drivers and block
 * functions), codec_simd.h (the AVX2 builds) and codec_math.h (the per-element math shared with
 * csrc/compress.cu). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "codecs.c"

/* Calls on fewer values keep the GIL (releasing it costs more than the work). */
#define CL_NOGIL_VALUES 16384

static int check_common(const char *fn, int kind, Py_ssize_t n, Py_ssize_t block, int dtype,
                        unsigned long long a, unsigned long long b) {
    if (kind < 0 || kind >= CL_NKINDS || n < 0 || block < 1 || !codec_dtype_ok(dtype)
        || (n > 0 && (a == 0 || b == 0))) {
        PyErr_Format(PyExc_ValueError,
                     "commlib.compress._codecs.%s: bad arguments (kind=%d, n=%zd, block=%zd, "
                     "dtype=%d)", fn, kind, n, block, dtype);
        return -1;
    }
    return 0;
}

/* encode(kind, src_ptr, src_dtype, n, block, scale_f16, dst_ptr): n values of src_dtype (CL_F32 /
 * CL_F16 / CL_BF16) at src_ptr -> the wire bytes (nbytes(kind, n, block, scale_f16)) at dst_ptr. */
static PyObject *mod_encode(PyObject *m, PyObject *args) {
    int kind, src, scale_f16;
    unsigned long long x, dst;
    Py_ssize_t n, block;
    if (!PyArg_ParseTuple(args, "iKinnpK", &kind, &x, &src, &n, &block, &scale_f16, &dst))
        return NULL;
    if (check_common("encode", kind, n, block, src, x, dst) < 0)
        return NULL;
    if (n >= CL_NOGIL_VALUES) {
        Py_BEGIN_ALLOW_THREADS
        codec_encode(kind, (const void *)(uintptr_t)x, src, (size_t)n, (size_t)block, scale_f16,
                     (cl_u8 *)(uintptr_t)dst);
        Py_END_ALLOW_THREADS
    } else {
        codec_encode(kind, (const void *)(uintptr_t)x, src, (size_t)n, (size_t)block, scale_f16,
                     (cl_u8 *)(uintptr_t)dst);
    }
    Py_RETURN_NONE;
}

/* decode(kind, src_ptr, n, block, scale_f16, dst_ptr, dst_dtype, accumulate): the wire bytes at
 * src_ptr -> n values of dst_dtype at dst_ptr (accumulate: added to the values there in
 * float32, rounded once). */
static PyObject *mod_decode(PyObject *m, PyObject *args) {
    int kind, scale_f16, dst, acc;
    unsigned long long wire, out;
    Py_ssize_t n, block;
    if (!PyArg_ParseTuple(args, "iKnnpKip", &kind, &wire, &n, &block, &scale_f16, &out, &dst, &acc))
        return NULL;
    if (check_common("decode", kind, n, block, dst, wire, out) < 0)
        return NULL;
    if (n >= CL_NOGIL_VALUES) {
        Py_BEGIN_ALLOW_THREADS
        codec_decode(kind, (const cl_u8 *)(uintptr_t)wire, (size_t)n, (size_t)block, scale_f16,
                     (void *)(uintptr_t)out, dst, acc);
        Py_END_ALLOW_THREADS
    } else {
        codec_decode(kind, (const cl_u8 *)(uintptr_t)wire, (size_t)n, (size_t)block, scale_f16,
                     (void *)(uintptr_t)out, dst, acc);
    }
    Py_RETURN_NONE;
}

/* nbytes(kind, n, block, scale_f16): the wire bytes of n values. */
static PyObject *mod_nbytes(PyObject *m, PyObject *args) {
    int kind, scale_f16;
    Py_ssize_t n, block;
    if (!PyArg_ParseTuple(args, "innp", &kind, &n, &block, &scale_f16))
        return NULL;
    if (check_common("nbytes", kind, n, block, CL_F32, 1, 1) < 0)
        return NULL;
    return PyLong_FromSize_t(codec_nbytes(kind, (size_t)n, (size_t)block, scale_f16));
}

/* simd([on]): whether the AVX2 block functions are in use; with an argument, turns them on (where
 * the CPU has AVX2 and F16C) or off. Returns the setting in effect. */
static PyObject *mod_simd(PyObject *m, PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|p", &on))
        return NULL;
    if (on >= 0)
        use_simd = on && cl_simd_usable();
    return PyBool_FromLong(use_simd);
}

static PyMethodDef module_methods[] = {
    {"encode", mod_encode, METH_VARARGS,
     "encode(kind, src_ptr, src_dtype, n, block, scale_f16, dst_ptr): quantize and pack"},
    {"decode", mod_decode, METH_VARARGS,
     "decode(kind, src_ptr, n, block, scale_f16, dst_ptr, dst_dtype, accumulate): unpack and "
     "dequantize"},
    {"nbytes", mod_nbytes, METH_VARARGS, "nbytes(kind, n, block, scale_f16) -> wire bytes"},
    {"simd", mod_simd, METH_VARARGS, "simd([on]) -> whether the vectorized loops are in use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "commlib.compress._codecs",
    "Fused quantize+pack / unpack+dequantize of commlib.compress's int8, int4 and fp8 codecs "
    "(see csrc/compress/).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__codecs(void) {
    use_simd = cl_simd_usable();
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "INT8", CL_INT8) < 0 || PyModule_AddIntConstant(m, "INT4", CL_INT4) < 0
        || PyModule_AddIntConstant(m, "E4M3", CL_E4M3) < 0 || PyModule_AddIntConstant(m, "E5M2", CL_E5M2) < 0
        || PyModule_AddIntConstant(m, "F32", CL_F32) < 0 || PyModule_AddIntConstant(m, "F16", CL_F16) < 0
        || PyModule_AddIntConstant(m, "BF16", CL_BF16) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
