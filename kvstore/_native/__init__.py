"""kvstore's C extensions, in one place: ``_xxh3batch`` (a block's xxh3 checksums in one call
without the GIL, through python-xxhash's own XXH3 function) and ``_fileproto`` (a block file's
whole protocol in one call without the GIL).

Their sources (``xxh3batch.c``; ``fileproto.c`` and the ``fileproto_*.c`` compiled with it into
``_fileproto``, which share ``fileproto_internal.h``) share ``native_common.h``. Nothing imports the
extensions directly: :mod:`kvstore.native` binds each once per process under the
``KVSTORE_NATIVE`` switch, self-tests it and warns once where it falls back; their Python types
are the binding's protocols (:class:`kvstore.io.fileproto.NativeFileProto`, the batch call in
:mod:`kvstore.checksum`); every function has a Python reference that CI holds it to
(docs/reliability.md section 10).
"""
