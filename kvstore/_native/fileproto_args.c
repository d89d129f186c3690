/* kvstore._native._fileproto: the checks of the arguments the file-level calls share, made with
 * the GIL held: sequences snapshotted as tuples, (offset, buffer) segments acquired with their
 * offsets and ends checked (no overflow), overlapping memory, file modes. Part of the one
 * extension module (fileproto.c has the overview and the module table). */

#include "fileproto_internal.h"

void
kv_fp_release_segments(segment *segs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBuffer_Release(&segs[i].view);
    }
    PyMem_Free(segs);
}

/* ``obj`` snapshotted as a new tuple (*seq, a new reference; *n items) and a zeroed array of
 * one ``item_size`` slot per item (at least one), for the caller to fill and PyMem_Free. The
 * tuple holds every item for the call: a list the caller mutates meanwhile (from an item's
 * __fspath__ or __index__) changes nothing here. NULL with TypeError (``what``) or
 * MemoryError, and nothing held, otherwise. */
void *
kv_fp_sequence_slots(PyObject *obj, const char *what, size_t item_size, PyObject **seq,
                     Py_ssize_t *n)
{
    *seq = PySequence_Tuple(obj);
    if (*seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError, "%s, got %.200s", what, Py_TYPE(obj)->tp_name);
        }
        return NULL;
    }
    *n = PyTuple_GET_SIZE(*seq);
    void *slots = PyMem_Calloc(*n > 0 ? (size_t)*n : 1, item_size);
    if (slots == NULL) {
        Py_CLEAR(*seq);
        PyErr_NoMemory();
    }
    return slots;
}

/* ``obj`` (any integer: int, numpy integers, anything with __index__) as a Py_ssize_t in
 * *out; 0, or -1 with TypeError or OverflowError naming ``what`` (item ``i``). */
static int
index_arg(PyObject *obj, Py_ssize_t *out, const char *what, Py_ssize_t i)
{
    PyObject *number = PyNumber_Index(obj);
    if (number == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError,
                         "file protocol: expected segment %zd's %s as an integer, got %.200s", i,
                         what, Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    *out = PyLong_AsSsize_t(number);
    if (*out == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Format(PyExc_OverflowError,
                         "file protocol: expected segment %zd's %s below 2**63, got %S", i,
                         what, number);
        }
        Py_DECREF(number);
        return -1;
    }
    Py_DECREF(number);
    return 0;
}

/* Acquire ``obj``, a sequence of (offset, buffer) pairs in file order, as segments (writable
 * buffers when ``writable``). NULL with an exception set on bad input; *count is set. */
segment *
kv_fp_acquire_segments(PyObject *obj, int writable, Py_ssize_t *count)
{
    PyObject *seq;
    Py_ssize_t n;
    segment *segs = kv_fp_sequence_slots(obj,
                                         "file protocol: expected segments as a sequence of "
                                         "(offset, buffer) pairs",
                                         sizeof(segment), &seq, &n);
    if (segs == NULL) {
        return NULL;
    }
    Py_ssize_t got = 0;
    for (; got < n; got++) {
        PyObject *item = PyTuple_GET_ITEM(seq, got);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "file protocol: expected segment %zd as an (offset, buffer) pair, "
                         "got %.200s",
                         got, Py_TYPE(item)->tp_name);
            goto fail;
        }
        Py_ssize_t offset;
        if (index_arg(PyTuple_GET_ITEM(item, 0), &offset, "offset", got) < 0) {
            goto fail;
        }
        if (offset < 0) {
            PyErr_Format(PyExc_ValueError,
                         "file protocol: expected segment %zd at an offset >= 0, got %zd", got,
                         offset);
            goto fail;
        }
        int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &segs[got].view, flags) < 0) {
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyErr_Format(PyExc_TypeError,
                         "file protocol: expected segment %zd's memory as a %s buffer, "
                         "got %.200s (%S)",
                         got, writable ? "writable contiguous" : "contiguous",
                         Py_TYPE(PyTuple_GET_ITEM(item, 1))->tp_name,
                         value != NULL ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            goto fail;
        }
        segs[got].offset = offset;
        Py_ssize_t end;
        if (__builtin_add_overflow(offset, segs[got].view.len, &end)) {
            PyErr_Format(PyExc_OverflowError,
                         "file protocol: expected segment %zd to end below 2**63, got %zd "
                         "bytes at %zd",
                         got, segs[got].view.len, offset);
            got++; /* its buffer is held: released below */
            goto fail;
        }
    }
    Py_DECREF(seq);
    *count = n;
    return segs;
fail:
    Py_DECREF(seq);
    kv_fp_release_segments(segs, got);
    return NULL;
}

/* Whether the memory [a, a + a_len) and [b, b + b_len) share a byte. */
int
kv_fp_overlaps(const void *a, Py_ssize_t a_len, const void *b, Py_ssize_t b_len)
{
    uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return a_len > 0 && b_len > 0 && a0 < b0 + (uintptr_t)b_len && b0 < a0 + (uintptr_t)a_len;
}

/* A file mode of open(2): 0..07777; -1 with ValueError naming ``call`` otherwise. */
int
kv_fp_check_mode(const char *call, int mode)
{
    if (mode < 0 || mode > 07777) {
        PyErr_Format(PyExc_ValueError, "%s: expected a file mode 0..0o7777, got %d", call, mode);
        return -1;
    }
    return 0;
}

/* The list of ``n`` per-item codes a batch call returns (exists_many, read_files); NULL with
 * MemoryError. */
PyObject *
kv_fp_code_list(const int *codes, Py_ssize_t n)
{
    PyObject *result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *value = PyLong_FromLong(codes[i]);
        if (value == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, value);
    }
    return result;
}
