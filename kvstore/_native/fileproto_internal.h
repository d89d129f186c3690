/* What the source files of kvstore._native._fileproto share (one extension module, compiled from
 * all of them; fileproto.c has the overview, the method table and PyInit__fileproto):
 *
 *   fileproto_args.c        argument checks every call shares (segments, sequences, modes)
 *   fileproto_transfer.c    the system-call loops (pwritev/preadv runs, plain writes, renameat2)
 *                           and the OSError of a failed call
 *   fileproto_hashed.c      checksums computed as the bytes pass (hashing arguments, groups)
 *   fileproto_write.c       write_new, write_new_hashed, sync_and_rename
 *   fileproto_read.c        read_regular, read_regular_hashed, exists_many
 *   fileproto_piece_args.c  the checks of a piece batch's arguments
 *   fileproto_pieces.c      publish_pieces, read_pieces
 *   fileproto_scan.c        list_dir_step, read_files (the offline tools' walks, many entries
 *                           per call)
 *   fileproto_rows.c        check_rows (the rules every row of whole block files must meet)
 *
 * Every function here is shared between those files (kv_fp_ prefix, hidden from the module's
 * symbol table: only PyInit__fileproto is exported); everything else stays static in its file.
 * native_common.h (shared with xxh3batch.c) gives the XXH3 capsule and the uint64 format test.
 */
#ifndef KVSTORE_FILEPROTO_INTERNAL_H
#define KVSTORE_FILEPROTO_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include "native_common.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef O_DIRECT
#define O_DIRECT 0
#endif
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
#define OPEN_FLAGS (O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK)
#define RENAME_NOREPLACE_FLAG 1u /* linux/fs.h RENAME_NOREPLACE */
#define NO_PROGRESS (-2)         /* a write loop's "pwritev made no progress" */

/* One file segment: where it goes in the file and the memory it is written from or read
 * into. */
typedef struct {
    Py_ssize_t offset;
    Py_buffer view;
} segment;

/* A hashed transfer's geometry (fileproto_hashed.c). ``fn``: XXH64_hash_t XXH3_64bits(const
 * void *input, size_t length), handed over by kvstore._native._xxh3batch.function() as a
 * capsule: the one binding of python-xxhash's function. */
typedef struct {
    xxh3_64_fn fn;
    Py_ssize_t first, last;   /* the hashed segments [first, last), each whole chunks */
    Py_ssize_t chunk_nbytes;  /* > 0 */
    Py_ssize_t group_nbytes;  /* whole chunks, at least one */
    uint64_t *sums;           /* one native uint64 per chunk of those segments, in order */
} hashing;

/* One block of a publish_pieces batch: its temporary and final names, its header (fixed part
 * packed, checksum slots filled here) and the memory its pieces lie in. */
typedef struct {
    PyObject *tmp; /* bytes (PyUnicode_FSConverter) */
    PyObject *final;
    Py_buffer header;
    Py_buffer span;
    int outcome;
} piece_block;

/* The geometry every block of a batch shares (checked once, with the GIL). */
typedef struct {
    int flags, mode;
    Py_ssize_t file_nbytes, piece_nbytes, npieces, chunk_nbytes, nchunks, slots_offset;
    Py_ssize_t index_offset, alignment;
    Py_ssize_t header_nbytes, span_nbytes; /* every block's header and span: checked sizes */
    const int64_t *starts;  /* piece k starts at span + starts[k] */
    const int64_t *slot_of; /* the span's chunk s is the block's chunk slot_of[s] */
    Py_buffer index;
    xxh3_64_fn fn;
} piece_plan;

#pragma GCC visibility push(hidden)

/* fileproto_args.c (GIL held) */
void kv_fp_release_segments(segment *segs, Py_ssize_t n);
void *kv_fp_sequence_slots(PyObject *obj, const char *what, size_t item_size, PyObject **seq,
                           Py_ssize_t *n);
segment *kv_fp_acquire_segments(PyObject *obj, int writable, Py_ssize_t *count);
int kv_fp_overlaps(const void *a, Py_ssize_t a_len, const void *b, Py_ssize_t b_len);
int kv_fp_check_mode(const char *call, int mode);
PyObject *kv_fp_code_list(const int *codes, Py_ssize_t n);

/* fileproto_transfer.c (no GIL needed, but kv_fp_raise_errno) */
Py_ssize_t kv_fp_transfer_run(int fd, segment *segs, Py_ssize_t first, Py_ssize_t last,
                              int write);
Py_ssize_t kv_fp_run_end(segment *segs, Py_ssize_t first, Py_ssize_t limit);
int kv_fp_write_plain(int fd, int flags, segment *segs, Py_ssize_t lo, Py_ssize_t hi,
                      Py_ssize_t buffered_from, Py_ssize_t *end);
PyObject *kv_fp_raise_errno(int err, PyObject *path);
int kv_fp_renameat2_noreplace(const char *src, const char *dst);

/* fileproto_hashed.c */
int kv_fp_parse_hashing(hashing *h, PyObject *capsule, Py_ssize_t first, Py_ssize_t last,
                        Py_ssize_t chunk_nbytes, Py_ssize_t group_nbytes, PyObject *sums_obj,
                        Py_buffer *sums_view, segment *segs, Py_ssize_t n);
int kv_fp_hashed_transfer(int fd, segment *segs, const hashing *h, int write, Py_ssize_t *end,
                          Py_ssize_t *short_at, Py_ssize_t *short_want, Py_ssize_t *short_got);

/* fileproto_piece_args.c (GIL held) */
void kv_fp_release_piece_blocks(piece_block *blocks, Py_ssize_t n);
int kv_fp_check_piece_header(const char *call, const piece_plan *p);
piece_block *kv_fp_acquire_piece_blocks(PyObject *items_obj, const piece_plan *p, int reading,
                                        Py_ssize_t *count);
int kv_fp_parse_piece_geometry(const char *call, piece_plan *p, PyObject *starts_obj,
                               PyObject *slot_obj, PyObject *capsule, Py_buffer *starts_view,
                               Py_buffer *slot_view);

/* The module's functions (METH_VARARGS), in fileproto.c's method table. */
PyObject *kv_fp_write_new(PyObject *module, PyObject *args);        /* fileproto_write.c */
PyObject *kv_fp_write_new_hashed(PyObject *module, PyObject *args); /* fileproto_write.c */
PyObject *kv_fp_sync_and_rename(PyObject *module, PyObject *args);  /* fileproto_write.c */
PyObject *kv_fp_read_regular(PyObject *module, PyObject *args);     /* fileproto_read.c */
PyObject *kv_fp_read_regular_hashed(PyObject *module, PyObject *args); /* fileproto_read.c */
PyObject *kv_fp_exists_many(PyObject *module, PyObject *args);      /* fileproto_read.c */
PyObject *kv_fp_publish_pieces(PyObject *module, PyObject *args);   /* fileproto_pieces.c */
PyObject *kv_fp_read_pieces(PyObject *module, PyObject *args);      /* fileproto_pieces.c */
PyObject *kv_fp_list_dir_step(PyObject *module, PyObject *args);    /* fileproto_scan.c */
PyObject *kv_fp_read_files(PyObject *module, PyObject *args);       /* fileproto_scan.c */
PyObject *kv_fp_check_rows(PyObject *module, PyObject *args);       /* fileproto_rows.c */

#pragma GCC visibility pop

#endif /* KVSTORE_FILEPROTO_INTERNAL_H */
