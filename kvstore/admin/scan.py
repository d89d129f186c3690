"""Walking a store directory cold, without opening it for writing.

:func:`open_root` checks that a directory is a kvstore store (format v1) and reads its namespaces'
identities from their ``zarr.json``; :func:`scan_store` lists every file below it and sorts each
into one of:

* **block**: a published shard file ``<ns>/g<k>/c/0/…/0/<hi>/<lo>`` (decimal ``lo`` < 2^62);
* **temp**: a file being written (``.<lo>.tmp-<token>``) or a metadata document being replaced
  (``.zarr.json.tmp-*``), or a left-over O_DIRECT probe (``.kvstore-probe-*``) in the root;
* **foreign**: anything else inside a namespace (a file with another name in a fan-out
  directory, a sub-directory there, an unknown entry of a namespace, array or ``c/`` tree), and
  unknown entries of the root;
* **quarantine** (``<ns>/quarantine/*``), **trash** (``<ns>/trash/*``: blocks evicted by
  ``kvstore gc``, waiting out the grace period) and **removed namespaces**
  (``<root>/.trash-<ns>-<ns time>``: namespaces removed by ``kvstore rm``).

Nothing here writes, creates or touches anything (no store object is opened: that would probe
O_DIRECT with a file in the root and create missing fan-out directories). Files that vanish
while we list them (eviction, a rename by a writer) are skipped. Sizes are apparent sizes
(``st_size``): block files are dense, so this is what they occupy, to the file-system block.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import KvstoreError, StoreFormatError
from kvstore.identity import Identity
from kvstore.io import host
from kvstore.keys import HASH_HI_FANOUT, HASH_LO_BITS
from kvstore.store import metadata
from kvstore.store.format import ShardLayout
from kvstore.store.group_store import TMP_MARK
from kvstore.store.page_store import QUARANTINE

TRASH = "trash"  # <ns>/trash/: evicted blocks waiting out the grace period
REMOVED_PREFIX = ".trash-"  # <root>/.trash-<ns>-<time_ns>: a namespace being removed
DOC_TMP_PREFIX = metadata.DOC_TMP_PREFIX  # metadata document being replaced
PROBE_PREFIX = host.PROBE_PREFIX  # the engine's O_DIRECT probe file in the root
# Threads listing fan-out directories (GlusterFS, 2 cores: 256 listings 2-3x faster with 8).
SCAN_THREADS = 8
_DECIMAL = re.compile(r"^(0|[1-9][0-9]*)$")
_GROUP_DIR = re.compile(r"^g(0|[1-9][0-9]*)$")
_TRAILING_NS = re.compile(r"-([0-9]+)$")

BLOCK = "block"
TEMP = "temp"
FOREIGN = "foreign"


@dataclass(frozen=True)
class GroupInfo:
    """One group array of a namespace and the geometry of its shard files."""

    index: int
    path: Path  # <root>/<ns>/g<k>
    layout: ShardLayout
    leading_dims: int  # array dimensions before the two hash dimensions
    compression: str = "none"  # the array's inner-chunk compression (its zarr.json)

    @property
    def fanout_root(self) -> Path:
        """The directory holding the 256 fan-out directories."""
        return self.path.joinpath("c", *(["0"] * self.leading_dims))


@dataclass(frozen=True)
class NamespaceInfo:
    """A namespace directory and the identity stored in its ``zarr.json``."""

    name: str
    path: Path
    identity: Identity
    groups: tuple[GroupInfo, ...]

    @property
    def digest(self) -> bytes:
        return self.identity.digest


@dataclass(frozen=True)
class Problem:
    """A directory that looks like a namespace but cannot be read as one."""

    path: Path
    detail: str


@dataclass(frozen=True)
class StoreRoot:
    """A store root and its readable namespaces (sorted by name)."""

    root: Path
    namespaces: tuple[NamespaceInfo, ...]
    problems: tuple[Problem, ...]  # namespace-like directories that could not be read

    def namespace(self, name: str) -> NamespaceInfo:
        """The namespace called ``name``; a :class:`KvstoreError` naming the ones present."""
        for ns in self.namespaces:
            if ns.name == name:
                return ns
        names = ", ".join(n.name for n in self.namespaces) or "none"
        raise KvstoreError(f"namespace: expected one of the store's ({names}), got {name!r}")


@dataclass(frozen=True, slots=True)
class Entry:
    """One file (or, for foreign entries, possibly a directory) found by :func:`scan_store`."""

    kind: str  # BLOCK, TEMP or FOREIGN
    path: str
    namespace: str | None  # None: in the root, outside any namespace
    group: int | None  # array index, None outside an array
    hash_hi: int  # blocks and their temps: coordinates from the path; else -1
    hash_lo: int
    size: int  # bytes (a directory: the bytes of every file below it)
    mtime_ns: int
    ino: int
    is_dir: bool = False


@dataclass(frozen=True, slots=True)
class HeldFile:
    """A file in quarantine or trash, or a removed namespace directory (with its contents)."""

    path: str
    namespace: str | None  # None: a removed namespace in the root
    size: int
    files: int
    since_ns: int  # when it was put there (from its name; else the inode change time)


@dataclass
class StoreScan:
    """Everything :func:`scan_store` found."""

    store: StoreRoot
    blocks: list[Entry] = field(default_factory=list)
    temps: list[Entry] = field(default_factory=list)
    foreign: list[Entry] = field(default_factory=list)
    quarantine: list[HeldFile] = field(default_factory=list)
    trash: list[HeldFile] = field(default_factory=list)
    removed: list[HeldFile] = field(default_factory=list)  # <root>/.trash-* directories


def open_root(root: Path) -> StoreRoot:
    """Check ``root`` is a kvstore store and read its namespaces; no write of any kind."""
    root = root.absolute()
    if not root.is_dir():
        got = "a file" if root.exists() else "nothing there"
        raise StoreFormatError(f"store root {root}: expected a kvstore store directory, got {got}")
    doc = metadata.read_document(root)
    if doc is None:
        raise StoreFormatError(
            f"store root {root}: expected a kvstore store ({metadata.ZARR_JSON} with "
            f"attributes.kvstore), got a directory without {metadata.ZARR_JSON}"
        )
    attrs = metadata.kvstore_attrs(doc)
    if attrs != metadata.STORE_ATTRS:
        raise StoreFormatError(
            f"store root {root}: expected attributes.kvstore = {metadata.STORE_ATTRS}, "
            f"got {attrs or 'none'}"
        )
    namespaces: list[NamespaceInfo] = []
    problems: list[Problem] = []
    for entry in _scandir(root):
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            ns_doc = metadata.read_document(path)
        except StoreFormatError as exc:
            problems.append(Problem(path, str(exc)))
            continue
        if ns_doc is None:
            continue  # not a namespace: reported as foreign by scan_store
        try:
            namespaces.append(_namespace_info(path, ns_doc))
        except (KvstoreError, KeyError, TypeError, ValueError) as exc:
            problems.append(Problem(path, str(exc)))
    namespaces.sort(key=lambda n: n.name)
    return StoreRoot(root, tuple(namespaces), tuple(problems))


def _namespace_info(path: Path, doc: dict[str, object]) -> NamespaceInfo:
    attrs = metadata.kvstore_attrs(doc)
    if "identity" not in attrs:
        raise StoreFormatError(
            f"{path}/{metadata.ZARR_JSON}: expected attributes.kvstore.identity of a kvstore "
            f"namespace, got {attrs or 'none'}"
        )
    identity = Identity.from_json(attrs["identity"])
    if identity.namespace != path.name:
        raise StoreFormatError(
            f"namespace {path.name}: its identity hashes to {identity.namespace}; the directory "
            "was renamed or its zarr.json edited"
        )
    groups = tuple(
        GroupInfo(
            index=k,
            path=path / f"g{k}",
            layout=ShardLayout.for_group(spec, identity.tokens_per_block, identity.dtype.itemsize),
            leading_dims=metadata.leading_dims(spec),
            compression=_array_compression(path / f"g{k}"),
        )
        for k, spec in enumerate(identity.groups)
    )
    return NamespaceInfo(path.name, path, identity, groups)


def _array_compression(array_path: Path) -> str:
    """The compression an array's zarr.json records; "none" when it is missing or unreadable
    (verify's metadata check reports that array separately)."""
    try:
        doc = metadata.read_document(array_path)
        return "none" if doc is None else metadata.array_compression(doc, array_path)
    except StoreFormatError:
        return "none"


def scan_store(
    store: StoreRoot,
    namespaces: Iterable[NamespaceInfo] | None = None,
    *,
    on_dir: Callable[[], None] | None = None,
    arrays: bool = True,
) -> StoreScan:
    """List the store (or only ``namespaces``; then root-level entries are skipped).

    ``on_dir`` is called once per fan-out directory listed (progress bars: there are
    :func:`fanout_dirs` of them). ``arrays=False`` skips the group arrays (no blocks, no
    per-block ``stat``): only root entries and each namespace's own entries, quarantine, trash.
    """
    scan = StoreScan(store)
    whole = namespaces is None
    chosen = list(store.namespaces if namespaces is None else namespaces)
    if whole:
        _scan_root(store, scan)
    for ns in chosen:
        _scan_namespace(ns, scan, on_dir, arrays)
    return scan


def fanout_dirs(namespaces: Iterable[NamespaceInfo]) -> int:
    """How many fan-out directories :func:`scan_store` lists for ``namespaces``."""
    return sum(len(ns.groups) for ns in namespaces) * HASH_HI_FANOUT


def _scan_root(store: StoreRoot, scan: StoreScan) -> None:
    known = {ns.name for ns in store.namespaces} | {p.path.name for p in store.problems}
    for entry in _scandir(store.root):
        name = entry.name
        if name == metadata.ZARR_JSON or name in known:
            continue
        st = _lstat(entry)
        if st is None:
            continue
        is_dir = stat.S_ISDIR(st.st_mode)
        if name.startswith(REMOVED_PREFIX) and is_dir:
            files, size = tree_usage(entry.path)
            scan.removed.append(HeldFile(entry.path, None, size, files, _since_ns(name, st)))
        elif (name.startswith((DOC_TMP_PREFIX, PROBE_PREFIX))) and not is_dir:
            scan.temps.append(_entry(TEMP, entry.path, None, None, -1, -1, st))
        else:
            scan.foreign.append(_foreign(entry.path, None, None, st))


def _scan_namespace(
    ns: NamespaceInfo, scan: StoreScan, on_dir: Callable[[], None] | None, arrays: bool
) -> None:
    groups = {f"g{g.index}": g for g in ns.groups}
    for entry in _scandir(ns.path):
        name = entry.name
        if name == metadata.ZARR_JSON or (name in groups and not entry.is_symlink()):
            continue
        st = _lstat(entry)
        if st is None:
            continue
        is_dir = stat.S_ISDIR(st.st_mode)
        if name in (QUARANTINE, TRASH) and is_dir:
            held = scan.quarantine if name == QUARANTINE else scan.trash
            for item in _scandir(entry.path):
                ist = _lstat(item)
                if ist is None:
                    continue
                if stat.S_ISDIR(ist.st_mode):
                    files, size = tree_usage(item.path)
                else:
                    files, size = 1, ist.st_size
                held.append(HeldFile(item.path, ns.name, size, files, _since_ns(item.name, ist)))
        elif name.startswith(DOC_TMP_PREFIX) and not is_dir:
            scan.temps.append(_entry(TEMP, entry.path, ns.name, None, -1, -1, st))
        else:
            scan.foreign.append(_foreign(entry.path, ns.name, None, st))
    if arrays:
        for group in ns.groups:
            _scan_group(ns, group, scan, on_dir)


def _scan_group(
    ns: NamespaceInfo, group: GroupInfo, scan: StoreScan, on_dir: Callable[[], None] | None
) -> None:
    # The array directory and the chain c/0/…/0 above the fan-out: only known names allowed.
    expected_child = {str(group.path): "c"}
    level = group.path / "c"
    for _ in range(group.leading_dims):
        expected_child[str(level)] = "0"
        level = level / "0"
    for directory, child in expected_child.items():
        if Path(directory).is_symlink():
            return  # reported as foreign by its parent's listing; never scanned through
        for entry in _scandir(directory):
            if (entry.name == child and not entry.is_symlink()) or (
                directory == str(group.path)
                and (entry.name == metadata.ZARR_JSON or entry.name.startswith(DOC_TMP_PREFIX))
            ):
                continue
            st = _lstat(entry)
            if st is not None:
                scan.foreign.append(_foreign(entry.path, ns.name, group.index, st))
    fanout = str(group.fanout_root)
    if Path(fanout).is_symlink():
        return
    valid_hi = {str(hi) for hi in range(HASH_HI_FANOUT)}
    for entry in _scandir(fanout):
        if entry.name not in valid_hi or not entry.is_dir(follow_symlinks=False):
            st = _lstat(entry)
            if st is not None:
                scan.foreign.append(_foreign(entry.path, ns.name, group.index, st))
    directories = [f"{fanout}{os.sep}{hi}" for hi in range(HASH_HI_FANOUT)]
    # On a shared file system every listing and stat is a network round trip: list the fan-out
    # directories on threads (merged in order: the scan is exactly what a serial one finds).
    with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="kvstore-scan") as pool:
        for hi, listed in enumerate(pool.map(_list_with_stats, directories)):
            _scan_fanout(ns, group, hi, listed, scan)
            if on_dir is not None:
                on_dir()


def _list_with_stats(directory: str) -> list[tuple[os.DirEntry[str], os.stat_result]]:
    """The entries of ``directory`` with their lstat (entries gone meanwhile left out)."""
    listed = []
    for entry in _scandir(directory):
        st = _lstat(entry)
        if st is not None:
            listed.append((entry, st))
    return listed


def _scan_fanout(
    ns: NamespaceInfo,
    group: GroupInfo,
    hi: int,
    listed: list[tuple[os.DirEntry[str], os.stat_result]],
    scan: StoreScan,
) -> None:
    for entry, st in listed:
        name = entry.name
        if not stat.S_ISREG(st.st_mode):
            scan.foreign.append(_foreign(entry.path, ns.name, group.index, st))
            continue
        lo = parse_lo(name)
        if lo is not None:
            scan.blocks.append(_entry(BLOCK, entry.path, ns.name, group.index, hi, lo, st))
            continue
        # ``.<lo>.tmp-<token>`` (group_store.temp_path_for); ``<lo>.tmp-<token>`` from
        # versions before the dot-name (still swept).
        base, mark, _token = name.removeprefix(".").partition(TMP_MARK)
        lo = parse_lo(base) if mark else None
        if lo is not None:
            scan.temps.append(_entry(TEMP, entry.path, ns.name, group.index, hi, lo, st))
        else:
            scan.foreign.append(_foreign(entry.path, ns.name, group.index, st))


def parse_lo(name: str) -> int | None:
    """``hash_lo`` of a published block's file name, None if the name is not one."""
    if not _DECIMAL.match(name):
        return None
    value = int(name)
    return value if value < (1 << HASH_LO_BITS) else None


def tree_usage(path: str) -> tuple[int, int]:
    """(files, bytes) of every regular file below ``path`` (or of ``path`` itself)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, 0
    if not stat.S_ISDIR(st.st_mode):
        return 1, st.st_size
    files = size = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            try:
                fst = os.lstat(f"{dirpath}{os.sep}{name}")
            except FileNotFoundError:
                continue
            files += 1
            size += fst.st_size
    return files, size


def _entry(
    kind: str,
    path: str,
    namespace: str | None,
    group: int | None,
    hi: int,
    lo: int,
    st: os.stat_result,
) -> Entry:
    return Entry(kind, path, namespace, group, hi, lo, st.st_size, st.st_mtime_ns, st.st_ino)


def _foreign(path: str, namespace: str | None, group: int | None, st: os.stat_result) -> Entry:
    is_dir = stat.S_ISDIR(st.st_mode)
    size = tree_usage(path)[1] if is_dir else st.st_size
    return Entry(FOREIGN, path, namespace, group, -1, -1, size, st.st_mtime_ns, st.st_ino, is_dir)


def _since_ns(name: str, st: os.stat_result) -> int:
    """When a quarantined / trashed entry was put there: its name's trailing ns time."""
    m = _TRAILING_NS.search(name)
    if m:
        return int(m.group(1))
    return st.st_ctime_ns  # a rename sets the inode change time


def _scandir(path: str | Path) -> Iterator[os.DirEntry[str]]:
    """Entries of a directory; nothing if it is gone or not a directory."""
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except (FileNotFoundError, NotADirectoryError):
        return
    yield from entries


def _lstat(entry: os.DirEntry[str]) -> os.stat_result | None:
    try:
        return entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None
