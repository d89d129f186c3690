"""A read-only view of a store directory: documents, identities, geometry, block files.

Contract: nothing in this module (or anything in :mod:`kvstore.inspect`) writes to the store.
No probe file, no directory, no array document, no quarantine. That is why it does not go
through :class:`~kvstore.store.page_store.KVStore`, whose opening path is right for a server
(it creates missing fan-out directories and array documents and probes O_DIRECT with a
temporary file) and wrong for a tool pointed at a copy from another machine, possibly on a
read-only mount.

What is read: the root ``zarr.json`` (must be a kvstore store, else :class:`InspectError`), each
namespace's ``zarr.json`` (its identity), each array's ``zarr.json`` (compared with the
document format v1 prescribes for that identity; a difference is recorded as a problem, not
raised: the identity alone fixes the geometry), and directory listings of the fan-out
directories. Block contents are read by :mod:`kvstore.inspect.blockfile`.

Hostile trees: every directory is entered component by component without following a
symbolic link (:func:`kvstore.io.fileio.open_dir_nofollow`), entries are classified by
``lstat``, and a ``zarr.json`` is opened only when ``lstat`` says it is a regular file (a FIFO
would block the open). What cannot be read (a directory that cannot be listed, a block name
holding a FIFO or link, a namespace whose ``zarr.json`` is not a regular file) is recorded in
``problems`` / ``listing_problems`` (reported by the views as findings), and the rest is shown.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import EntryKindError, KvstoreError, StoreFormatError
from kvstore.identity import DType, GroupSpec, Identity
from kvstore.io.fileio import describe_kind, describe_os_error, open_dir_nofollow
from kvstore.keys import HASH_LO_BITS, chunk_key
from kvstore.store import metadata
from kvstore.store.format import ShardLayout
from kvstore.store.group_store import TMP_MARK
from kvstore.store.page_store import QUARANTINE

#: hex digits of the block hash that a shard file's path determines (70 bits -> 17 digits).
PATH_HEX_DIGITS = 17


class InspectError(KvstoreError):
    """A request the inspection tool cannot answer: unknown namespace, ambiguous hash, ..."""


def list_entries(
    root: Path, parts: Sequence[str], problems: dict[str, str]
) -> list[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of the entries of ``root/parts...``, entered without following a
    link; [] when it is missing. A component that is not a real directory, or a directory that
    cannot be listed, is recorded in ``problems`` (path -> why) and lists as empty."""
    where = str(root.joinpath(*parts))
    try:
        fd = open_dir_nofollow(root, parts)
    except FileNotFoundError:
        return []
    except EntryKindError as exc:
        problems.setdefault(str(exc).split(":", 1)[0], f"{exc} (not entered)")
        return []
    except OSError as exc:
        problems[where] = f"{where}: cannot list ({describe_os_error(exc)})"
        return []
    out: list[tuple[str, os.stat_result]] = []
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it]
        for name in names:
            try:
                out.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False)))
            except FileNotFoundError:
                continue
    except OSError as exc:
        problems[where] = f"{where}: cannot list ({describe_os_error(exc)})"
    finally:
        os.close(fd)
    return out


def read_document(directory: Path) -> dict[str, object] | None:
    """``metadata.read_document`` of a ``zarr.json`` that ``lstat`` shows is a regular file
    (never opened otherwise: a FIFO would block); a :class:`StoreFormatError` naming what is
    there instead."""
    path = directory / metadata.ZARR_JSON
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreFormatError(f"{path}: cannot stat ({describe_os_error(exc)})") from exc
    if not stat.S_ISREG(st.st_mode):
        raise StoreFormatError(
            f"{path}: expected a regular file, got {describe_kind(st.st_mode)} (never opened)"
        )
    return metadata.read_document(directory)


@dataclass(frozen=True)
class BlockFile:
    """One published shard file found in a fan-out directory."""

    path: Path
    hash_hi: int  # first byte of the block hash (fan-out directory)
    hash_lo: int  # next 62 bits (file name)
    nbytes: int  # size on disk
    mtime_ns: int

    @property
    def path_hex(self) -> str:
        """The first :data:`PATH_HEX_DIGITS` hex digits of the hash, as the path encodes them."""
        bits = (self.hash_hi << HASH_LO_BITS) | self.hash_lo  # 70 bits
        return f"{bits >> 2:0{PATH_HEX_DIGITS}x}"


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
    problems: tuple[str, ...] = ()  # array document missing or not the one format v1 prescribes
    compression: str = "none"  # the array's inner-chunk compression (its zarr.json)
    # path -> why, found while listing: unreadable directories, non-regular block names
    listing_problems: dict[str, str] = field(default_factory=dict, compare=False)

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

    def path_of(self, block_hash: bytes) -> Path:
        """Where the published shard file of ``block_hash`` lives."""
        return self.path / chunk_key(block_hash, self.leading_dims)

    def fanout_dir(self, hash_hi: int) -> Path:
        return self.path.joinpath("c", *(["0"] * self.leading_dims), str(hash_hi))

    def _fanout_parts(self, hash_hi: int) -> list[str]:
        """``fanout_dir(hash_hi)`` as components below the store root."""
        return [
            self.path.parent.name,
            self.path.name,
            "c",
            *(["0"] * self.leading_dims),
            str(hash_hi),
        ]

    def _listing(self, hash_hi: int) -> list[tuple[str, os.stat_result]]:
        return list_entries(
            self.path.parent.parent, self._fanout_parts(hash_hi), self.listing_problems
        )

    def files(self, fanouts: range | list[int] | None = None) -> list[BlockFile]:
        """Published shard files (temporary files skipped), sorted by path coordinates. A block
        name that is not a regular file is never opened: it goes to :attr:`listing_problems`."""
        found: list[BlockFile] = []
        for hi in fanouts if fanouts is not None else range(256):
            directory = self.fanout_dir(hi)
            for name, st in self._listing(hi):
                if not name.isdigit():
                    continue
                path = directory / name
                if not stat.S_ISREG(st.st_mode):
                    self.listing_problems[str(path)] = (
                        f"{path}: expected a block file, got {describe_kind(st.st_mode)} "
                        "(never opened)"
                    )
                    continue
                found.append(BlockFile(path, hi, int(name), st.st_size, st.st_mtime_ns))
        found.sort(key=lambda f: (f.hash_hi, f.hash_lo))
        return found

    def temp_files(self) -> list[Path]:
        """Leftover ``*.tmp-*`` files of interrupted writes."""
        out: list[Path] = []
        for hi in range(256):
            directory = self.fanout_dir(hi)
            out.extend(directory / name for name, _st in self._listing(hi) if TMP_MARK in name)
        return out


@dataclass(frozen=True)
class NamespaceView:
    """One namespace: its stored identity and one :class:`GroupView` per KV-cache group."""

    name: str
    path: Path
    identity: Identity
    groups: tuple[GroupView, ...]
    problems: tuple[str, ...] = ()

    def group(self, index: int) -> GroupView:
        if not 0 <= index < len(self.groups):
            raise InspectError(
                f"group: expected 0..{len(self.groups) - 1} in namespace {self.name}, got {index}"
            )
        return self.groups[index]

    def quarantined(self) -> list[Path]:
        """Files moved to ``quarantine/`` by servers that found them corrupt (a quarantine
        that is not a real directory is not entered: it lists as empty)."""
        directory = self.path / QUARANTINE
        problems: dict[str, str] = {}
        listed = list_entries(self.path.parent, [self.name, QUARANTINE], problems)
        return sorted(directory / name for name, st in listed if stat.S_ISREG(st.st_mode))


@dataclass
class StoreView:
    """A store root opened for reading only."""

    root: Path
    _namespaces: dict[str, NamespaceView] = field(default_factory=dict, repr=False)
    # path -> why: namespace-like directories that cannot be read (found by namespace_names)
    problems: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: Path | str) -> StoreView:
        """Open ``root``; :class:`InspectError` unless it is a kvstore format v1 store."""
        path = Path(root).absolute()
        if not path.is_dir():
            raise InspectError(f"store root {path}: expected a directory, got nothing there")
        try:
            doc = read_document(path)
        except StoreFormatError as exc:
            raise InspectError(str(exc)) from None
        if doc is None:
            raise InspectError(f"store root {path}: expected {metadata.ZARR_JSON}, found none")
        attrs = metadata.kvstore_attrs(doc)
        if attrs != metadata.STORE_ATTRS:
            raise InspectError(
                f"store root {path}: expected attributes.kvstore = {metadata.STORE_ATTRS}, "
                f"got {attrs or 'none'}"
            )
        return cls(path)

    def namespace_names(self) -> list[str]:
        """Directory names holding a regular ``zarr.json``, sorted. Links are not followed;
        a directory whose ``zarr.json`` is something else, or that cannot be read, is recorded
        in :attr:`problems` instead."""
        names = []
        for name, st in list_entries(self.root, [], self.problems):
            if name.startswith(".") or not stat.S_ISDIR(st.st_mode):
                continue
            doc = self.root / name / metadata.ZARR_JSON
            try:
                dst = os.lstat(doc)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self.problems[str(doc)] = f"{doc}: cannot stat ({describe_os_error(exc)})"
                continue
            if stat.S_ISREG(dst.st_mode):
                names.append(name)
            else:
                self.problems[str(doc)] = (
                    f"{doc}: expected a regular file, got {describe_kind(dst.st_mode)} "
                    "(never opened)"
                )
        return sorted(names)

    def namespace(self, name: str) -> NamespaceView:
        """The namespace in directory ``name`` (exact name; see :mod:`.resolve` for prefixes)."""
        cached = self._namespaces.get(name)
        if cached is None:
            cached = self._namespaces[name] = _open_namespace(self.root / name)
        return cached


def _open_namespace(path: Path) -> NamespaceView:
    try:
        doc = read_document(path)
    except StoreFormatError as exc:
        raise InspectError(str(exc)) from None
    if doc is None:
        raise InspectError(f"namespace {path.name}: expected {path}/zarr.json, found none")
    attrs = metadata.kvstore_attrs(doc)
    try:
        identity = Identity.from_json(attrs["identity"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InspectError(
            f"{path}/zarr.json: expected attributes.kvstore.identity, got {attrs or 'none'} ({exc})"
        ) from None
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
    array_path = ns_path / f"g{index}"
    problems: list[str] = []
    try:
        doc = read_document(array_path)
    except StoreFormatError as exc:
        doc, problems = None, [str(exc)]
    if doc is None and not problems:
        problems.append(f"{array_path}/zarr.json: expected the array document, found none")
    compression = "none"
    if doc is not None:
        try:
            compression = metadata.array_compression(doc, array_path)
        except StoreFormatError as exc:
            problems.append(str(exc))
    expected = json.loads(metadata.array_document(identity, index, compression))
    if doc is not None and doc != expected:
        problems.append(
            f"{array_path}/zarr.json: expected the format v1 array document of this identity, "
            "got a different one"
        )
    return GroupView(
        namespace=ns_path.name,
        digest=identity.digest,
        index=index,
        spec=spec,
        dtype=dtype,
        tokens=identity.tokens_per_block,
        layout=ShardLayout.for_group(spec, identity.tokens_per_block, dtype.itemsize),
        path=array_path,
        leading_dims=metadata.leading_dims(spec),
        problems=tuple(problems),
        compression=compression,
    )
