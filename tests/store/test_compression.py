"""Compressed namespaces (format v1 addendum, kvstore/store/compression.py).

Round trips whole and partial, zarr-python reads the values, every read-path check holds for
compressed shards (chunk checksum over stored bytes, index, sizes bounded by the geometry,
blosc header), config validation, and the array's setting is authoritative.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import zarr

from kvstore.checksum import checksum_function
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.identity import Identity
from kvstore.store import format as fmt
from kvstore.store.codec import compressed_bounds, decode_index
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ChunkWrite, ReadStatus, WriteStatus
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    chunk_bytes,
    make_small_identity,
    shard_files,
    tmp_files,
)

CODECS = ["lz4", "zstd-1", "zstd-5"]


def kv_block(group: GroupStore, seed: int) -> np.ndarray:
    """Compressible block bytes: bf16 bit patterns of normal values (like KV activations),
    with the every-chunk stamp of :func:`block_bytes` so misplaced chunks are caught."""
    layout = group.layout
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(layout.block_nbytes // 2, dtype=np.float32)
    data = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    stamped = block_bytes(layout, seed)
    for c in range(layout.num_chunks):
        start = c * layout.chunk_nbytes
        data[start : start + 8] = stamped[start : start + 8]
    return data


def read(group: GroupStore, h: bytes, chunks: list[int] | None = None) -> tuple[ReadStatus, bytes]:
    n = group.layout.num_chunks if chunks is None else len(chunks)
    out = np.zeros(n * group.layout.chunk_nbytes, dtype=np.uint8)
    (result,) = group.read_blocks([BlockRead(h, out, chunks)])
    return result.status, out.tobytes()


@pytest.fixture(params=CODECS)
def codec(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def test_round_trip_whole_and_partial(
    make_store: StoreFactory, any_identity: Identity, codec: str
) -> None:
    group = make_store(compression=codec).namespace(any_identity).group(0)
    layout = group.layout
    blocks = {block_hash(i, codec): kv_block(group, i) for i in range(3)}
    blocks[block_hash(99, codec)] = block_bytes(layout, 99)  # incompressible: stored + 16 B
    results = group.write_blocks([BlockWrite(h, d) for h, d in blocks.items()])
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * len(blocks)
    n = layout.num_chunks
    selections = [[0], [n - 1], list(range(1, n)), [n - 1, 0], list(range(0, n, 2))]
    for h, data in blocks.items():
        status, got = read(group, h)
        assert status is ReadStatus.HIT
        assert got == data.tobytes()
        for chunks in selections:
            status, got = read(group, h, chunks)
            assert status is ReadStatus.HIT
            assert got == chunk_bytes(layout, data, chunks).tobytes()
    low, high = compressed_bounds(layout)
    sizes = [os.path.getsize(p) for p in shard_files(group.array_path)]
    assert all(low <= s <= high for s in sizes)
    assert max(sizes) == high  # the random block: every chunk stored with blosc's header only
    assert not tmp_files(group.array_path)


def test_compressible_block_is_smaller(make_store: StoreFactory, codec: str) -> None:
    group = make_store(compression=codec).namespace(make_small_identity()).group(0)
    h = block_hash(1)
    group.write_blocks([BlockWrite(h, kv_block(group, 1))])
    assert os.path.getsize(group.path_of(h)) < 0.9 * group.layout.file_nbytes


def test_zarr_python_reads_compressed_values(
    make_store: StoreFactory, any_identity: Identity, codec: str
) -> None:
    group = make_store(compression=codec).namespace(any_identity).group(0)
    blocks = {block_hash(i, "z"): kv_block(group, 10 + i) for i in range(2)}
    group.write_blocks([BlockWrite(h, d) for h, d in blocks.items()])
    doc = json.loads((group.array_path / "zarr.json").read_text())
    inner = doc["codecs"][0]["configuration"]["codecs"]
    assert [c["name"] for c in inner] == ["bytes", "blosc"]
    assert inner[1]["configuration"]["shuffle"] == "bitshuffle"
    assert doc["attributes"]["kvstore"]["compression"] == codec
    array = zarr.open_array(str(group.array_path), mode="r")
    bits = {1: "<u1", 2: "<u2", 4: "<u4"}[any_identity.dtype.itemsize]
    spec = group.spec
    for h, data in blocks.items():
        hi, lo = h[0], int.from_bytes(h[1:9], "big") >> 2
        lead = array.ndim - 2
        whole = np.asarray(array[(slice(None),) * lead + (hi, lo)]).view(bits)
        flat = data.view(bits)
        np.testing.assert_array_equal(whole.reshape(-1), flat)
        if spec.kind != "mla":  # one (head, layer) inner chunk on its own
            one = np.asarray(array[1, 2, :, :, :, hi, lo]).view(bits).reshape(-1)
            c = 1 * spec.num_layers + 2
            size = group.layout.chunk_nbytes // any_identity.dtype.itemsize
            np.testing.assert_array_equal(one, flat[c * size : (c + 1) * size])


# -- damage ------------------------------------------------------------------------------------


@pytest.fixture
def written(make_store: StoreFactory) -> tuple[GroupStore, bytes, np.ndarray]:
    group = make_store(compression="lz4").namespace(make_small_identity()).group(0)
    h = block_hash(7, "damage")
    data = kv_block(group, 7)
    group.write_blocks([BlockWrite(h, data)])
    return group, h, data


def stored_offsets(group: GroupStore, path: str) -> np.ndarray:
    raw = Path(path).read_bytes()
    layout = group.layout
    return decode_index(memoryview(raw[-layout.index_nbytes :]), layout, len(raw))


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def assert_corrupt(group: GroupStore, h: bytes, chunks: list[int] | None = None) -> None:
    status, _ = read(group, h, chunks)
    assert status is ReadStatus.CORRUPT
    assert not os.path.exists(group.path_of(h))  # quarantined, never served again
    assert any((group.array_path.parent / "quarantine").iterdir())


def test_flipped_stored_chunk_byte_is_corrupt(
    written: tuple[GroupStore, bytes, np.ndarray],
) -> None:
    group, h, _ = written
    path = group.path_of(h)
    offsets = stored_offsets(group, path)
    flip(path, int(offsets[3]) + 20)  # inside chunk 3's compressed payload
    assert_corrupt(group, h, [3])


def test_flipped_chunk_caught_on_whole_read(
    written: tuple[GroupStore, bytes, np.ndarray],
) -> None:
    group, h, _ = written
    path = group.path_of(h)
    flip(path, int(stored_offsets(group, path)[5]) + 3)  # chunk 5's blosc header
    assert_corrupt(group, h)


def test_flipped_index_byte_is_corrupt(written: tuple[GroupStore, bytes, np.ndarray]) -> None:
    group, h, _ = written
    path = group.path_of(h)
    flip(path, os.path.getsize(path) - group.layout.index_nbytes + 9)
    assert_corrupt(group, h, [0])


@pytest.mark.parametrize("size", ["too small", "too large"])
def test_size_outside_geometry_bounds_is_corrupt(
    written: tuple[GroupStore, bytes, np.ndarray], size: str
) -> None:
    group, h, _ = written
    low, high = compressed_bounds(group.layout)
    os.truncate(group.path_of(h), low - 1 if size == "too small" else high + 1)
    assert_corrupt(group, h)


def test_hostile_blosc_header_with_valid_checksum_is_corrupt(
    written: tuple[GroupStore, bytes, np.ndarray],
) -> None:
    """A crafted chunk whose checksum matches but whose blosc header claims a larger decoded
    size must not reach the decompressor."""
    group, h, _ = written
    path = group.path_of(h)
    raw = bytearray(Path(path).read_bytes())
    offsets = stored_offsets(group, path)
    start, end = int(offsets[0]), int(offsets[1])
    struct.pack_into("<I", raw, start + 4, group.layout.chunk_nbytes * 1000)  # nbytes field
    algo = fmt.decode_header(raw).checksum_algo
    slot = checksum_function(algo)(memoryview(raw)[start:end])
    struct.pack_into("<Q", raw, fmt.checksum_slot_offset(0), slot)
    Path(path).write_bytes(raw)
    status, _ = read(group, h, [0])
    assert status is ReadStatus.CORRUPT


def test_raw_block_in_compressed_array_is_corrupt(make_store: StoreFactory, tmp_path: Path) -> None:
    """A raw (format v1) shard copied into a compressed array: the header flag says raw."""
    identity = make_small_identity()
    plain = make_store(tmp_path / "plain").namespace(identity).group(0)
    h = block_hash(3, "flag")
    plain.write_blocks([BlockWrite(h, kv_block(plain, 3))])
    packed = make_store(compression="lz4").namespace(identity).group(0)
    target = packed.path_of(h)
    Path(target).write_bytes(Path(plain.path_of(h)).read_bytes())
    status, _ = read(packed, h)
    assert status is ReadStatus.CORRUPT


# -- configuration and identity ------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["zstd", "zstd-0", "zstd-10", "lz4-1", "LZ4", "gzip", "", 3])
def test_config_rejects_unknown_compression(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="compression"):
        StoreConfig(root=tmp_path, compression=bad)  # type: ignore[arg-type]


def test_config_accepts_names_from_env(tmp_path: Path) -> None:
    config = StoreConfig.from_env(
        StoreConfig(root=tmp_path), environ={"KVSTORE_COMPRESSION": "zstd-3"}
    )
    assert config.compression == "zstd-3"


def test_array_setting_is_authoritative(make_store: StoreFactory, root: Path) -> None:
    identity = make_small_identity()
    group = make_store(compression="lz4").namespace(identity).group(0)
    h = block_hash(1, "auth")
    group.write_blocks([BlockWrite(h, kv_block(group, 1))])
    for other in ("none", "zstd-1"):
        with pytest.raises(ConfigError) as info:
            make_store(compression=other).namespace(identity)
        assert "'lz4'" in str(info.value)
        assert repr(other) in str(info.value)
    # Tools adopt the stored setting: by namespace name, or read-only.
    tool = make_store().open_namespace(identity.namespace).group(0)
    assert tool.compression == "lz4"
    assert read(tool, h)[0] is ReadStatus.HIT
    with KVStore(StoreConfig(root=root), read_only=True) as ro:
        assert read(ro.namespace(identity, create=False).group(0), h)[0] is ReadStatus.HIT


def test_uncompressed_array_refuses_compressed_config(make_store: StoreFactory) -> None:
    identity = make_small_identity()
    make_store().namespace(identity)
    with pytest.raises(ConfigError, match="created with compression 'none'"):
        make_store(compression="zstd-1").namespace(identity)


# -- several writers -------------------------------------------------------------------------


def test_multi_writer_committer_compresses(make_store: StoreFactory, codec: str) -> None:
    identity = make_small_identity()
    a = make_store(compression=codec).namespace(identity).group(0)
    b = make_store(compression=codec).namespace(identity).group(0)
    n = a.layout.num_chunks
    data = kv_block(a, 5)
    h = block_hash(5, "mw")
    (pending,) = a.begin_blocks([h])
    first, second = list(range(n // 2)), list(range(n // 2, n))
    assert a.write_chunks([ChunkWrite(pending, first, chunk_bytes(a.layout, data, first))]) == [
        None
    ]
    assert b.write_chunks([ChunkWrite(pending, second, chunk_bytes(a.layout, data, second))]) == [
        None
    ]
    (result,) = a.commit_blocks([pending])
    assert result.status is WriteStatus.WRITTEN
    assert not tmp_files(a.array_path)
    assert os.path.getsize(a.path_of(h)) < a.layout.file_nbytes
    status, got = read(b, h)
    assert status is ReadStatus.HIT
    assert got == data.tobytes()


def test_multi_writer_torn_raw_chunk_is_not_published(make_store: StoreFactory) -> None:
    group = make_store(compression="lz4").namespace(make_small_identity()).group(0)
    n = group.layout.num_chunks
    data = kv_block(group, 6)
    h = block_hash(6, "torn")
    (pending,) = group.begin_blocks([h])
    chunks = list(range(n))
    group.write_chunks([ChunkWrite(pending, chunks, chunk_bytes(group.layout, data, chunks))])
    flip(group.temp_path(pending), group.layout.chunk_offset(1) + 100)
    (result,) = group.commit_blocks([pending])
    assert result.status is WriteStatus.FAILED
    assert "does not match the checksum" in result.error
    assert not os.path.exists(group.path_of(h))
    assert not tmp_files(group.array_path)


# -- admin tools ------------------------------------------------------------------------------


def test_admin_verify_checks_compressed_blocks(
    make_store: StoreFactory, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvstore verify`` accepts intact compressed blocks (and their array document) and
    finds a damaged one; ``--fix`` moves only that one."""
    from tests.admin.util import cli_json  # noqa: PLC0415 - admin helpers, only here

    group = make_store(compression="zstd-1").namespace(make_small_identity()).group(0)
    hashes = [block_hash(i, "verify") for i in range(4)]
    group.write_blocks([BlockWrite(h, kv_block(group, i)) for i, h in enumerate(hashes)])
    rc, doc = cli_json(capsys, "verify", root)
    assert rc == 0, doc["findings"]
    assert doc["blocks"]["checked"] == 4
    bad = group.path_of(hashes[2])
    flip(bad, int(stored_offsets(group, bad)[1]) + 30)
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    assert rc == 1
    assert [(f["kind"], f["path"]) for f in doc["findings"]] == [
        ("corrupt", os.path.relpath(bad, root.absolute()))
    ]
    assert not os.path.exists(bad)
    assert all(os.path.exists(group.path_of(h)) for h in hashes if h != hashes[2])


def test_inspect_reads_compressed_values(make_store: StoreFactory, root: Path) -> None:
    """The offline inspection tool checks compressed blocks and decodes their values."""
    from kvstore.inspect.blockfile import check_block, quick_header  # noqa: PLC0415
    from kvstore.store.view import StoreView  # noqa: PLC0415

    identity = make_small_identity()
    group = make_store(compression="lz4").namespace(identity).group(0)
    h = block_hash(1, "inspect")
    data = kv_block(group, 1)
    group.write_blocks([BlockWrite(h, data)])
    view = StoreView(root).namespace(identity.namespace).groups[0]
    assert view.compression == "lz4"
    assert view.problems == ()
    path = Path(group.path_of(h))
    header, problem = quick_header(view, path)
    assert problem is None and header is not None and header.block_hash == h
    check, values = check_block(view, path, chunks=[2, 0], want_data=True)
    assert check.ok, check.summary()
    assert values is not None
    assert values.tobytes() == chunk_bytes(group.layout, data, [2, 0]).tobytes()
    flip(str(path), int(stored_offsets(group, str(path))[2]) + 40)
    check, _ = check_block(view, path, chunks=[2, 0])
    assert not check.ok
    assert [c.chunk for c in check.bad_chunks] == [2]
