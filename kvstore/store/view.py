"""A read-only view of a store directory: documents, identities, geometry, block files.

The admin CLI (``kvstore``) and the inspection tool (``kvstore-inspect``) open stores through
this view, never through :class:`~kvstore.store.page_store.KVStore`, whose opening path is
right for a server (it creates missing fan-out directories and array documents and probes
O_DIRECT with a file in the root) and wrong for a tool pointed at a live store or at a copy
from another machine, possibly on a read-only mount.

Contract: nothing here writes, creates, moves or touches anything. What is read: the root
``zarr.json`` (it must be a kvstore store, else :class:`~kvstore.errors.StoreFormatError`),
each namespace's ``zarr.json`` (its identity), each array's ``zarr.json`` (its compression, and
on request whether it is the document format v1 prescribes), and directory listings
(:mod:`kvstore.store.paths`). A hostile tree is normal input: directories are listed without
following links (:func:`kvstore.store.paths.list_dir`, called through its module so that tests
can inject listing failures there), a ``zarr.json`` is read only when
``lstat`` says it is a regular file in a real directory. Block contents are checked by
:mod:`kvstore.store.full_check`.

A namespace directory whose document cannot be read, or whose identity hashes to another name
(renamed, or its ``zarr.json`` edited), is a :class:`Problem` of the store, not one of its
:attr:`StoreView.namespaces`; the renamed one can still be opened by name
(:meth:`StoreView.namespace`) for inspection, and then says so in its ``problems``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from kvstore.errors import KvstoreError, StoreFormatError
from kvstore.identity import DType, GroupSpec, Identity
from kvstore.io.entries import describe_kind
from kvstore.store import metadata, paths
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec
from kvstore.store.format import ShardLayout
from kvstore.store.paths import (
    FANOUT,
    QUARANTINE,
    ZARR_JSON,
    ArrayPaths,
    BlockFile,
    Problems,
    array_dir,
)


@dataclass(frozen=True)
class Problem:
    """A directory that looks like a namespace but cannot be used as one, or a directory that
    cannot be listed."""

    path: Path
    detail: str


@dataclass(frozen=True)
class GroupView:
    """Array ``g<index>`` of a namespace: geometry from the identity, files from disk."""

    namespace: str
    digest: bytes  # SHA-256 of the namespace identity (what block headers must carry)
    index: int
    spec: GroupSpec
    dtype: DType
    tokens: int  # tokens per block
    layout: ShardLayout
    path: Path  # the array directory
    leading_dims: int  # dimensions before the two hash dimensions
    compression: str = "none"  # the array's inner-chunk compression (its zarr.json)
    # Reading the array document failed, or its compression is not one kvstore knows.
    document_error: str | None = field(default=None, compare=False)
    identity: Identity | None = field(default=None, compare=False, repr=False)
    # path -> why, found while listing: unreadable directories, non-regular block names.
    listing_problems: Problems = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.spec.kind == "mla"

    @property
    def num_heads(self) -> int:
        """KV heads of the array (1 for MLA)."""
        return self.layout.num_heads

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def label(self) -> str:
        return f"{self.namespace}/g{self.index}"

    @cached_property
    def paths(self) -> ArrayPaths:
        return ArrayPaths(self.path, self.leading_dims)

    @cached_property
    def shard(self) -> ShardSpec:
        """What every block file of this array must be (for :mod:`kvstore.store.check`)."""
        codec = Codec.for_name(self.compression, self.layout.itemsize)
        return ShardSpec(self.layout, self.digest, self.index, codec)

    @property
    def fanout_root(self) -> Path:
        """The directory holding the 256 fan-out directories."""
        return self.paths.fanout_root

    def path_of(self, block_hash: bytes) -> Path:
        """Where the published shard file of ``block_hash`` lives."""
        return Path(self.paths.block(block_hash))

    def fanout_dir(self, hash_hi: int) -> Path:
        return self.paths.fanout_dir(hash_hi)

    @property
    def store_root(self) -> Path:
        return self.path.parent.parent

    def files(self, fanouts: Iterable[int] = FANOUT) -> list[BlockFile]:
        """Published shard files (temporary files skipped), sorted by path coordinates.

        Every directory is entered from the store root without following a link; a block name
        that is not a regular file is never opened, and a directory that cannot be listed is
        skipped: both go to :attr:`listing_problems`.
        """
        found = list(
            self.paths.list_blocks(fanouts, root=self.store_root, problems=self.listing_problems)
        )
        found.sort(key=lambda f: (f.hash_hi, f.hash_lo))
        return found

    def iter_files(
        self, fanouts: Iterable[int] = FANOUT, *, problems: Problems | None = None
    ) -> Iterator[BlockFile]:
        """:meth:`files` one block at a time, unsorted: fan-out directories in the order of
        ``fanouts``, each in listing order. A group of any size in the memory of one fan-out
        directory's listing (:func:`kvstore.store.paths.list_blocks`), which is what tools that
        only count or sample the blocks of a big store need.

        Same rules as :meth:`files`; what they record goes to ``problems`` when given (a caller
        may pass a bounded collector), else to :attr:`listing_problems`.
        """
        return self.paths.list_blocks(
            fanouts,
            root=self.store_root,
            problems=self.listing_problems if problems is None else problems,
        )

    def file_of(self, block_hash: bytes) -> BlockFile | None:
        """The published shard file of ``block_hash``, with one ``lstat`` and the same rules
        as :meth:`files` (None: no such file; a name that is not a regular file, or a
        directory that cannot be entered, also goes to :attr:`listing_problems`)."""
        return self.paths.block_file(
            block_hash, root=self.store_root, problems=self.listing_problems
        )

    def temp_files(self) -> list[Path]:
        """Leftover temporary files of interrupted writes."""
        return list(self.paths.list_temps(root=self.store_root, problems=self.listing_problems))

    @cached_property
    def document_problem(self) -> str | None:
        """Why the array's ``zarr.json`` is not the document format v1 prescribes for the
        namespace's identity (missing, unreadable, different), or None."""
        if self.document_error is not None:
            return self.document_error
        where = f"{self.path}/{ZARR_JSON}"
        if self.identity is None:
            return None
        try:
            got = read_document(self.path)
        except StoreFormatError as exc:
            return str(exc)
        expected = json.loads(metadata.array_document(self.identity, self.index, self.compression))
        if got == expected:
            return None
        return (
            f"{where}: expected the format v1 array document of this identity, got "
            f"{'none' if got is None else 'a different one'}"
        )

    @property
    def problems(self) -> tuple[str, ...]:
        """What is wrong with the array's metadata (see :attr:`document_problem`)."""
        problem = self.document_problem
        return () if problem is None else (problem,)


@dataclass(frozen=True)
class NamespaceView:
    """One namespace: its stored identity and one :class:`GroupView` per KV-cache group."""

    name: str
    path: Path
    identity: Identity
    groups: tuple[GroupView, ...]
    problems: tuple[str, ...] = ()  # directory renamed, digest attribute edited

    @property
    def digest(self) -> bytes:
        return self.identity.digest

    @property
    def renamed(self) -> bool:
        """Whether the directory name is not the one its identity hashes to."""
        return self.identity.namespace != self.name

    def group(self, index: int) -> GroupView:
        if not 0 <= index < len(self.groups):
            raise KvstoreError(
                f"group: expected 0..{len(self.groups) - 1} in namespace {self.name}, got {index}"
            )
        return self.groups[index]

    def quarantined(self) -> list[Path]:
        """Files moved to ``quarantine/`` by servers that found them corrupt (a quarantine
        that is not a real directory is not entered: it lists as empty)."""
        directory = self.path / QUARANTINE
        try:
            listed = paths.list_dir(directory, root=self.path.parent)
        except OSError:
            return []
        return sorted(directory / name for name, st in listed if stat.S_ISREG(st.st_mode))


class StoreView:
    """A store root opened for reading only. Namespaces are read on first use, once."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).absolute()

    @classmethod
    def open(cls, root: Path | str) -> StoreView:
        """Open ``root``; :class:`StoreFormatError` unless it is a kvstore format v1 store."""
        path = Path(root).absolute()
        try:
            st = path.stat()
        except OSError:
            st = None
        if st is None or not stat.S_ISDIR(st.st_mode):
            got = "nothing there" if st is None else "a file"
            raise StoreFormatError(
                f"store root {path}: expected a kvstore store directory, got {got} (expected "
                "a directory)"
            )
        doc = read_document(path)
        if doc is None:
            raise StoreFormatError(
                f"store root {path}: expected a kvstore store (expected {ZARR_JSON} with "
                f"attributes.kvstore), got a directory without {ZARR_JSON}"
            )
        attrs = metadata.kvstore_attrs(doc)
        if attrs != metadata.STORE_ATTRS:
            raise StoreFormatError(
                f"store root {path}: expected attributes.kvstore = {metadata.STORE_ATTRS}, "
                f"got {attrs or 'none'}"
            )
        return cls(path)

    @cached_property
    def _read(self) -> tuple[dict[str, NamespaceView], tuple[Problem, ...]]:
        try:
            listed = paths.list_dir(self.root)
        except OSError as exc:
            raise StoreFormatError(
                f"store root {self.root}: cannot list ({exc.strerror or exc})"
            ) from exc
        found: dict[str, NamespaceView] = {}
        problems: list[Problem] = []
        for name, st in sorted(listed, key=lambda item: item[0]):
            if name.startswith(".") or not stat.S_ISDIR(st.st_mode):
                continue
            path = self.root / name
            try:
                doc = read_document(path)
            except StoreFormatError as exc:
                problems.append(Problem(path, str(exc)))
                continue
            if doc is None:
                continue  # not a namespace: a foreign entry (kvstore verify reports it)
            try:
                ns = _namespace_view(path, doc)
            except (KvstoreError, KeyError, TypeError, ValueError) as exc:
                problems.append(Problem(path, str(exc)))
                continue
            found[name] = ns
            if ns.renamed:
                problems.append(
                    Problem(
                        path,
                        f"namespace {name}: its identity hashes to {ns.identity.namespace}; the "
                        "directory was renamed or its zarr.json edited",
                    )
                )
        return found, tuple(problems)

    @property
    def namespaces(self) -> tuple[NamespaceView, ...]:
        """The usable namespaces (identity readable, directory named after it), by name."""
        return tuple(ns for ns in self._read[0].values() if not ns.renamed)

    @property
    def problems(self) -> tuple[Problem, ...]:
        """Namespace-like directories that cannot be used as namespaces."""
        return self._read[1]

    def namespace_names(self) -> list[str]:
        """Directory names of every namespace whose identity is readable (renamed ones too)."""
        return list(self._read[0])

    def namespace(self, name: str) -> NamespaceView:
        """The namespace in directory ``name``; a :class:`KvstoreError` naming the ones present."""
        found = self._read[0].get(name)
        if found is None:
            names = ", ".join(n.name for n in self.namespaces) or "none"
            raise KvstoreError(f"namespace: expected one of the store's ({names}), got {name!r}")
        return found


def read_document(directory: Path) -> dict[str, Any] | None:
    """:func:`metadata.read_document` after ``lstat`` checks that never open a hostile entry.

    ``directory`` must be a real directory (a symbolic link is not read through) and its
    ``zarr.json`` a regular file (a FIFO would block the open, a link could lead out of the
    root): anything else is a :class:`StoreFormatError` naming what was found. None when
    ``zarr.json`` is absent.
    """
    for path, want, kind in ((directory, stat.S_ISDIR, "a directory"),
                             (directory / ZARR_JSON, stat.S_ISREG, "a regular file")):  # fmt: skip
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreFormatError(f"{path}: cannot stat ({exc.strerror or exc})") from exc
        if not want(st.st_mode):
            raise StoreFormatError(
                f"{path}: expected {kind}, got {describe_kind(st.st_mode)} (never opened)"
            )
    return metadata.read_document(directory)


def _namespace_view(path: Path, doc: dict[str, Any]) -> NamespaceView:
    attrs = metadata.kvstore_attrs(doc)
    if "identity" not in attrs:
        raise StoreFormatError(
            f"{path}/{ZARR_JSON}: expected attributes.kvstore.identity of a kvstore "
            f"namespace, got {attrs or 'none'}"
        )
    identity = Identity.from_json(attrs["identity"])
    problems: list[str] = []
    if identity.namespace != path.name:
        problems.append(
            f"directory name: expected {identity.namespace} (from the stored identity), got "
            f"{path.name}; renamed, or zarr.json edited"
        )
    stored_digest = attrs.get("digest")
    if stored_digest != identity.digest.hex():
        problems.append(
            f"identity digest: expected {identity.digest.hex()[:12]}..., stored "
            f"{str(stored_digest)[:12]}..."
        )
    groups = tuple(_group_view(identity, path, k) for k in range(len(identity.groups)))
    return NamespaceView(path.name, path, identity, groups, tuple(problems))


def _group_view(identity: Identity, ns_path: Path, index: int) -> GroupView:
    spec = identity.groups[index]
    dtype = identity.dtype
    path = array_dir(ns_path, index)
    compression, error = "none", None
    try:
        doc = read_document(path)
        if doc is not None:
            compression = metadata.array_compression(doc, path)
    except StoreFormatError as exc:
        error = str(exc)
    return GroupView(
        namespace=ns_path.name,
        digest=identity.digest,
        index=index,
        spec=spec,
        dtype=dtype,
        tokens=identity.tokens_per_block,
        layout=ShardLayout.for_group(spec, identity.tokens_per_block, dtype.itemsize),
        path=path,
        leading_dims=metadata.leading_dims(spec),
        compression=compression,
        document_error=error,
        identity=identity,
    )
