/* kvstore._native._fileproto: check_rows, the rules every row of a buffer of whole block files
 * must meet (read there by read_files) for the offline check to call the file intact.
 *
 * The rules are generic (byte runs equal to given bytes, byte runs of zeros, bytes within a
 * range, the key's coordinates, checksum slots against their chunks, a crc32c): this file knows
 * nothing of format v1. kvstore/store/row_check.py builds them from an array's layout and
 * holds the Python reference; kvstore/store/batch_check.py runs them. Pure computation: the
 * arguments are checked and copied with the GIL held, then the rows are checked without it.
 * Part of the one extension module (fileproto.c has the overview and the module table). */

#include "fileproto_internal.h"

typedef struct {
    Py_ssize_t offset, length;
    unsigned char *bytes; /* equal rules: a copy of the expected bytes; zero rules: NULL */
} run_rule;

typedef struct {
    Py_ssize_t offset;
    long low, high;
} range_rule;

typedef struct {
    Py_ssize_t row_nbytes;
    run_rule *equal;
    Py_ssize_t nequal;
    run_rule *zero;
    Py_ssize_t nzero;
    range_rule *ranges;
    Py_ssize_t nranges;
    Py_ssize_t hi_offset, lo_offset;
    long lo_shift;
    Py_ssize_t slots_offset, chunks, first, stride, chunk_nbytes;
    Py_ssize_t crc_offset;
    xxh3_64_fn fn;
} row_rules;

/* -- crc32c (Castagnoli, reflected 0x82F63B78): the header checksum ------------------------- */

static uint32_t crc32c_table[256];
static int crc32c_ready = 0; /* set once, with the GIL held, before any loop reads the table */

static void
crc32c_init(void)
{
    if (crc32c_ready) {
        return;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) {
            c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        }
        crc32c_table[n] = c;
    }
    crc32c_ready = 1;
}

static uint32_t
crc32c(const unsigned char *p, Py_ssize_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (Py_ssize_t i = 0; i < n; i++) {
        c = crc32c_table[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

/* -- the arguments, with the GIL held ---------------------------------------------------------- */

/* ``obj``, one rule, as ``n`` integers (Py_ssize_t) in ``out``: a sequence of exactly n
 * integers; TypeError (not a sequence of n, not integers) or OverflowError (outside
 * Py_ssize_t) naming ``what`` and the rule's index. */
static int
rule_ints(PyObject *obj, Py_ssize_t n, Py_ssize_t *out, const char *what, Py_ssize_t index)
{
    PyObject *seq = PySequence_Tuple(obj);
    if (seq == NULL && !PyErr_ExceptionMatches(PyExc_TypeError)) {
        return -1; /* an iterator that failed: its own exception */
    }
    if (seq == NULL || PyTuple_GET_SIZE(seq) != n) {
        Py_XDECREF(seq);
        PyErr_Format(PyExc_TypeError, "check_rows: expected %s %zd as a sequence of %zd integers, "
                     "got %.200s", what, index, n, Py_TYPE(obj)->tp_name);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *number = PyNumber_Index(PyTuple_GET_ITEM(seq, k));
        if (number == NULL) {
            Py_DECREF(seq);
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                return -1; /* an __index__ that failed: its own exception */
            }
            PyErr_Format(PyExc_TypeError, "check_rows: expected %s %zd as a sequence of %zd "
                         "integers, got %.200s", what, index, n, Py_TYPE(obj)->tp_name);
            return -1;
        }
        out[k] = PyLong_AsSsize_t(number);
        Py_DECREF(number);
        if (out[k] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_OverflowError,
                         "check_rows: expected %s %zd's integers within 2**63", what, index);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

/* Whether [offset, offset + length) lies within a row; ValueError naming the rule if not. */
static int
within_row(const row_rules *r, Py_ssize_t offset, Py_ssize_t length, const char *what,
           Py_ssize_t index)
{
    if (offset < 0 || length < 0 || offset > r->row_nbytes || length > r->row_nbytes - offset) {
        PyErr_Format(PyExc_ValueError,
                     "check_rows: expected %s %zd within a row of %zd bytes, got %zd bytes at %zd",
                     what, index, r->row_nbytes, length, offset);
        return -1;
    }
    return 0;
}

static void
free_runs(run_rule *runs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; runs != NULL && i < n; i++) {
        PyMem_Free(runs[i].bytes);
    }
    PyMem_Free(runs);
}

/* The equal rules ((offset, bytes) pairs: the expected bytes copied) or the zero rules
 * ((offset, length) pairs). NULL with an exception set on bad input. */
static run_rule *
parse_runs(PyObject *obj, const row_rules *r, int equal, Py_ssize_t *count)
{
    const char *what = equal ? "equal rule" : "zero rule";
    PyObject *seq;
    Py_ssize_t n;
    run_rule *runs = kv_fp_sequence_slots(
        obj,
        equal ? "check_rows: expected the equal rules as a sequence of (offset, bytes) pairs"
              : "check_rows: expected the zero rules as a sequence of (offset, length) pairs",
        sizeof(run_rule), &seq, &n);
    if (runs == NULL) {
        return NULL;
    }
    Py_ssize_t got = 0;
    for (; got < n; got++) {
        PyObject *item = PyTuple_GET_ITEM(seq, got);
        if (!equal) {
            Py_ssize_t v[2];
            if (rule_ints(item, 2, v, what, got) < 0 || within_row(r, v[0], v[1], what, got) < 0) {
                goto fail;
            }
            runs[got].offset = v[0];
            runs[got].length = v[1];
            continue;
        }
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "check_rows: expected equal rule %zd as an (offset, bytes) pair, got "
                         "%.200s", got, Py_TYPE(item)->tp_name);
            goto fail;
        }
        PyObject *offset_obj = PyTuple_GET_ITEM(item, 0);
        PyObject *number = PyNumber_Index(offset_obj);
        if (number == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                goto fail;
            }
            PyErr_Format(PyExc_TypeError,
                         "check_rows: expected equal rule %zd's offset as an integer, got %.200s",
                         got, Py_TYPE(offset_obj)->tp_name);
            goto fail;
        }
        Py_ssize_t offset = PyLong_AsSsize_t(number);
        Py_DECREF(number);
        if (offset == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_OverflowError,
                         "check_rows: expected equal rule %zd's offset within 2**63", got);
            goto fail;
        }
        Py_buffer view;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &view, PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "check_rows: expected equal rule %zd's bytes as a contiguous buffer, "
                         "got %.200s", got, Py_TYPE(PyTuple_GET_ITEM(item, 1))->tp_name);
            goto fail;
        }
        Py_ssize_t length = view.len;
        if (within_row(r, offset, length, what, got) < 0) {
            PyBuffer_Release(&view);
            goto fail;
        }
        runs[got].bytes = PyMem_Malloc(length > 0 ? (size_t)length : 1);
        if (runs[got].bytes == NULL) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            goto fail;
        }
        memcpy(runs[got].bytes, view.buf, (size_t)length);
        PyBuffer_Release(&view);
        runs[got].offset = offset;
        runs[got].length = length;
    }
    Py_DECREF(seq);
    *count = n;
    return runs;
fail:
    Py_DECREF(seq);
    free_runs(runs, got + 1); /* slots past the failure are zeroed: bytes NULL */
    return NULL;
}

static range_rule *
parse_ranges(PyObject *obj, const row_rules *r, Py_ssize_t *count)
{
    PyObject *seq;
    Py_ssize_t n;
    range_rule *ranges = kv_fp_sequence_slots(
        obj, "check_rows: expected the range rules as a sequence of (offset, low, high)",
        sizeof(range_rule), &seq, &n);
    if (ranges == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t v[3];
        if (rule_ints(PyTuple_GET_ITEM(seq, i), 3, v, "range rule", i) < 0 ||
            within_row(r, v[0], 1, "range rule", i) < 0) {
            goto fail;
        }
        if (v[1] < 0 || v[1] > v[2] || v[2] > 255) {
            PyErr_Format(PyExc_ValueError,
                         "check_rows: expected range rule %zd's bounds as 0 <= low <= high <= "
                         "255, got %zd..%zd", i, v[1], v[2]);
            goto fail;
        }
        ranges[i].offset = v[0];
        ranges[i].low = (long)v[1];
        ranges[i].high = (long)v[2];
    }
    Py_DECREF(seq);
    *count = n;
    return ranges;
fail:
    Py_DECREF(seq);
    PyMem_Free(ranges);
    return NULL;
}

/* The key rule (hi_offset, lo_offset, lo_shift) and the slot rule (slots_offset, chunks,
 * first, stride, chunk_nbytes). */
static int
parse_key_and_slots(PyObject *key_obj, PyObject *slots_obj, row_rules *r)
{
    Py_ssize_t k[3];
    if (rule_ints(key_obj, 3, k, "key rule", 0) < 0 || within_row(r, k[0], 1, "key rule", 0) < 0
        || within_row(r, k[1], 8, "key rule", 0) < 0) {
        return -1;
    }
    if (k[2] < 1 || k[2] > 63) {
        PyErr_Format(PyExc_ValueError, "check_rows: expected the key's lo_shift in 1..63, got %zd",
                     k[2]);
        return -1;
    }
    r->hi_offset = k[0];
    r->lo_offset = k[1];
    r->lo_shift = (long)k[2];
    Py_ssize_t s[5];
    if (rule_ints(slots_obj, 5, s, "slot rule", 0) < 0) {
        return -1;
    }
    r->slots_offset = s[0];
    r->chunks = s[1];
    r->first = s[2];
    r->stride = s[3];
    r->chunk_nbytes = s[4];
    if (r->chunks < 0 || r->chunk_nbytes <= 0 || r->stride < r->chunk_nbytes) {
        PyErr_Format(PyExc_ValueError,
                     "check_rows: expected chunks >= 0 and 0 < chunk_nbytes <= stride, got %zd "
                     "chunks of %zd bytes every %zd", r->chunks, r->chunk_nbytes, r->stride);
        return -1;
    }
    /* Both runs end within the row: an overflowing size is past it. */
    Py_ssize_t slot_bytes, last_start, span;
    if (__builtin_mul_overflow(r->chunks, (Py_ssize_t)8, &slot_bytes)) {
        slot_bytes = PY_SSIZE_T_MAX;
    }
    if (within_row(r, r->slots_offset, slot_bytes, "slot rule's slots", 0) < 0) {
        return -1;
    }
    span = 0;
    if (r->chunks > 0) {
        if (__builtin_mul_overflow(r->chunks - 1, r->stride, &last_start) ||
            __builtin_add_overflow(last_start, r->chunk_nbytes, &span)) {
            span = PY_SSIZE_T_MAX;
        }
    }
    return within_row(r, r->first, span, "slot rule's chunks", 0);
}

/* The key coordinates of ``count`` rows: hash_hi in 0..255, hash_lo in 0..2**(64 - lo_shift)
 * - 1, as uint64 arrays (PyMem_Free). */
static uint64_t *
parse_coords(PyObject *obj, Py_ssize_t count, uint64_t max, const char *what)
{
    PyObject *seq;
    Py_ssize_t n;
    uint64_t *out = kv_fp_sequence_slots(obj, "check_rows: expected the coordinates as a sequence "
                                         "of integers", sizeof(uint64_t), &seq, &n);
    if (out == NULL) {
        return NULL;
    }
    if (n != count) {
        PyErr_Format(PyExc_ValueError, "check_rows: expected %zd %s values (one per row), got %zd",
                     count, what, n);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        PyObject *number = PyNumber_Index(item);
        if (number == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                goto fail;
            }
            PyErr_Format(PyExc_TypeError, "check_rows: expected %s[%zd] as an integer, got %.200s",
                         what, i, Py_TYPE(item)->tp_name);
            goto fail;
        }
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(number, &overflow);
        Py_DECREF(number);
        if (value == -1 && PyErr_Occurred()) {
            goto fail;
        }
        if (overflow != 0 || value < 0 || (uint64_t)value > max) {
            PyErr_Format(PyExc_ValueError, "check_rows: expected %s[%zd] in 0..%llu", what, i,
                         (unsigned long long)max);
            goto fail;
        }
        out[i] = (uint64_t)value;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    PyMem_Free(out);
    return NULL;
}

/* -- the rows, without the GIL ---------------------------------------------------------------- */

static int
all_zero(const unsigned char *p, Py_ssize_t n)
{
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, (size_t)(n - 1)) == 0);
}

static uint64_t
load_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--) {
        v = (v << 8) | p[k];
    }
    return v;
}

static uint32_t
load_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t
load_be64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int k = 0; k < 8; k++) {
        v = (v << 8) | p[k];
    }
    return v;
}

/* Whether one row meets every rule: the cheap ones first, the checksums last. */
static int
row_ok(const row_rules *r, const unsigned char *row, uint64_t hi, uint64_t lo)
{
    for (Py_ssize_t k = 0; k < r->nequal; k++) {
        const run_rule *e = &r->equal[k];
        if (memcmp(row + e->offset, e->bytes, (size_t)e->length) != 0) {
            return 0;
        }
    }
    for (Py_ssize_t k = 0; k < r->nranges; k++) {
        long b = row[r->ranges[k].offset];
        if (b < r->ranges[k].low || b > r->ranges[k].high) {
            return 0;
        }
    }
    if (row[r->hi_offset] != hi || load_be64(row + r->lo_offset) >> r->lo_shift != lo) {
        return 0;
    }
    for (Py_ssize_t k = 0; k < r->nzero; k++) {
        if (!all_zero(row + r->zero[k].offset, r->zero[k].length)) {
            return 0;
        }
    }
    if (crc32c(row, r->crc_offset) != load_le32(row + r->crc_offset)) {
        return 0;
    }
    for (Py_ssize_t c = 0; c < r->chunks; c++) {
        uint64_t slot = load_le64(row + r->slots_offset + 8 * c);
        if (slot == 0 || r->fn(row + r->first + c * r->stride, (size_t)r->chunk_nbytes) != slot) {
            return 0;
        }
    }
    return 1;
}

PyObject *
kv_fp_check_rows(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *rows_obj, *equal_obj, *zero_obj, *ranges_obj, *key_obj, *hi_obj, *lo_obj;
    PyObject *slots_obj, *capsule;
    Py_ssize_t count;
    row_rules r;
    memset(&r, 0, sizeof r);
    if (!PyArg_ParseTuple(args, "OnnOOOOOOOnO:check_rows", &rows_obj, &count, &r.row_nbytes,
                          &equal_obj, &zero_obj, &ranges_obj, &key_obj, &hi_obj, &lo_obj,
                          &slots_obj, &r.crc_offset, &capsule)) {
        return NULL;
    }
    if (count < 0 || r.row_nbytes <= 0) {
        PyErr_Format(PyExc_ValueError,
                     "check_rows: expected a row count >= 0 and a row size > 0, got %zd rows of "
                     "%zd bytes", count, r.row_nbytes);
        return NULL;
    }
    Py_buffer rows;
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "check_rows: expected the rows as a contiguous buffer, got %.200s",
                     Py_TYPE(rows_obj)->tp_name);
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t *his = NULL, *los = NULL;
    Py_ssize_t need;
    if (__builtin_mul_overflow(count, r.row_nbytes, &need)) {
        PyErr_Format(PyExc_OverflowError,
                     "check_rows: expected %zd rows of %zd bytes to fit below 2**63 bytes", count,
                     r.row_nbytes);
        goto done;
    }
    if (rows.len < need) {
        PyErr_Format(PyExc_ValueError,
                     "check_rows: expected rows of at least %zd bytes (%zd rows of %zd), got %zd",
                     need, count, r.row_nbytes, rows.len);
        goto done;
    }
    if ((r.equal = parse_runs(equal_obj, &r, 1, &r.nequal)) == NULL ||
        (r.zero = parse_runs(zero_obj, &r, 0, &r.nzero)) == NULL ||
        (r.ranges = parse_ranges(ranges_obj, &r, &r.nranges)) == NULL ||
        parse_key_and_slots(key_obj, slots_obj, &r) < 0 ||
        within_row(&r, r.crc_offset, 4, "crc rule", 0) < 0) {
        goto done;
    }
    if ((his = parse_coords(hi_obj, count, 255, "hash_hi")) == NULL ||
        (los = parse_coords(lo_obj, count, UINT64_MAX >> r.lo_shift, "hash_lo")) == NULL) {
        goto done;
    }
    void *address = PyCapsule_GetPointer(capsule, XXH3_CAPSULE_NAME);
    if (address == NULL) {
        goto done;
    }
    memcpy(&r.fn, &address, sizeof r.fn);
    crc32c_init();
    result = PyBytes_FromStringAndSize(NULL, count);
    if (result == NULL) {
        goto done;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    const unsigned char *base = rows.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        out[i] = (unsigned char)row_ok(&r, base + i * r.row_nbytes, his[i], los[i]);
    }
    Py_END_ALLOW_THREADS
done:
    free_runs(r.equal, r.nequal);
    free_runs(r.zero, r.nzero);
    PyMem_Free(r.ranges);
    PyMem_Free(his);
    PyMem_Free(los);
    PyBuffer_Release(&rows);
    return result;
}
