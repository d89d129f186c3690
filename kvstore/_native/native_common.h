/* What kvstore's two C extensions share (kvstore/_native/xxh3batch.c; fileproto.c and the
 * fileproto_*.c files compiled with it, whose own shared declarations are fileproto_internal.h).
 *
 * The file protocol hashes with the XXH3 function xxh3batch.c binds (handed over as a capsule of
 * this name), and both accept the same uint64 buffers for checksums.
 */
#ifndef KVSTORE_NATIVE_COMMON_H
#define KVSTORE_NATIVE_COMMON_H

#include <Python.h>

#include <stdint.h>
#include <string.h>

/* python-xxhash's exported XXH3_64bits, as xxh3batch.c binds it. */
typedef uint64_t (*xxh3_64_fn)(const void *input, size_t length);
#define XXH3_CAPSULE_NAME "kvstore._native._xxh3batch.XXH3_64bits"

/* A native-endian uint64 element format of the buffer protocol (struct module codes). */
static inline int
is_uint64_format(const char *format, Py_ssize_t itemsize)
{
    if (itemsize != 8 || format == NULL) {
        return 0;
    }
    if (format[0] == '@' || format[0] == '=') {
        format++;
    }
#if PY_LITTLE_ENDIAN
    else if (format[0] == '<') {
        format++;
    }
#else
    else if (format[0] == '>' || format[0] == '!') {
        format++;
    }
#endif
    return (strcmp(format, "Q") == 0 || (sizeof(unsigned long) == 8 && strcmp(format, "L") == 0));
}

#endif /* KVSTORE_NATIVE_COMMON_H */
