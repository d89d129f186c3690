"""Threat 7, hostile contents: damaged, forged and swapped block files and metadata documents.

Block files (hypothesis): bit flips anywhere, truncation and extension, headers with fuzzed
fields *and a valid header crc* (so the geometry and identity checks are reached, not just the
crc), another block's / group's / namespace's file put in place, splices of two files, random
garbage. Each is read by the engine path (``read_blocks`` whole and partial, under a wall-clock
alarm) and checked by the admin path (``check_block_file``, ``read_header``):

* nothing raises, nothing hangs; a read is a HIT with exactly the block's bytes (a byte no reader
  looks at was hit) or a miss whose one error type is CORRUPT (``CorruptBlockError``);
* the admin check passes only for a file identical to the original (every byte is covered);
* no read allocates more than twice a block (tracemalloc peak), whatever the header declares.

Metadata documents (hypothesis): random bytes, random JSON, the real documents with one value
replaced (any JSON type, NaN, huge numbers) or one key deleted, deep nesting. Opening the store
(server path and tools path) either works or raises one error type (``KvstoreError``); the admin
commands and ``kvstore-inspect overview`` return an exit code, never a traceback. An oversized
``zarr.json`` is refused without being read whole.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import signal
import struct
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.admin.blockfile import check_block_file, read_header
from kvstore.checksum import crc32c
from kvstore.cli import main as admin_main
from kvstore.config import StoreConfig
from kvstore.errors import CorruptBlockError, KvstoreError
from kvstore.identity import Identity, attention_group
from kvstore.inspect.cli import main as inspect_main
from kvstore.store import format as fmt
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus
from tests.helpers import block_bytes, block_hash, layer_names, make_small_identity
from tests.reliability.common import FULL, figure, tier

BLOCK_CASES = tier(1600, 20_000)
DOC_CASES = tier(500, 5000)
ALARM_S = 10.0
_FIXED = struct.Struct("<8sHHI32sIBBBB32s32sIIQQQQQ")  # format.py's fixed header
_FIELD_BOUNDS = [8, 16, 16, 32, 32, 32, 8, 8, 8, 8, 32, 32, 32, 32, 64, 64, 64, 64, 64]
_BYTES_FIELDS = {0: 8, 4: 32, 10: 32, 11: 32}
PER_GROUP = 4
# Blocks of realistic proportions (64-128 KiB, dense and padded chunks): twice a block is then
# far above the interpreter's own noise in a tracemalloc window (a few tens of KiB).
IDENTITIES = [
    Identity(
        model=model,
        kv_dtype=dtype,
        tokens_per_block=16,
        groups=(attention_group("full", layer_names(layers), heads, head_dim),),
    )
    for model, dtype, layers, heads, head_dim in (
        ("test/fuzz-dense", "bfloat16", 4, 4, 128),
        ("test/fuzz-padded", "float16", 8, 4, 40),
        ("test/fuzz-dense-twin", "bfloat16", 4, 4, 128),
    )
]


def _settings(cases: int) -> settings:
    return settings(
        max_examples=cases,
        deadline=None,  # the alarm below catches hangs; timing varies on shared CI runners
        database=None,
        derandomize=not FULL,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the main thread if the body runs longer than ``seconds``."""

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"hang: still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Target:
    group: GroupStore
    block_hash: bytes
    seed: int
    original: bytes

    @property
    def path(self) -> Path:
        return Path(self.group.path_of(self.block_hash))

    def restore(self) -> None:
        self.path.write_bytes(self.original)
        self.path.chmod(0o600)


@dataclass
class Tally:
    cases: int = 0
    hits: int = 0
    corrupt: int = 0
    other: int = 0
    peak: int = 0  # largest tracemalloc peak of a read, bytes
    one_off_peaks: int = 0  # reads over the bound whose repeat stayed within it
    block_nbytes: int = 0  # of the largest block read
    admin_faults: int = 0


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KVStore, list[Target]]]:
    root = tmp_path_factory.mktemp("hostile") / "store"
    store = KVStore(StoreConfig(root=root, durability="none", io_threads=1))
    targets: list[Target] = []
    for identity in IDENTITIES:
        g = store.namespace(identity).group(0)
        for i in range(PER_GROUP):
            h = block_hash(i, identity.namespace)
            seed = len(targets)
            g.write_blocks([BlockWrite(h, block_bytes(g.layout, seed), block_hash(i - 1))])
            targets.append(Target(g, h, seed, Path(g.path_of(h)).read_bytes()))
    yield store, targets
    if tracemalloc.is_tracing():
        tracemalloc.stop()
    store.close()


def _header_case() -> st.SearchStrategy[tuple[str, Any]]:
    def value(i: int) -> st.SearchStrategy[Any]:
        if i in _BYTES_FIELDS:
            return st.binary(min_size=_BYTES_FIELDS[i], max_size=_BYTES_FIELDS[i])
        top = (1 << _FIELD_BOUNDS[i]) - 1
        return st.one_of(st.integers(0, top), st.sampled_from([0, 1, top, top // 2 + 1]))

    field_value = st.integers(0, 18).flatmap(lambda i: st.tuples(st.just(i), value(i)))
    return st.tuples(st.just("header"), st.lists(field_value, min_size=1, max_size=4))


BLOCK_CASE = st.one_of(
    st.tuples(
        st.just("flip"),
        st.lists(
            st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1, max_size=8
        ),
    ),
    st.tuples(st.just("resize"), st.floats(0, 2)),
    _header_case(),
    st.tuples(st.just("swap"), st.integers(0, 10_000)),
    st.tuples(st.just("splice"), st.tuples(st.integers(0, 10_000), st.floats(0, 1))),
    st.tuples(st.just("garbage"), st.binary(max_size=300_000)),
)


def hostile_bytes(case: tuple[str, Any], target: Target, pool: list[Target]) -> bytes:
    kind, arg = case
    raw = bytearray(target.original)
    if kind == "flip":
        for where, bit in arg:
            raw[int(where * len(raw))] ^= 1 << bit
    elif kind == "resize":
        size = int(arg * len(raw))
        raw = raw[:size] + bytes(max(0, size - len(raw)))
    elif kind == "header":
        fields = list(_FIXED.unpack_from(raw, 0))
        for i, v in arg:
            fields[i] = v
        fixed = _FIXED.pack(*fields)
        raw[: _FIXED.size] = fixed
        raw[_FIXED.size : _FIXED.size + 4] = struct.pack("<I", crc32c(fixed))  # a valid crc
    elif kind == "swap":
        raw = bytearray(pool[arg % len(pool)].original)
    elif kind == "splice":
        other, cut = arg
        donor = pool[other % len(pool)].original
        at = int(cut * len(raw))
        raw = raw[:at] + donor[at:]
    else:
        raw = bytearray(arg)
    return bytes(raw)


# Header fields the admin check cannot hold against anything: parent length and hash, the
# reserved byte, created_ns (no reader trusts them), and the block hash length and bytes past
# the 70 bits the path carries (only a reader that knows the full key can check those, and the
# engine read above did).
UNCHECKED_FIELDS = {6, 7, 9, 10, 11, 18}


def _unchecked_only(data: bytes, original: bytes) -> bool:
    """``data`` differs from ``original`` at most in header fields no check trusts."""
    if (
        len(data) != len(original)
        or data[fmt.HEADER_FIXED_NBYTES :] != original[fmt.HEADER_FIXED_NBYTES :]
    ):
        return False
    new, old = _FIXED.unpack_from(data, 0), _FIXED.unpack_from(original, 0)
    return all(
        a == b or i in UNCHECKED_FIELDS for i, (a, b) in enumerate(zip(new, old, strict=True))
    )


def _read(g: GroupStore, h: bytes, out: np.ndarray, chunks: list[int] | None) -> tuple[Any, int]:
    """One read under the alarm; its result and its tracemalloc peak over the start, bytes.

    The cyclic collector is paused during the read: it would otherwise collect earlier
    examples' garbage inside the window, and finalizers allocate.
    """
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    gc.disable()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        with alarm(ALARM_S):
            (result,) = g.read_blocks([BlockRead(h, out, chunks)])
        return result, tracemalloc.get_traced_memory()[1] - before
    finally:
        gc.enable()


@pytest.fixture
def quiet_kvstore_log() -> Iterator[None]:
    """No log records from kvstore while fuzzing (the test harness would keep thousands, and
    their formatting would count against the read's memory)."""
    logger = logging.getLogger("kvstore")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def hostile_block_case(pool: list[Target], tally: Tally, case: tuple[str, Any], which: int) -> None:
    """One hostile block file: engine reads (whole, partial) and the admin check."""
    target = pool[which % len(pool)]
    g, layout = target.group, target.group.layout
    data = hostile_bytes(case, target, pool)
    tally.cases += 1
    target.path.write_bytes(data)
    try:
        want = block_bytes(layout, target.seed)
        out = np.zeros(layout.block_nbytes, dtype=np.uint8)
        partial = [layout.num_chunks - 1, 0]
        part = np.zeros(2 * layout.chunk_nbytes, dtype=np.uint8)
        for chunks, buf in ((None, out), (partial, part)):
            if not target.path.exists():
                target.path.write_bytes(data)  # the whole read quarantined it
            result, peak = _read(g, target.block_hash, buf, chunks)
            if peak > 2 * layout.block_nbytes:
                # tracemalloc counts every allocation in the window, a one-time initialisation
                # somewhere in the process included (seen once in ~10k cases: 3.9 MB, and
                # hypothesis could not reproduce it with the same input). What a hostile file
                # must not do is make reads of it allocate more: read the same bytes again.
                target.path.write_bytes(data)
                again, peak = _read(g, target.block_hash, buf, chunks)
                assert again.status is result.status, (case[0], result, again)
                tally.one_off_peaks += 1
            tally.peak = max(tally.peak, peak)
            tally.block_nbytes = max(tally.block_nbytes, layout.block_nbytes)
            assert peak <= 2 * layout.block_nbytes, (case[0], peak)
            if result.status is ReadStatus.HIT:
                tally.hits += 1
                size = layout.chunk_nbytes
                expect = (
                    want
                    if chunks is None
                    else np.concatenate([want[c * size : (c + 1) * size] for c in chunks])
                )
                assert np.array_equal(buf, expect), f"wrong page served for {case[0]}"
            elif result.status is ReadStatus.CORRUPT:
                tally.corrupt += 1
                assert result.error
            else:
                tally.other += 1
                pytest.fail(f"{case[0]}: {result.status.value} ({result.error})")
        target.path.write_bytes(data)
        hi, lo = int(target.path.parent.name), int(target.path.name)
        with alarm(ALARM_S):
            fault = check_block_file(str(target.path), layout, g.namespace_digest, 0, hi, lo)
            with contextlib.suppress(CorruptBlockError):
                read_header(str(target.path))
        if fault is None:
            # Every byte is checked, but the header crc detects damage, not forgery: a header
            # rewritten with a valid crc may change what no reader trusts (parent link, creation
            # time, the reserved byte), never the page.
            assert _unchecked_only(data, target.original), f"{case[0]}: admin check passed it"
        else:
            tally.admin_faults += 1
    finally:
        target.restore()


def test_hostile_block_files(
    hostile: tuple[KVStore, list[Target]], quiet_kvstore_log: None
) -> None:
    """The fuzzing and its figure in one test: the tally is this run's (no module global, no
    dependence on test order), and the counts are asserted, not printed as literals."""
    _, pool = hostile
    tally = Tally()

    @given(case=BLOCK_CASE, which=st.integers(0, 10_000))
    @_settings(BLOCK_CASES)
    def fuzz(case: tuple[str, Any], which: int) -> None:
        hostile_block_case(pool, tally, case, which)

    fuzz()
    figure(
        "hostile block files",
        cases=tally.cases,
        reads=2 * tally.cases,
        hits_with_exact_bytes=tally.hits,
        corrupt_misses=tally.corrupt,
        other_outcomes=tally.other,
        admin_findings=tally.admin_faults,
        largest_read_peak_bytes=tally.peak,
        one_off_peaks_not_repeated=tally.one_off_peaks,
        block_bytes=tally.block_nbytes,
    )
    # Hypothesis may stop short of max_examples only when it runs out of distinct inputs;
    # this space is far larger. Half is the floor: a run that did (next to) nothing fails.
    assert tally.cases >= BLOCK_CASES // 2, tally
    assert tally.hits + tally.corrupt == 2 * tally.cases and tally.other == 0, tally
    # Both outcomes occur: damage that no reader looks at (hits) and damage that is caught.
    assert tally.hits > 0 and tally.corrupt > 0 and tally.admin_faults > 0, tally
    assert tally.peak <= 2 * tally.block_nbytes, tally


# -- metadata documents -----------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _mutated(doc: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    if not path:
        return value
    copy = json.loads(json.dumps(doc))
    node = copy
    for key in path[:-1]:
        node = node[key]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return copy


DOC_CASE = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=400)),
    st.tuples(st.just("json"), JSON),
    st.tuples(st.just("mutate"), st.tuples(st.integers(0, 10_000), JSON, st.booleans())),
    st.tuples(st.just("deep"), st.integers(1, 200_000)),
)
COMMANDS = (
    ["ls", "{root}"],
    ["du", "{root}"],
    ["verify", "{root}", "--threads", "1"],
    ["gc", "{root}", "--max-bytes", "1T", "--dry-run"],
    ["inspect", "overview", "{root}"],
)


@dataclass
class DocTally:
    cases: int = 0
    opened: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    exit_codes: dict[int, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def doc_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Identity, list[Path]]:
    root = tmp_path_factory.mktemp("docs") / "store"
    identity = make_small_identity()
    with KVStore(StoreConfig(root=root, durability="none")) as store:
        g = store.namespace(identity).group(0)
        g.write_blocks([BlockWrite(block_hash(0), block_bytes(g.layout, 0))])
        docs = [root / "zarr.json", g.array_path.parent / "zarr.json", g.array_path / "zarr.json"]
    return root, identity, docs


def hostile_doc(case: tuple[str, Any], original: bytes) -> bytes:
    kind, arg = case
    if kind == "bytes":
        return bytes(arg)
    if kind == "json":
        return json.dumps(arg).encode()
    if kind == "deep":
        depth: int = arg
        return b"[" * depth + b"]" * depth
    pick, value, delete = arg
    doc = json.loads(original)
    paths = _paths(doc)
    return json.dumps(_mutated(doc, paths[pick % len(paths)], value, delete)).encode()


def hostile_doc_case(
    doc_store: tuple[Path, Identity, list[Path]],
    tally: DocTally,
    case: tuple[str, Any],
    which: int,
    command: int,
) -> None:
    """One hostile zarr.json: the server opens the store, one tool runs."""
    root, identity, docs = doc_store
    path = docs[which]
    original = path.read_bytes()
    path.write_bytes(hostile_doc(case, original))
    tally.cases += 1
    try:
        with alarm(ALARM_S):
            try:
                with KVStore(StoreConfig(root=root, durability="none", io_threads=1)) as store:
                    g = store.namespace(identity).group(0)
                    out = np.zeros(g.layout.block_nbytes, dtype=np.uint8)
                    (r,) = g.read_blocks([BlockRead(block_hash(0), out)])
                    assert r.status is ReadStatus.HIT and np.array_equal(
                        out, block_bytes(g.layout, 0)
                    )
                    store.open_namespace(identity.namespace)
                tally.opened += 1
            except KvstoreError as exc:  # the one error type of a bad store
                name = type(exc).__name__
                tally.refused[name] = tally.refused.get(name, 0) + 1
            argv = [a.format(root=root) for a in COMMANDS[command]]
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                rc = inspect_main(argv[1:]) if argv[0] == "inspect" else admin_main(argv)
            assert rc in (0, 1, 2), (argv, rc)
            tally.exit_codes[rc] = tally.exit_codes.get(rc, 0) + 1
    finally:
        path.write_bytes(original)


def test_hostile_metadata_documents(
    doc_store: tuple[Path, Identity, list[Path]], quiet_kvstore_log: None
) -> None:
    """The fuzzing and its figure in one test, with this run's own tally, asserted."""
    tally = DocTally()

    @given(case=DOC_CASE, which=st.integers(0, 2), command=st.integers(0, len(COMMANDS) - 1))
    @_settings(DOC_CASES)
    def fuzz(case: tuple[str, Any], which: int, command: int) -> None:
        hostile_doc_case(doc_store, tally, case, which, command)

    fuzz()
    figure(
        "hostile zarr.json",
        cases=tally.cases,
        opened=tally.opened,
        refused=tally.refused,
        cli_exit_codes=tally.exit_codes,
    )
    assert tally.cases >= DOC_CASES // 2, tally
    assert tally.opened + sum(tally.refused.values()) == tally.cases, tally
    assert sum(tally.exit_codes.values()) == tally.cases, tally
    # Mutations that keep a document valid open the store; the rest are refused, and only as
    # the store's own error type (KvstoreError: anything else failed the case above).
    assert tally.opened > 0 and sum(tally.refused.values()) > 0, tally
    assert tally.exit_codes.get(2, 0) > 0 and tally.exit_codes.get(0, 0) > 0, tally


def test_oversized_document_is_not_read_whole(doc_store: tuple[Path, Identity, list[Path]]) -> None:
    root, identity, docs = doc_store
    path = docs[1]
    original = path.read_bytes()
    try:
        with path.open("wb") as f:  # 256 MiB, sparse
            f.write(original[:-1] + b" ")
            f.truncate(256 << 20)
        tracing = tracemalloc.is_tracing()
        if not tracing:
            tracemalloc.start()
        try:
            with KVStore(StoreConfig(root=root, durability="none")) as store:
                tracemalloc.reset_peak()
                before = tracemalloc.get_traced_memory()[0]
                with pytest.raises(KvstoreError, match=r"zarr\.json"):
                    store.namespace(identity)
                peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            if not tracing:
                tracemalloc.stop()
        figure("oversized zarr.json", file_bytes=256 << 20, peak_bytes=peak)
        assert peak < 4 << 20  # the document cap (1 MiB) and change, not 256 MiB
    finally:
        path.write_bytes(original)
        os.chmod(path, 0o600)
