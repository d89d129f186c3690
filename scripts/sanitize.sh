#!/usr/bin/env bash
# Sanitizer run (CI): kvstore's C extensions built with ASan + UBSan into build/sanitize/ (the
# in-place builds of `pip install -e .` stay untouched), then the native and store tests run
# against that build. Usage: scripts/sanitize.sh [pytest args]; $PYTHON overrides .venv's.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-$root/.venv/bin/python}"
out="$root/build/sanitize/kvstore"

# Headers and suffix of the interpreter that will load the modules, not of whatever python3
# is on PATH.
include="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
suffix="$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
# -fno-sanitize-recover: a UBSan finding fails the run instead of scrolling past.
# -Werror: the sources compile clean with -Wall -Wextra at -O1; keep them so.
cflags=(-O1 -g -fno-omit-frame-pointer "-fsanitize=address,undefined"
  -fno-sanitize-recover=undefined -Wall -Wextra -Werror -shared -fPIC -I"$include")
mkdir -p "$out"
gcc "${cflags[@]}" kvstore/_native/xxh3batch.c -o "$out/_xxh3batch$suffix" -ldl
# One module from all its sources (kvstore/_native/fileproto_internal.h lists them).
gcc "${cflags[@]}" kvstore/_native/fileproto.c kvstore/_native/fileproto_*.c \
  -o "$out/_fileproto$suffix"

# python is not instrumented, so the ASan runtime must be the first library in the process
# (ASan refuses to start from a dlopen'd module). libubsan needs no such place; it is
# preloaded only so that both runtimes of the link line are there before any module loads.
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
# detect_leaks=0: CPython and torch keep allocations alive until exit by design.
# allocator_may_return_null=1: tests that ask for huge buffers get MemoryError, not an abort.
export LD_PRELOAD
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1
# abort_on_error: a UBSan finding exits 134 like an ASan one, not 1 like a failed test.
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:abort_on_error=1
# pymalloc carves objects out of 256 KiB arenas, so ASan would see no bounds between them.
export PYTHONMALLOC=malloc
# kvstore/native.py loads the extensions from this directory; "require": a missing or broken
# one is an error, never a silent fallback to the Python reference (which would test nothing).
export KVSTORE_NATIVE=require KVSTORE_NATIVE_DIR="$out"
# The bindings the run uses, from which files: the sanitized ones, or exit 2 (require).
"$python" -m kvstore.cli --version

if [ "$#" -eq 0 ]; then
  set -- tests/native tests/io tests/store
fi
rc=0
"$python" -m pytest -p no:cacheprovider -q "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  # An empty run (a wrong path, everything deselected) proves nothing about the build.
  echo "FAIL: pytest collected no tests (exit 5)" >&2
  exit 1
fi
exit "$rc"
