"""Opening a store and its namespaces.

* :class:`KVStore` - a store root (a zarr v3 group tagged ``kvstore`` format v1). Opening an
  empty or absent directory creates the store; opening a directory that holds something else
  is an error naming what was found.
* :meth:`KVStore.namespace` - open (or create) the namespace of an :class:`Identity`; a stored
  identity different from the caller's is an :class:`IdentityMismatchError`, never a reuse.
* :class:`Namespace` - one :class:`~kvstore.store.group_store.GroupStore` per KV-cache group,
  where the block operations live.

A store object owns its I/O engine (threads), chosen once at open by
:func:`kvstore.io.select.select_engine` from ``io_mode`` (one log line says which and why);
close it, or use it as a context manager.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from types import TracebackType
from typing import Any

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, EntryKindError, IdentityMismatchError, StoreFormatError
from kvstore.identity import Identity
from kvstore.io.engine import Engine
from kvstore.io.entries import open_dir_nofollow
from kvstore.io.fileio import PROBE_PREFIX, FileIO, sync_parents
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.io.select import Probes, select_engine
from kvstore.io.staging import Staging
from kvstore.store import metadata
from kvstore.store.array import GroupArray
from kvstore.store.compression import check_array_compression
from kvstore.store.format import ShardLayout
from kvstore.store.group_store import GroupStore
from kvstore.store.paths import (
    DOC_TMP_PREFIX,
    FANOUT,
    QUARANTINE,
    ZARR_JSON,
    ArrayPaths,
    array_dir,
)
from kvstore.store.types import StoreStats

# What Identity.namespace produces; anything else (.., /, a symlink trick) is refused.
NAMESPACE_NAME = re.compile(r"[a-z0-9_][a-z0-9._-]*-[0-9a-f]{12}")


class KVStore:
    """An open store root."""

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        fio: FileIO = DEFAULT_FILEIO,
        create: bool = True,
        read_only: bool = False,
        probes: Probes | None = None,
    ) -> None:
        self.config = config or StoreConfig()
        self.root = self.config.root.absolute()
        self.fio = fio
        # Read-only: nothing is created, probed, quarantined or touched (tools, copied stores).
        self.read_only = read_only
        self._open_root(create and not read_only)
        selection = select_engine(
            self.config.replace(root=self.root), fio, read_only=read_only, probes=probes
        )
        self.engine: Engine = selection.engine
        # How RankIO stages batches for this engine (host rows, pinned rows, device rows).
        self.staging: Staging = selection.staging
        # The checksum algorithm new blocks get (config "auto" resolved for this engine).
        self.checksum: str = selection.checksum
        self.stats = StoreStats()
        self._namespaces: dict[str, Namespace] = {}

    def _open_root(self, create: bool) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreFormatError(f"store root {self.root}: expected a directory, got a file")
        doc = metadata.read_document(self.root)
        if doc is None:
            if self.root.exists() and any(not _leftover(p.name) for p in self.root.iterdir()):
                raise StoreFormatError(
                    f"store root {self.root}: expected an empty directory or a kvstore store, "
                    "got a non-empty directory without zarr.json"
                )
            if not create:
                raise StoreFormatError(f"store root {self.root}: no kvstore store here")
            self._write_document(self.root, metadata.root_document())
            return
        attrs = metadata.kvstore_attrs(doc)
        if attrs != metadata.STORE_ATTRS:
            raise StoreFormatError(
                f"store root {self.root}: expected attributes.kvstore = {metadata.STORE_ATTRS}, "
                f"got {attrs or 'none'}"
            )

    # -- namespaces ----------------------------------------------------------------------------

    def namespace(
        self, identity: Identity, *, create: bool = True, adopt_compression: bool = False
    ) -> Namespace:
        """The namespace of ``identity``, created if absent (unless ``create`` is False).

        Existing arrays whose compression differs from the config's are refused
        (:class:`ConfigError`) unless ``adopt_compression`` (tools) or the store is read-only.
        """
        name = identity.namespace
        cached = self._namespaces.get(name)
        if cached is not None:
            if cached.identity != identity:
                raise IdentityMismatchError(
                    f"namespace {name}: {cached.identity.describe_difference(identity)}"
                )
            return cached
        path = self.root / name
        _refuse_symlinks(self.root, path)
        doc = metadata.read_document(path)
        if doc is None:
            if not create or self.read_only:
                raise StoreFormatError(f"namespace {name} does not exist in {self.root}")
            self._write_document(path, metadata.namespace_document(identity))
        else:
            stored = _stored_identity(path, doc)
            if stored != identity:
                raise IdentityMismatchError(
                    f"namespace {name} in {self.root} holds another identity: "
                    f"{stored.describe_difference(identity)}"
                )
        ns = Namespace(self, identity, path, adopt_compression)
        self._namespaces[name] = ns
        return ns

    def _write_document(self, directory: Path, content: bytes) -> None:
        config = self.config
        # Always durable, whatever ``durability`` says for blocks: a document is written once
        # per store, namespace and array, and one torn by a power loss would keep the store
        # from opening at all (a lost block is only a miss).
        metadata.write_document(
            self.fio, directory, content, True, config.file_mode, config.dir_mode
        )

    def open_namespace(self, name: str) -> Namespace:
        """An existing namespace by directory name, with the identity stored in it (tools)."""
        if not NAMESPACE_NAME.fullmatch(name):
            raise StoreFormatError(
                f"namespace name: expected <model slug>-<12 hex digits>, got {name!r}"
            )
        path = self.root / name
        _refuse_symlinks(self.root, path)
        doc = metadata.read_document(path)
        if doc is None:
            raise StoreFormatError(f"namespace {name}: expected {path}/zarr.json, found none")
        identity = _stored_identity(path, doc)
        if identity.namespace != name:
            raise StoreFormatError(
                f"namespace {name}: its identity hashes to {identity.namespace}; the directory "
                "was renamed or its zarr.json edited"
            )
        return self.namespace(identity, create=False, adopt_compression=True)

    def namespace_names(self) -> list[str]:
        """Directory names of the namespaces in this store, sorted: real directories holding
        a regular ``zarr.json`` (no symbolic link followed, nothing opened)."""
        return sorted(
            entry.name
            for entry in os.scandir(self.root)
            if entry.is_dir(follow_symlinks=False) and _is_regular(Path(entry.path) / ZARR_JSON)
        )

    def stored_identities(self) -> dict[str, Identity]:
        """The identity each namespace's document holds, by directory name, without opening
        any namespace. One whose document cannot be read or parsed is left out (the admin
        CLI's ``verify`` reports those)."""
        out: dict[str, Identity] = {}
        for name in self.namespace_names():
            try:
                doc = metadata.read_document(self.root / name)
                if doc is not None:
                    out[name] = _stored_identity(self.root / name, doc)
            except (StoreFormatError, ConfigError, OSError):
                continue
        return out

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Namespace:
    """The arrays of one identity; ``group(k)`` gives the block operations of group k."""

    def __init__(
        self, store: KVStore, identity: Identity, path: Path, adopt_compression: bool = False
    ) -> None:
        self.store = store
        self._adopt_compression = adopt_compression
        self.identity = identity
        self.path = path
        self.name = identity.namespace
        self.digest = identity.digest
        self.groups = [self._open_group(k) for k in range(len(identity.groups))]

    def group(self, index: int) -> GroupStore:
        return self.groups[index]

    def _open_group(self, index: int) -> GroupStore:
        identity = self.identity
        spec = identity.groups[index]
        array_path = array_dir(self.path, index)
        # Before anything is read or created there: a link at g<k> (or below) would send the
        # array's documents and blocks out of the root.
        root = self.store.root
        _refuse_symlinks(root, array_path)
        doc = metadata.read_document(array_path)
        config = self.store.config
        compression = config.compression
        if doc is not None:
            # The array's own setting is authoritative; tools (read-only, or opening a
            # namespace by name) adopt it, a server configured otherwise is refused.
            stored = metadata.array_compression(doc, array_path)
            if not (self.store.read_only or self._adopt_compression):
                check_array_compression(stored, compression, f"array {array_path}")
            compression = stored
        expected = metadata.array_document(identity, index, compression)
        created = doc is None
        if created:
            if self.store.read_only:
                raise StoreFormatError(f"{array_path}/zarr.json: missing (store opened read-only)")
            self.store._write_document(array_path, expected)
        elif doc != _json(expected):
            raise StoreFormatError(
                f"{array_path}/zarr.json: expected the array document of format v1 for this "
                "identity, got a different one (edited, or written by another kvstore version)"
            )
        array = GroupArray(
            namespace=self.name,
            namespace_digest=self.digest,
            index=index,
            spec=spec,
            layout=ShardLayout.for_group(spec, identity.tokens_per_block, identity.dtype.itemsize),
            paths=ArrayPaths(array_path, metadata.leading_dims(spec)),
            engine=self.store.engine,
            stats=self.store.stats,
            checksum=self.store.checksum,
            verify_reads=config.verify_reads,
            quarantine_dir=self.path / QUARANTINE if config.quarantine else None,
            read_only=self.store.read_only,
            compression=compression,
        )
        group = GroupStore(array, self.store.staging)
        _refuse_symlinks(root, group.fanout_dir(0).parent)
        for hi in FANOUT:
            _refuse_symlinks(group.fanout_dir(hi).parent, group.fanout_dir(hi))
        if created:  # pre-create the fan-out so block writes never mkdir
            made: list[str] = []
            for hi in FANOUT:
                made += self.store.fio.makedirs(str(group.fanout_dir(hi)), config.dir_mode)
            if config.durable:
                sync_parents(self.store.fio, made)
        return group


def _refuse_symlinks(root: Path, directory: Path) -> None:
    """:class:`StoreFormatError` if ``directory`` or a directory between ``root`` and it is not
    a real directory (a symbolic link, a FIFO, a file...). kvstore never follows links below
    its root: O_NOFOLLOW covers the file names it opens, this the directories (a link planted
    there would send blocks, with their prompts, elsewhere). Checked when a namespace is
    opened, by entering the chain as :func:`~kvstore.io.entries.open_dir_nofollow` does for
    every directory the store moves files into; ``kvstore verify`` reports links too. The root
    itself may be a link; a missing directory is not an error (it is created later)."""
    try:
        os.close(open_dir_nofollow(root, directory.relative_to(root).parts))
    except FileNotFoundError:
        return
    except EntryKindError as exc:
        raise StoreFormatError(
            f"{exc} (kvstore follows no links below its root: move or link the whole root "
            "instead; run `kvstore verify --fix` or remove it)"
        ) from None
    except OSError as exc:  # e.g. EACCES on an unreadable directory
        raise StoreFormatError(f"{directory}: cannot check the store directory ({exc})") from exc


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _leftover(name: str) -> bool:
    """A file a crash of kvstore itself may leave in a store root before its zarr.json exists
    (a document being written, the O_DIRECT probe): the root is still empty for opening."""
    return name.startswith((DOC_TMP_PREFIX, PROBE_PREFIX))


def _stored_identity(path: Path, doc: dict[str, Any]) -> Identity:
    attrs = metadata.kvstore_attrs(doc)
    try:
        return Identity.from_json(attrs["identity"])
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreFormatError(
            f"{path}/zarr.json: expected attributes.kvstore.identity of a kvstore namespace, "
            f"got {attrs or 'none'} ({exc})"
        ) from exc


def _json(raw: bytes) -> dict[str, object]:
    doc: dict[str, object] = json.loads(raw)
    return doc
