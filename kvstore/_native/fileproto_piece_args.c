/* kvstore._native._fileproto: the checks of a piece batch's arguments (publish_pieces,
 * read_pieces), made once with the GIL held: int64 buffers, piece counts and sizes
 * (overflow-checked), the pieces' places and chunk order, the header, and each block's names
 * and buffers. */

#include "fileproto_internal.h"

void
kv_fp_release_piece_blocks(piece_block *blocks, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(blocks[i].tmp);
        Py_XDECREF(blocks[i].final);
        if (blocks[i].header.obj != NULL) {
            PyBuffer_Release(&blocks[i].header);
        }
        if (blocks[i].span.obj != NULL) {
            PyBuffer_Release(&blocks[i].span);
        }
    }
    PyMem_Free(blocks);
}

/* ``obj`` as native int64 values aligned to 8 bytes (``count`` of them; any number when
 * count < 0), acquired into *view; -1 with TypeError/ValueError naming ``what``. */
static int
int64_buffer(const char *call, PyObject *obj, Py_buffer *view, const char *what,
             Py_ssize_t count)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: expected %s as a C-contiguous int64 buffer, got %.200s", call, what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *f = view->format != NULL ? view->format : "B";
    if (f[0] == '@' || f[0] == '=' || f[0] == '<') {
        f++;
    }
    if (view->itemsize != 8 || !(strcmp(f, "q") == 0 || strcmp(f, "l") == 0)
        || (count >= 0 && view->len / 8 != count) || (uintptr_t)view->buf % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected %s as %s%zd int64 values aligned to 8 bytes, got format "
                     "'%s', %zd bytes at address %% 8 = %d",
                     call, what, count < 0 ? "any number of (here " : "", count < 0 ? view->len / 8 : count,
                     view->format ? view->format : "B", view->len,
                     (int)((uintptr_t)view->buf % 8));
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The checks of the piece counts and sizes (GIL held): whole chunks, a span that fits in a
 * Py_ssize_t; p->span_nbytes and p->nchunks set. -1 with ValueError/OverflowError. */
static int
check_piece_sizes(const char *call, piece_plan *p)
{
    if (p->piece_nbytes <= 0 || p->chunk_nbytes <= 0 || p->piece_nbytes % p->chunk_nbytes != 0
        || p->alignment <= 0 || p->npieces <= 0 || p->npieces > IOV_MAX - 2) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected 1..%d pieces of whole chunks and an alignment > 0, got %zd "
                     "pieces of %zd bytes, chunks of %zd, alignment %zd",
                     call, IOV_MAX - 2, p->npieces, p->piece_nbytes, p->chunk_nbytes,
                     p->alignment);
        return -1;
    }
    if (__builtin_mul_overflow(p->npieces, p->piece_nbytes, &p->span_nbytes)) {
        PyErr_Format(PyExc_OverflowError,
                     "%s: expected a span below 2**63 bytes, got %zd pieces of %zd bytes", call,
                     p->npieces, p->piece_nbytes);
        return -1;
    }
    p->nchunks = p->span_nbytes / p->chunk_nbytes;
    return 0;
}

/* The checks of where the pieces lie (GIL held): they tile the span exactly (every start a
 * multiple of piece_nbytes, each place once), and slot_of is the chunk order that follows
 * from them (the span's chunk s, in the piece starting at its piece-sized place, is the
 * block's chunk of that piece and position). -1 with ValueError otherwise: a piece outside
 * the span would write or read memory that is not the block's, overlapping pieces or another
 * order would store checksums that are not the chunks'. */
static int
check_piece_places(const char *call, const piece_plan *p)
{
    /* piece_at[j]: the piece that starts at j * piece_nbytes (-1: none yet) */
    Py_ssize_t *piece_at = PyMem_Malloc((size_t)p->npieces * sizeof(Py_ssize_t));
    if (piece_at == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < p->npieces; j++) {
        piece_at[j] = -1;
    }
    for (Py_ssize_t k = 0; k < p->npieces; k++) {
        int64_t start = p->starts[k];
        if (start < 0 || start % p->piece_nbytes != 0 || start / p->piece_nbytes >= p->npieces
            || piece_at[start / p->piece_nbytes] >= 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s: expected the starts to tile the %zd-byte span with pieces of %zd "
                         "bytes (each a multiple of it, once), got %lld for piece %zd",
                         call, p->span_nbytes, p->piece_nbytes, (long long)start, k);
            PyMem_Free(piece_at);
            return -1;
        }
        piece_at[start / p->piece_nbytes] = k;
    }
    Py_ssize_t per_piece = p->piece_nbytes / p->chunk_nbytes;
    for (Py_ssize_t s = 0; s < p->nchunks; s++) {
        int64_t slot = (int64_t)(piece_at[s / per_piece] * per_piece + s % per_piece);
        if (p->slot_of[s] != slot) {
            PyErr_Format(PyExc_ValueError,
                         "%s: expected slot_of[%zd] = %lld (the chunk order the starts give), "
                         "got %lld",
                         call, s, (long long)slot, (long long)p->slot_of[s]);
            PyMem_Free(piece_at);
            return -1;
        }
    }
    PyMem_Free(piece_at);
    return 0;
}

/* The checks of the header (GIL held): file_nbytes >= 0, a header of header_nbytes >= 0
 * holding every checksum slot, header and span inside the file. -1 with ValueError or
 * OverflowError otherwise. */
int
kv_fp_check_piece_header(const char *call, const piece_plan *p)
{
    Py_ssize_t slots_end, data_end;
    if (p->file_nbytes < 0 || p->slots_offset < 0 || p->header_nbytes < 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected file_nbytes, slots_offset and the header's size >= 0, got "
                     "%zd, %zd and %zd",
                     call, p->file_nbytes, p->slots_offset, p->header_nbytes);
        return -1;
    }
    if (__builtin_mul_overflow(p->nchunks, (Py_ssize_t)8, &slots_end)
        || __builtin_add_overflow(slots_end, p->slots_offset, &slots_end)
        || __builtin_add_overflow(p->header_nbytes, p->span_nbytes, &data_end)) {
        PyErr_Format(PyExc_OverflowError,
                     "%s: expected the slots (%zd at %zd) and the %zd-byte header and span to "
                     "end below 2**63",
                     call, p->nchunks, p->slots_offset, p->header_nbytes);
        return -1;
    }
    if (slots_end > p->header_nbytes || data_end > p->file_nbytes) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected %zd checksum slots at %zd inside the %zd-byte header, and "
                     "header and %zd-byte span inside the %zd-byte file",
                     call, p->nchunks, p->slots_offset, p->header_nbytes, p->span_nbytes,
                     p->file_nbytes);
        return -1;
    }
    return 0;
}

/* Acquire the (tmp, final, header, span) items (reads: (path, header, span)) from a snapshot of
 * ``items_obj`` and check each against the plan; NULL with an exception (nothing held)
 * otherwise. */
piece_block *
kv_fp_acquire_piece_blocks(PyObject *items_obj, const piece_plan *p, int reading,
                           Py_ssize_t *count)
{
    const char *call = reading ? "read_pieces" : "publish_pieces";
    const char *shape = reading ? "(path, header, span)" : "(tmp, final, header, span)";
    Py_ssize_t size = reading ? 3 : 4;
    PyObject *seq;
    Py_ssize_t n;
    piece_block *blocks = kv_fp_sequence_slots(
        items_obj, "file protocol: expected the blocks as a sequence of tuples",
        sizeof(piece_block), &seq, &n);
    if (blocks == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        piece_block *b = &blocks[i];
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != size) {
            PyErr_Format(PyExc_TypeError, "%s: expected block %zd as a %s tuple, got %.200s",
                         call, i, shape, Py_TYPE(item)->tp_name);
            goto fail;
        }
        /* reads: the file's path in ``final`` (tmp unused) */
        if ((!reading && !PyUnicode_FSConverter(PyTuple_GET_ITEM(item, 0), &b->tmp))
            || !PyUnicode_FSConverter(PyTuple_GET_ITEM(item, size - 3), &b->final)) {
            goto fail;
        }
        PyObject *header = PyTuple_GET_ITEM(item, size - 2);
        PyObject *span = PyTuple_GET_ITEM(item, size - 1);
        if (PyObject_GetBuffer(header, &b->header, PyBUF_WRITABLE) < 0) {
            b->header.obj = NULL;
            PyErr_Format(PyExc_TypeError,
                         "%s: expected block %zd's header as a writable contiguous buffer, got "
                         "%.200s",
                         call, i, Py_TYPE(header)->tp_name);
            goto fail;
        }
        if (PyObject_GetBuffer(span, &b->span, reading ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
            b->span.obj = NULL;
            PyErr_Format(PyExc_TypeError,
                         "%s: expected block %zd's span as a %scontiguous buffer, got %.200s",
                         call, i, reading ? "writable " : "", Py_TYPE(span)->tp_name);
            goto fail;
        }
        if (b->header.len != p->header_nbytes || b->span.len != p->span_nbytes) {
            PyErr_Format(PyExc_ValueError,
                         "%s: block %zd: expected a header of %zd bytes and a span of %zd "
                         "bytes, got %zd and %zd",
                         call, i, p->header_nbytes, p->span_nbytes, b->header.len, b->span.len);
            goto fail;
        }
        /* A publish fills the header's slots while it hashes the span: apart, or the sums
         * would depend on the order of the two (a read would fill one with the other). */
        if (kv_fp_overlaps(b->header.buf, b->header.len, b->span.buf, b->span.len)) {
            PyErr_Format(PyExc_ValueError,
                         "%s: block %zd: expected its header and span in separate memory, got "
                         "an overlap",
                         call, i);
            goto fail;
        }
    }
    Py_DECREF(seq);
    *count = n;
    return blocks;
fail:
    Py_DECREF(seq);
    kv_fp_release_piece_blocks(blocks, n);
    return NULL;
}

/* The geometry arguments both batch calls share, checked (GIL held): the capsule, starts and
 * slot_of acquired into *starts_view and *slot_view (the caller releases both on success;
 * nothing is held on failure), p's counts set, the pieces' places checked; -1 with an
 * exception. */
int
kv_fp_parse_piece_geometry(const char *call, piece_plan *p, PyObject *starts_obj,
                           PyObject *slot_obj, PyObject *capsule, Py_buffer *starts_view,
                           Py_buffer *slot_view)
{
    void *address = PyCapsule_GetPointer(capsule, XXH3_CAPSULE_NAME);
    if (address == NULL) {
        return -1;
    }
    memcpy(&p->fn, &address, sizeof p->fn);
    if (int64_buffer(call, starts_obj, starts_view, "starts", -1) < 0) {
        return -1;
    }
    p->npieces = starts_view->len / 8;
    p->starts = (const int64_t *)starts_view->buf;
    if (check_piece_sizes(call, p) < 0) {
        PyBuffer_Release(starts_view);
        return -1;
    }
    if (int64_buffer(call, slot_obj, slot_view, "slot_of", p->nchunks) < 0) {
        PyBuffer_Release(starts_view);
        return -1;
    }
    p->slot_of = (const int64_t *)slot_view->buf;
    if (check_piece_places(call, p) < 0) {
        PyBuffer_Release(slot_view);
        PyBuffer_Release(starts_view);
        return -1;
    }
    return 0;
}
