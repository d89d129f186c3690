"""The zarr v3 metadata documents of a store: root group, namespace groups, group arrays.

zarr-python builds every document (into an in-memory store), so they are exactly what zarr
itself would write; kvstore writes them to disk atomically (temporary file, fsync, rename), so
a server starting concurrently never sees half a document, and two servers creating the same
namespace at once write identical bytes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

import zarr
from zarr.codecs import BloscCodec
from zarr.storage import MemoryStore

from kvstore.config import COMPRESSION_NAME
from kvstore.errors import StoreFormatError
from kvstore.identity import GroupSpec, Identity
from kvstore.io.entries import describe_kind, describe_os_error
from kvstore.io.fileio import FileIO, sync_parents
from kvstore.io.vectored import write_fully
from kvstore.store.codec import Codec
from kvstore.store.format import FORMAT_VERSION, ShardLayout
from kvstore.store.paths import DOC_TMP_PREFIX, ZARR_JSON

STORE_ATTRS: dict[str, Any] = {"format": "kvstore", "version": FORMAT_VERSION}
MAX_DOCUMENT_BYTES = 1 << 20  # real documents are a few KiB (layer names of a large model)


def root_document() -> bytes:
    """The root group's zarr.json."""
    return _build(lambda st: zarr.open_group(st, mode="w", attributes={"kvstore": STORE_ATTRS}))


def namespace_document(identity: Identity) -> bytes:
    """A namespace group's zarr.json, carrying its identity and digest."""
    attrs: dict[str, Any] = {
        "kvstore": {"identity": identity.to_json(), "digest": identity.digest.hex()}
    }
    return _build(lambda st: zarr.open_group(st, mode="w", attributes=attrs))


def array_document(identity: Identity, index: int, compression: str = "none") -> bytes:
    """The zarr.json of array ``g<index>``: a shard per block, an inner chunk per (head, layer).

    ``compression`` other than "none" adds the blosc codec after ``bytes`` in the inner chain
    and names the setting in ``attributes.kvstore.compression`` (see store/compression.py);
    uncompressed documents are unchanged from format v1.
    """
    group = identity.groups[index]
    dtype = identity.dtype
    layout = ShardLayout.for_group(group, identity.tokens_per_block, dtype.itemsize)
    shape, inner, names = array_geometry(group, identity.tokens_per_block)
    shard_shape = (*shape[:-2], 1, 1)  # one shard = one block: every dim but the hash dims
    attrs: dict[str, Any] = {
        "kvstore": {
            "dtype": dtype.name,
            "group": index,
            "kind": group.kind,
            "layer_names": list(group.layer_names),
            "tokens_per_block": identity.tokens_per_block,
            "shard_header_nbytes": layout.header_nbytes,
            "chunk_stride": layout.chunk_stride,
        }
    }
    codec = Codec.for_name(compression, dtype.itemsize)
    if codec is not None:
        attrs["kvstore"]["compression"] = compression
    return _build(
        lambda st: zarr.create_array(
            st,
            shape=shape,
            chunks=inner,
            shards=shard_shape,
            dtype=dtype.zarr_dtype,
            compressors=None if codec is None else BloscCodec(**codec.zarr_config()),
            filters=None,
            fill_value=0,
            dimension_names=names,
            attributes=attrs,
        )
    )


def array_geometry(
    group: GroupSpec, tokens: int
) -> tuple[tuple[int, ...], tuple[int, ...], list[str]]:
    """(shape, inner chunk shape, dimension names) of a group array."""
    hash_dims = (256, 2**62)
    shape: tuple[int, ...]
    inner: tuple[int, ...]
    if group.kind == "mla":
        shape = (group.num_layers, tokens, group.latent_dim, *hash_dims)
        inner = (1, tokens, group.latent_dim, 1, 1)
        names = ["layer", "token", "latent", "hash_hi", "hash_lo"]
    else:
        shape = (group.num_kv_heads, group.num_layers, tokens, 2, group.head_dim, *hash_dims)
        inner = (1, 1, tokens, 2, group.head_dim, 1, 1)
        names = ["kv_head", "layer", "token", "kv", "head_dim", "hash_hi", "hash_lo"]
    return shape, inner, names


def leading_dims(group: GroupSpec) -> int:
    """Dimensions before the two hash dimensions."""
    return 3 if group.kind == "mla" else 5


def _build(create: Any) -> bytes:
    docs: dict[str, Any] = {}
    create(MemoryStore(store_dict=docs))
    (key,) = [k for k in docs if k.endswith(ZARR_JSON)]
    raw: bytes = docs[key].to_bytes()
    return raw


def write_document(  # noqa: PLR0913 - the document, where it goes, and the store's durability and permission settings
    fio: FileIO,
    directory: Path,
    content: bytes,
    durable: bool,
    file_mode: int = 0o600,
    dir_mode: int = 0o700,
) -> None:
    """Atomically write ``directory/zarr.json`` (created with its parents if needed)."""
    created = fio.makedirs(str(directory), dir_mode)
    if durable:
        sync_parents(fio, created)
    final = directory / ZARR_JSON
    tmp = directory / f"{DOC_TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    fd = fio.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL, file_mode)
    try:
        try:
            write_fully(fio, fd, [content], 0)  # a short pwritev must not truncate the document
            if durable:
                fio.fdatasync(fd)
        finally:
            fio.close(fd)
        try:
            fio.rename(str(tmp), str(final))
        except FileExistsError:  # created meanwhile by another process or node: keep theirs
            fio.unlink(str(tmp))
    except BaseException:
        with contextlib.suppress(OSError):
            fio.unlink(str(tmp))
        raise
    if durable:
        fio.fsync_dir(str(directory))


def read_document(directory: Path) -> dict[str, Any] | None:
    """The parsed ``directory/zarr.json``, or None if absent; a format error if unparsable.

    Documents are a few KiB; one larger than :data:`MAX_DOCUMENT_BYTES` is refused unread
    (a hostile or damaged store must not make its reader allocate what it declares).
    """
    path = directory / ZARR_JSON
    try:
        # O_NOFOLLOW: a zarr.json planted as a symbolic link is refused, not followed;
        # O_NONBLOCK: one planted as a FIFO is refused at once (fstat), never waited on.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _unreadable(path, exc) from exc
    try:
        text = _read_regular(fd, path)
    except OSError as exc:
        raise _unreadable(path, exc) from exc
    finally:
        os.close(fd)
    if len(text) > MAX_DOCUMENT_BYTES:
        raise StoreFormatError(
            f"{path}: expected a zarr.json of at most {MAX_DOCUMENT_BYTES} bytes, got a larger one"
        )
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise StoreFormatError(
            f"{path}: expected a zarr v3 JSON document, got invalid JSON ({exc})"
        ) from exc
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3:
        raise StoreFormatError(f"{path}: expected a zarr v3 document (zarr_format 3)")
    return doc


def _read_regular(fd: int, path: Path) -> bytes:
    """Up to ``MAX_DOCUMENT_BYTES + 1`` bytes of the open regular file ``fd``."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise StoreFormatError(
            f"{path}: expected a zarr v3 document (a regular file), got {describe_kind(mode)}"
        )
    chunks: list[bytes] = []
    remaining = MAX_DOCUMENT_BYTES + 1
    while remaining:
        piece = os.read(fd, remaining)
        if not piece:
            break
        chunks.append(piece)
        remaining -= len(piece)
    return b"".join(chunks)


def _unreadable(path: Path, exc: OSError) -> StoreFormatError:
    """A format error naming ``path`` (an OSError from a descriptor call names the descriptor
    number instead: ``[Errno 21] Is a directory: 3``)."""
    if exc.errno == errno.ELOOP:
        return StoreFormatError(
            f"{path}: expected a zarr v3 document, got a symbolic link (kvstore follows no "
            "links below its root)"
        )
    return StoreFormatError(f"{path}: cannot read ({describe_os_error(exc)})")


def array_compression(doc: dict[str, Any], where: Path | str) -> str:
    """The compression setting an array document records ("none" when it names none)."""
    name = kvstore_attrs(doc).get("compression", "none")
    if not isinstance(name, str) or not COMPRESSION_NAME.fullmatch(name):
        raise StoreFormatError(
            f"{where}/zarr.json: attributes.kvstore.compression: expected 'none', 'lz4' or "
            f"'zstd-<1..9>', got {name!r}"
        )
    return name


def kvstore_attrs(doc: dict[str, Any]) -> dict[str, Any]:
    """``attributes.kvstore`` of a document ({} when absent)."""
    attributes = doc.get("attributes", {})
    attrs = attributes.get("kvstore", {}) if isinstance(attributes, dict) else {}
    return attrs if isinstance(attrs, dict) else {}
