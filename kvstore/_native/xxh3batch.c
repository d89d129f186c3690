/* kvstore._native._xxh3batch: xxh3_64 of many chunks of one buffer in one call, without the GIL.
 *
 * This module holds no hash implementation. bind() finds python-xxhash's own XXH3 entry
 * point (xxHash's public C API, exported by python-xxhash's extension module) with
 * dlopen/dlsym; sums() calls it once per chunk in a C loop with the GIL released, so a
 * block's 256 small chunks cost one Python call and other threads run meanwhile.
 * kvstore/checksum.py binds it, self-tests it against xxhash.xxh3_64_intdigest and falls
 * back to per-chunk python-xxhash calls when anything here is unavailable.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "native_common.h"

#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

/* XXH64_hash_t XXH3_64bits(const void *input, size_t length): xxHash's public signature. */

/* Written only with the GIL held (bind); sums() copies it to a local before releasing the
 * GIL, so a concurrent bind never changes the function under a running loop. Handles are
 * never closed: a loop may still run through the previous function. */
static xxh3_64_fn bound_fn = NULL;

static PyObject *
xxh3batch_bind(PyObject *Py_UNUSED(module), PyObject *args)
{
    const char *path;
    const char *symbol;
    if (!PyArg_ParseTuple(args, "ss:bind", &path, &symbol)) {
        return NULL;
    }
    /* The library is normally loaded already (import xxhash): take that copy; otherwise
     * load it. */
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (handle == NULL) {
        handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
    if (handle == NULL) {
        const char *why = dlerror();
        PyErr_Format(PyExc_OSError, "dlopen(%s): %s", path, why ? why : "unknown error");
        return NULL;
    }
    dlerror(); /* clear any stale error before dlsym */
    void *address = dlsym(handle, symbol);
    if (address == NULL) {
        const char *why = dlerror();
        PyErr_Format(PyExc_OSError, "dlsym(%s): %s", symbol, why ? why : "symbol is NULL");
        return NULL;
    }
    /* POSIX guarantees a dlsym'd function address converts to a function pointer; copying
     * the bits says so without ISO C's object-to-function pointer cast warning. */
    memcpy(&bound_fn, &address, sizeof bound_fn);
    Py_RETURN_NONE;
}

/* The capsule name of function(): kvstore/_native/fileproto*.c take the hash function this way, so
 * the one binding above (and its self-test in kvstore/checksum.py) serves both modules. */

static PyObject *
xxh3batch_function(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    xxh3_64_fn fn = bound_fn;
    if (fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xxh3 batch: bind() has not succeeded");
        return NULL;
    }
    void *address;
    memcpy(&address, &fn, sizeof address);
    return PyCapsule_New(address, XXH3_CAPSULE_NAME, NULL);
}

static PyObject *
xxh3batch_is_bound(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    return PyBool_FromLong(bound_fn != NULL);
}


/* Replace the buffer protocol's error (e.g. "Object is not writable.") by one naming the
 * argument, what it must be and what arrived. */
static void
explain_buffer_error(const char *expected, PyObject *obj)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *why = value != NULL ? PyObject_Str(value) : NULL;
    if (why == NULL) {
        PyErr_Clear();
    }
    PyErr_Format(PyExc_TypeError, "xxh3 batch: expected %s, got %.200s (%S)", expected,
                 Py_TYPE(obj)->tp_name, why != NULL ? why : Py_None);
    Py_XDECREF(why);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

static PyObject *
xxh3batch_sums(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *data_obj;
    PyObject *out_obj;
    Py_ssize_t chunk_nbytes;
    Py_ssize_t count;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "OnnnO:sums", &data_obj, &chunk_nbytes, &count, &stride,
                          &out_obj)) {
        return NULL;
    }
    xxh3_64_fn fn = bound_fn;
    if (fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xxh3 batch: bind() has not succeeded");
        return NULL;
    }
    if (chunk_nbytes < 0 || count < 0) {
        PyErr_Format(PyExc_ValueError,
                     "xxh3 batch: expected chunk_nbytes >= 0 and count >= 0, got %zd and %zd",
                     chunk_nbytes, count);
        return NULL;
    }
    if (stride < chunk_nbytes) {
        PyErr_Format(PyExc_ValueError,
                     "xxh3 batch: expected stride >= chunk_nbytes (%zd), got %zd",
                     chunk_nbytes, stride);
        return NULL;
    }
    Py_buffer data;
    if (PyObject_GetBuffer(data_obj, &data, PyBUF_SIMPLE) < 0) {
        explain_buffer_error("data as a contiguous buffer", data_obj);
        return NULL;
    }
    Py_buffer out;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
        < 0) {
        explain_buffer_error("out as a writable C-contiguous buffer", out_obj);
        PyBuffer_Release(&data);
        return NULL;
    }
    if (!is_uint64_format(out.format, out.itemsize) || (uintptr_t)out.buf % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "xxh3 batch: expected out of native uint64 items aligned to 8 bytes, got "
                     "format '%s' with %zd-byte items at address %% 8 = %d",
                     out.format ? out.format : "B", out.itemsize, (int)((uintptr_t)out.buf % 8));
        goto fail;
    }
    if (count > 0) {
        /* Bytes the last chunk ends at: (count - 1) * stride + chunk_nbytes, overflow-checked. */
        if (stride > 0 && count - 1 > (PY_SSIZE_T_MAX - chunk_nbytes) / stride) {
            PyErr_Format(PyExc_ValueError,
                         "xxh3 batch: %zd chunks of %zd bytes at a stride of %zd overflow "
                         "the address space",
                         count, chunk_nbytes, stride);
            goto fail;
        }
        Py_ssize_t needed = (count - 1) * stride + chunk_nbytes;
        if (data.len < needed) {
            PyErr_Format(PyExc_ValueError,
                         "xxh3 batch: expected at least %zd bytes of data (%zd chunks of %zd "
                         "at a stride of %zd), got %zd",
                         needed, count, chunk_nbytes, stride, data.len);
            goto fail;
        }
    }
    if (out.len / 8 < count) {
        PyErr_Format(PyExc_ValueError,
                     "xxh3 batch: expected out to hold at least %zd uint64 values, got %zd",
                     count, out.len / 8);
        goto fail;
    }
    {
        const char *base = (const char *)data.buf;
        uint64_t *sums = (uint64_t *)out.buf;
        /* The held buffer exports keep both memories alive and unresized without the GIL. */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) {
            sums[i] = fn(base + i * stride, (size_t)chunk_nbytes);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&out);
    PyBuffer_Release(&data);
    return NULL;
}

static PyMethodDef xxh3batch_methods[] = {
    {"bind", xxh3batch_bind, METH_VARARGS,
     "bind(path, symbol): use function `symbol` (XXH3_64bits' signature) of the shared "
     "library at `path`; OSError if it cannot be opened or lacks the symbol."},
    {"function", xxh3batch_function, METH_NOARGS,
     "function() -> capsule: the bound XXH3_64bits-signature function, as a PyCapsule named "
     "'" XXH3_CAPSULE_NAME "' (kvstore._native._fileproto hashes with it); RuntimeError before a "
     "successful bind(). The capsule stays valid for the process's life (handles are never "
     "closed)."},
    {"is_bound", xxh3batch_is_bound, METH_NOARGS, "is_bound() -> bool: has bind() succeeded."},
    {"sums", xxh3batch_sums, METH_VARARGS,
     "sums(data, chunk_nbytes, count, stride, out): out[i] = xxh3_64 of the chunk_nbytes "
     "bytes of `data` at i * stride, for i < count, with the GIL released. `data` is any "
     "contiguous buffer, `out` a writable native uint64 buffer; ValueError when either is "
     "too short."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef xxh3batch_module = {
    PyModuleDef_HEAD_INIT,
    "kvstore._native._xxh3batch",
    "xxh3_64 of many chunks in one call without the GIL, through python-xxhash's exported "
    "XXH3 function (see kvstore/checksum.py).",
    -1,
    xxh3batch_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__xxh3batch(void)
{
    return PyModule_Create(&xxh3batch_module);
}
