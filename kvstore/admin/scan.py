"""Walking a store directory cold, without opening it for writing.

:func:`open_root` opens the read-only store view (:class:`kvstore.store.view.StoreView`: a
kvstore store, format v1, and its namespaces' identities); :func:`scan_store` lists every file
below it and sorts each into one of:

* **block**: a published shard file ``<ns>/g<k>/c/0/…/0/<hi>/<lo>`` (decimal ``lo`` < 2^62);
* **temp**: a file being written (``.<lo>.tmp-<token>``) or a metadata document being replaced
  (``.zarr.json.tmp-*``), or a left-over O_DIRECT probe (``.kvstore-probe-*``) in the root;
* **foreign**: anything else inside a namespace (a file with another name in a fan-out
  directory, a sub-directory there, an unknown entry of a namespace, array or ``c/`` tree), and
  unknown entries of the root;
* **quarantine** (``<ns>/quarantine/*``), **trash** (``<ns>/trash/*``: blocks evicted by
  ``kvstore gc``, waiting out the grace period) and **removed namespaces**
  (``<root>/.trash-<ns>-<ns time>``: namespaces removed by ``kvstore rm``).

**Hostile trees.** Every directory is listed through a descriptor opened with ``O_NOFOLLOW |
O_DIRECTORY`` (:func:`kvstore.store.paths.list_dir`), and every entry is classified by
``lstat``: a symbolic link is never followed (it is a foreign entry, whatever it points at), a
FIFO, socket or device is never opened (foreign, or a finding of the metadata check), and a
directory that cannot be listed
(EACCES, EIO) is recorded in :attr:`StoreScan.unreadable` while the scan carries on with the
rest. ``zarr.json`` documents are read only when ``lstat`` says they are regular files
(:func:`kvstore.store.view.read_document`).

Nothing here writes, creates or touches anything (no store object is opened: that would probe
O_DIRECT with a file in the root and create missing fan-out directories). Files that vanish
while we list them (eviction, a rename by a writer) are skipped. Every size is kept twice:
apparent (``st_size``, what ``du`` reports as bytes) and allocated (``st_blocks * 512``, what the
files hold on the disk, which ``kvstore gc --max-bytes`` counts: a 5 KiB block holds 8 KiB of
tmpfs or ext4).
"""

from __future__ import annotations

import contextlib
import os
import queue
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kvstore.admin.usage import allocated_bytes, listing_problem, tree_usage
from kvstore.io.dirlist import EntryStat, ListedStat
from kvstore.io.fileio import PROBE_PREFIX
from kvstore.store import paths
from kvstore.store.paths import DOC_TMP_PREFIX, QUARANTINE, REMOVED_PREFIX, TRASH, ZARR_JSON
from kvstore.store.view import GroupView, NamespaceView, Problem, StoreView

# Threads listing fan-out directories (GlusterFS, 2 cores: 256 listings 2-3x faster with 8).
SCAN_THREADS = 8
# Fan-out listings queued ahead of the one being sorted: enough to keep the threads busy.
LISTINGS_AHEAD = 2 * SCAN_THREADS
# Block entries handed over at once (``on_blocks``), and batches a listing thread may hold
# ready per directory: a scan holds at most LISTINGS_AHEAD * (BATCHES_AHEAD + 1) batches,
# whatever the size of a fan-out directory (390k entries each at 10^8 blocks).
BLOCK_BATCH = 1024
BATCHES_AHEAD = 2

BLOCK = "block"
TEMP = "temp"
FOREIGN = "foreign"


def open_root(root: Path) -> StoreView:
    """Check ``root`` is a kvstore store and read its namespaces; no write of any kind."""
    store = StoreView.open(root)
    store.namespaces  # noqa: B018 - read them now: a root that cannot be listed fails here
    return store


class Entry(NamedTuple):
    """One file (or, for foreign entries, possibly a directory) found by :func:`scan_store`.

    A named tuple, not a frozen dataclass: the scan builds one per block of the store, and a
    frozen dataclass's ``__init__`` sets each of its 13 fields through ``object.__setattr__``
    (~4 us a block, measured: as long as listing and stat'ing the file)."""

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
    mode: int = 0  # st_mode from lstat (foreign entries: what kind of file it is)
    dev: int = -1  # st_dev: with ino, the file found (a fix acts on it, not on its name)
    allocated: int = 0  # bytes the file (a directory: every file below it) holds on the disk


@dataclass(frozen=True, slots=True)
class HeldFile:
    """A file in quarantine or trash, or a removed namespace directory (with its contents)."""

    path: str
    namespace: str | None  # None: a removed namespace in the root
    size: int
    files: int
    since_ns: int  # when it was put there (from its name; else the inode change time)
    allocated: int = 0  # bytes held on the disk (st_blocks * 512, summed)


@dataclass
class BlockTally:
    """Published blocks of one group (or more, merged): count, bytes, oldest and newest use."""

    blocks: int = 0
    bytes: int = 0
    allocated: int = 0  # bytes held on the disk
    oldest_ns: int | None = None
    newest_ns: int | None = None

    def add(self, size: int, allocated: int, mtime_ns: int) -> None:
        self.blocks += 1
        self.bytes += size
        self.allocated += allocated
        if self.oldest_ns is None or mtime_ns < self.oldest_ns:
            self.oldest_ns = mtime_ns
        if self.newest_ns is None or mtime_ns > self.newest_ns:
            self.newest_ns = mtime_ns

    def add_many(self, sizes: list[int], allocated: list[int], mtimes_ns: list[int]) -> None:
        """:meth:`add` for each block of a listing step (the three lists in step)."""
        if not sizes:
            return
        self.merge(
            BlockTally(len(sizes), sum(sizes), sum(allocated), min(mtimes_ns), max(mtimes_ns))
        )

    def merge(self, other: BlockTally) -> None:
        self.blocks += other.blocks
        self.bytes += other.bytes
        self.allocated += other.allocated
        for when in (other.oldest_ns, other.newest_ns):
            if when is not None:
                self.oldest_ns = when if self.oldest_ns is None else min(self.oldest_ns, when)
                self.newest_ns = when if self.newest_ns is None else max(self.newest_ns, when)


@dataclass
class StoreScan:
    """Everything :func:`scan_store` found.

    Published blocks are always tallied per group (:attr:`tallies`: what ``ls`` and ``du``
    report, in memory independent of the store's size); their entries are kept in
    :attr:`blocks` only when the scan was asked to (``keep_blocks``), or handed over in
    batches as they are found (``on_blocks``) and then dropped.
    """

    store: StoreView
    keep_blocks: bool = True
    tallies: dict[tuple[str, int], BlockTally] = field(default_factory=dict)
    blocks: list[Entry] = field(default_factory=list)
    temps: list[Entry] = field(default_factory=list)
    foreign: list[Entry] = field(default_factory=list)
    quarantine: list[HeldFile] = field(default_factory=list)
    trash: list[HeldFile] = field(default_factory=list)
    removed: list[HeldFile] = field(default_factory=list)  # <root>/.trash-* directories
    # Directories that could not be listed (EACCES, EIO): their contents are not counted.
    unreadable: list[Problem] = field(default_factory=list)
    # Namespace-like directories whose zarr.json cannot be read (StoreView.problems): what
    # could be counted of them (gc counts it against its budget; none of it is evicted).
    unusable: list[HeldFile] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether every directory could be listed (else usage figures are lower bounds)."""
        return not self.unreadable

    def tally(self, namespace: str | None = None, group: int | None = None) -> BlockTally:
        """The published blocks of the whole scan, of one namespace, or of one of its groups."""
        out = BlockTally()
        for (name, index), part in self.tallies.items():
            if (namespace is None or name == namespace) and (group is None or index == group):
                out.merge(part)
        return out


def _listing(path: str | Path, unreadable: list[Problem]) -> list[tuple[str, ListedStat]]:
    """:func:`list_dir`, recording a directory that cannot be listed instead of raising."""
    try:
        return paths.list_dir(path)
    except OSError as exc:
        unreadable.append(Problem(Path(path), listing_problem(exc)))
        return []


def scan_store(  # noqa: PLR0913 - the store, what of it, and keyword-only controls of what is kept or handed over, each documented
    store: StoreView,
    namespaces: Iterable[NamespaceView] | None = None,
    *,
    on_dir: Callable[[], None] | None = None,
    arrays: bool = True,
    keep_blocks: bool = True,
    on_blocks: Callable[[Sequence[Entry]], None] | None = None,
) -> StoreScan:
    """List the store (or only ``namespaces``; then root-level entries are skipped).

    ``on_dir`` is called once per fan-out directory listed (progress bars: there are
    :func:`fanout_dirs` of them). ``arrays=False`` skips the group arrays (no blocks, no
    per-block ``stat``): only root entries and each namespace's own entries, quarantine, trash.
    ``keep_blocks=False`` tallies published blocks without keeping an entry for each.
    ``on_blocks`` is given the published blocks in batches of at most :data:`BLOCK_BATCH`, on
    the calling thread, in scan order, and they are not kept (``keep_blocks`` is ignored): a
    streaming consumer (gc, verify) sees every block while the scan holds a bounded number of
    entries, whatever the store's size. An exception raised by ``on_blocks`` (a Ctrl-C
    included) stops the listing threads and propagates.
    """
    scan = StoreScan(store, keep_blocks and on_blocks is None)
    whole = namespaces is None
    chosen = list(store.namespaces if namespaces is None else namespaces)
    if whole:
        _scan_root(store, scan)
    for ns in chosen:
        _scan_namespace(ns, scan, on_dir, arrays, on_blocks)
    return scan


def fanout_dirs(namespaces: Iterable[NamespaceView]) -> int:
    """How many fan-out directories :func:`scan_store` lists for ``namespaces``."""
    return sum(len(ns.groups) for ns in namespaces) * len(paths.FANOUT)


def _scan_root(store: StoreView, scan: StoreScan) -> None:
    problems = {p.path.name: p for p in store.problems}
    known = {ns.name for ns in store.namespaces}
    for name, st in _listing(store.root, scan.unreadable):
        path = f"{store.root}{os.sep}{name}"
        if name == ZARR_JSON or name in known:
            continue
        is_dir = stat.S_ISDIR(st.st_mode)
        if name in problems:
            # Unreadable as a namespace, but its bytes are on the disk all the same.
            files, size, held = tree_usage(path, scan.unreadable)
            scan.unusable.append(HeldFile(path, name, size, files, st.st_mtime_ns, held))
        elif name.startswith(REMOVED_PREFIX) and is_dir:
            files, size, held = tree_usage(path, scan.unreadable)
            scan.removed.append(HeldFile(path, None, size, files, _since_ns(name, st), held))
        elif (name.startswith((DOC_TMP_PREFIX, PROBE_PREFIX))) and stat.S_ISREG(st.st_mode):
            scan.temps.append(_entry(TEMP, path, None, None, -1, -1, st))
        else:
            scan.foreign.append(_foreign(path, None, None, st, scan.unreadable))


def _scan_namespace(
    ns: NamespaceView,
    scan: StoreScan,
    on_dir: Callable[[], None] | None,
    arrays: bool,
    on_blocks: Callable[[Sequence[Entry]], None] | None,
) -> None:
    groups = {f"g{g.index}": g for g in ns.groups}
    for name, st in _listing(ns.path, scan.unreadable):
        path = f"{ns.path}{os.sep}{name}"
        is_dir = stat.S_ISDIR(st.st_mode)
        if name == ZARR_JSON or (name in groups and is_dir):
            continue
        if name in (QUARANTINE, TRASH) and is_dir:
            held = scan.quarantine if name == QUARANTINE else scan.trash
            _scan_held(path, ns.name, held, scan.unreadable, fanned_out=name == TRASH)
        elif name.startswith(DOC_TMP_PREFIX) and stat.S_ISREG(st.st_mode):
            scan.temps.append(_entry(TEMP, path, ns.name, None, -1, -1, st))
        else:
            # Includes a ``trash`` or ``quarantine`` that is not a real directory (a link, a
            # file, a FIFO): never entered, never moved into; gc and verify say so.
            scan.foreign.append(_foreign(path, ns.name, None, st, scan.unreadable))
    if arrays:
        for group in ns.groups:
            _scan_group(ns, group, scan, on_dir, on_blocks)


def _scan_held(
    path: str, namespace: str, held: list[HeldFile], unreadable: list[Problem], *, fanned_out: bool
) -> None:
    """Each entry of a quarantine or trash directory; trash's fan-out directories
    (``trash/<hi>/``, named like the store's) are entered and their entries listed instead."""
    valid_hi = {str(hi) for hi in paths.FANOUT}
    for item, ist in _listing(path, unreadable):
        item_path = f"{path}{os.sep}{item}"
        if stat.S_ISDIR(ist.st_mode):
            if fanned_out and item in valid_hi:
                _scan_held(item_path, namespace, held, unreadable, fanned_out=False)
                continue
            files, size, alloc = tree_usage(item_path, unreadable)
        else:
            files, size, alloc = 1, ist.st_size, allocated_bytes(ist)
        held.append(HeldFile(item_path, namespace, size, files, _since_ns(item, ist), alloc))


def _scan_group(
    ns: NamespaceView,
    group: GroupView,
    scan: StoreScan,
    on_dir: Callable[[], None] | None,
    on_blocks: Callable[[Sequence[Entry]], None] | None,
) -> None:
    fanout = _enter_chain(ns, group, scan)
    if fanout is None:
        return  # missing, or not a real directory (reported): never scanned through
    valid_hi = {str(hi) for hi in paths.FANOUT}
    present: list[int] = []
    for name, st in _listing(fanout, scan.unreadable):
        if name in valid_hi and stat.S_ISDIR(st.st_mode):
            present.append(int(name))
        else:
            scan.foreign.append(
                _foreign(f"{fanout}{os.sep}{name}", ns.name, group.index, st, scan.unreadable)
            )
    present.sort()
    # On a shared file system every listing and stat is a network round trip: the fan-out
    # directories are listed and sorted on threads, each into a queue of its own that this
    # thread drains in order (the scan is exactly what a serial one finds). At most
    # LISTINGS_AHEAD directories are in flight, each holding at most BATCHES_AHEAD batches of
    # block entries (a thread waits while its queue is full): memory stays bounded whatever
    # the store's size. FIFO threads make this deadlock-free: the directory being drained was
    # submitted before every other one in flight, so it has a thread.
    key = (ns.name, group.index)
    emit = scan.keep_blocks or on_blocks is not None
    cancel = threading.Event()
    with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="kvstore-scan") as pool:
        pending: deque[tuple[queue.Queue[_Item], Future[None]]] = deque()
        queued = iter(present)
        try:
            for _ in present:
                while len(pending) < LISTINGS_AHEAD:
                    hi = next(queued, None)
                    if hi is None:
                        break
                    out: queue.Queue[_Item] = queue.Queue(BATCHES_AHEAD)
                    task = _FanoutTask(ns, group, hi, f"{fanout}{os.sep}{hi}", emit, out, cancel)
                    pending.append((out, pool.submit(task.run)))
                out, done = pending.popleft()
                _drain(out, scan, key, on_blocks)
                done.result()
                if on_dir is not None:
                    on_dir()
        finally:
            cancel.set()  # threads blocked on a full queue give up (an error, a Ctrl-C)
    if on_dir is not None:
        for _ in range(len(paths.FANOUT) - len(present)):
            on_dir()


def _enter_chain(ns: NamespaceView, group: GroupView, scan: StoreScan) -> str | None:
    """The fan-out directory of ``group``, or None where the chain above it breaks.

    The array directory and the chain c/0/…/0 above the fan-out: only known names allowed
    (anything else is recorded as foreign), each entered only if its parent's listing showed
    a real directory (lstat)."""
    directory = str(group.path)
    child = "c"
    for depth in range(group.leading_dims + 1):
        entered = False
        for name, st in _listing(directory, scan.unreadable):
            if name == child and stat.S_ISDIR(st.st_mode):
                entered = True
                continue
            if depth == 0 and stat.S_ISREG(st.st_mode) and _is_array_document(name):
                continue
            scan.foreign.append(
                _foreign(f"{directory}{os.sep}{name}", ns.name, group.index, st, scan.unreadable)
            )
        if not entered:
            return None
        directory = f"{directory}{os.sep}{child}"
        child = "0"
    return directory


def _is_array_document(name: str) -> bool:
    """The array's ``zarr.json`` or a temporary file of its atomic rewrite."""
    return name == ZARR_JSON or name.startswith(DOC_TMP_PREFIX)


@dataclass
class FanoutPart:
    """What one fan-out directory holds besides its block entries, sorted by a scan thread."""

    tally: BlockTally = field(default_factory=BlockTally)
    temps: list[Entry] = field(default_factory=list)
    foreign: list[Entry] = field(default_factory=list)
    unreadable: list[Problem] = field(default_factory=list)

    def merge_into(self, scan: StoreScan, key: tuple[str, int]) -> None:
        if self.tally.blocks:
            tally = scan.tallies.get(key)
            if tally is None:
                tally = scan.tallies[key] = BlockTally()
            tally.merge(self.tally)
        scan.temps += self.temps
        scan.foreign += self.foreign
        scan.unreadable += self.unreadable


# What a listing thread hands over: a batch of block entries, then its part (the last item),
# or the exception that stopped it.
_Item = list[Entry] | FanoutPart | BaseException


class _CancelledError(Exception):
    """The scan stopped (an error or a Ctrl-C in the consumer): a listing thread gives up."""


def _drain(
    out: queue.Queue[_Item],
    scan: StoreScan,
    key: tuple[str, int],
    on_blocks: Callable[[Sequence[Entry]], None] | None,
) -> None:
    """Take one directory's items in order until its part, handing its blocks over."""
    while True:
        item = out.get()
        if isinstance(item, FanoutPart):
            item.merge_into(scan, key)
            return
        if isinstance(item, BaseException):
            raise item
        if on_blocks is not None:
            on_blocks(item)
        else:
            scan.blocks += item


@dataclass
class _FanoutTask:
    """List and sort one fan-out directory, one entry at a time (:func:`paths.iter_dir`)."""

    ns: NamespaceView
    group: GroupView
    hi: int
    directory: str
    emit_blocks: bool
    out: queue.Queue[_Item]
    cancel: threading.Event

    def run(self) -> None:
        try:
            self._put(self._list())
        except _CancelledError:
            pass
        except BaseException as exc:  # a bug here must reach the consumer, not hang it
            with contextlib.suppress(_CancelledError):
                self._put(exc)

    def _put(self, item: _Item) -> None:
        while True:
            try:
                self.out.put(item, timeout=0.1)
            except queue.Full:
                if self.cancel.is_set():
                    raise _CancelledError from None
            else:
                return

    def _list(self) -> FanoutPart:
        ns, group, hi, directory = self.ns.name, self.group.index, self.hi, self.directory
        part = FanoutPart()
        batch: list[Entry] = []
        # The loop body runs once per block of the store (10^8 at most): what it calls is
        # bound to locals, a block's Entry is built here, not through _entry, and the tally
        # takes each listing step's blocks at once (sums, not a call per block).
        prefix, emit, tally = f"{directory}{os.sep}", self.emit_blocks, part.tally
        is_regular, parse_lo = stat.S_ISREG, paths.parse_lo
        try:
            for listed in paths.iter_dir_batches(directory):
                sizes: list[int] = []
                helds: list[int] = []
                mtimes: list[int] = []
                for name, st in listed:
                    if not is_regular(st.st_mode):
                        part.foreign.append(_foreign(prefix + name, ns, group, st, part.unreadable))
                        continue
                    lo = parse_lo(name)
                    if lo is not None:
                        size, mtime = st.st_size, st.st_mtime_ns
                        held = max(st.st_blocks * 512, size)  # allocated_bytes, inline
                        sizes.append(size)
                        helds.append(held)
                        mtimes.append(mtime)
                        if emit:
                            batch.append(
                                Entry(BLOCK, prefix + name, ns, group, hi, lo, size, mtime,
                                      st.st_ino, False, 0, st.st_dev, held)
                            )  # fmt: skip
                            if len(batch) >= BLOCK_BATCH:
                                self._put(batch)
                                batch = []
                        continue
                    path = prefix + name
                    lo = paths.parse_temp_lo(name)  # ``.<lo>.tmp-<token>``, or before the dot
                    if lo is not None:
                        part.temps.append(_entry(TEMP, path, ns, group, hi, lo, st))
                    else:
                        part.foreign.append(_foreign(path, ns, group, st, part.unreadable))
                tally.add_many(sizes, helds, mtimes)
        except OSError as exc:
            # Unreadable (EACCES, EIO), or failing part-way: what was sorted before counts.
            part.unreadable.append(Problem(Path(directory), listing_problem(exc)))
        if batch:
            self._put(batch)
        return part


def _entry(  # noqa: PLR0913 - one argument per Entry field a listed file fills; private to the scan
    kind: str,
    path: str,
    namespace: str | None,
    group: int | None,
    hi: int,
    lo: int,
    st: EntryStat,
) -> Entry:
    return Entry(
        kind,
        path,
        namespace,
        group,
        hi,
        lo,
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
        dev=st.st_dev,
        allocated=allocated_bytes(st),
    )


def _foreign(
    path: str,
    namespace: str | None,
    group: int | None,
    st: EntryStat,
    unreadable: list[Problem],
) -> Entry:
    is_dir = stat.S_ISDIR(st.st_mode)
    if is_dir:
        _files, size, held = tree_usage(path, unreadable)
    else:
        size, held = st.st_size, allocated_bytes(st)
    return Entry(
        FOREIGN,
        path,
        namespace,
        group,
        -1,
        -1,
        size,
        st.st_mtime_ns,
        st.st_ino,
        is_dir,
        st.st_mode,
        st.st_dev,
        held,
    )


def _since_ns(name: str, st: EntryStat) -> int:
    """When a quarantined / trashed entry was put there: its name's trailing ns time."""
    since = paths.held_since_ns(name)
    return st.st_ctime_ns if since is None else since  # a rename sets the inode change time
