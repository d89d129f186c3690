"""The protocol floor (kvstore.bench.floor): it writes valid block files, publishes without
replacing, and verifies what it reads (a damaged file fails, never reads back as data)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.bench import floor as floor_module
from kvstore.bench.common import Workload, make_workload
from kvstore.bench.floor import ProtocolFloor, SyscallFloor
from kvstore.bench.lookup import tiny_identity
from kvstore.bench.systems import FloorSystem, KvstoreSystem, make_system
from kvstore.errors import CorruptBlockError
from kvstore.io.host import probe_direct_io
from kvstore.models import load_model
from kvstore.store.format import ShardLayout, check_header, decode_header

# gemma-3-1b at 16 tokens: dense (16 KiB chunks); deepseek-v3 at 16 tokens: padded (18 KiB
# chunks at a 20 KiB stride)
MODELS = ("gemma-3-1b", "deepseek-v3")


def floor_for(root: Path, model: str, direct: bool = False) -> tuple[ProtocolFloor, Workload]:
    identity = load_model(model).identity(16)
    layout = ShardLayout.for_group(identity.groups[0], 16, identity.dtype.itemsize)
    work = make_workload(layout, 6, seed=3, tag=model, batch=4)
    system = make_system("floor", root, identity, 2, "full", direct, "none")
    assert isinstance(system, FloorSystem)
    return system, work


def tree(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root``: (inode, bytes) by relative path."""
    return {
        str(p.relative_to(root)): (p.stat().st_ino, p.read_bytes())
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_floor_writes_kvstore_block_files_and_reads_them_back(
    tmp_path: Path, model: str, direct: bool
) -> None:
    if direct and not probe_direct_io(tmp_path, "auto").enabled:
        pytest.skip(f"O_DIRECT does not work in {tmp_path}")
    floor, work = floor_for(tmp_path / "floor", model, direct)
    try:
        floor.write(work)
        assert floor.written == len(work.hashes)
        identity = load_model(model).identity(16)
        for i, block_hash in enumerate(work.hashes):
            data = Path(floor.path(block_hash)).read_bytes()
            layout = floor.layout
            assert len(data) == layout.file_nbytes
            header = decode_header(data)  # the store's own decoder and checks accept it
            check_header(header, layout, identity.digest, 0, block_hash)
            assert header.parent_hash == work.parents[i]
            assert data[layout.data_end :] == layout.index_bytes
            first = data[layout.data_offset : layout.data_offset + layout.chunk_nbytes]
            assert first == work.data(i)[: layout.chunk_nbytes].tobytes()
        assert not [p for p in (tmp_path / "floor").rglob(".*") if p.is_file()]  # no temps
        outs = work.outs
        for out in outs:
            out[:] = 0
        floor.read(work, outs)
        work.check_last_batch(outs, "floor")
    finally:
        floor.close()


def test_floor_skips_stored_blocks_and_never_replaces_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    floor, work = floor_for(tmp_path / "floor", "gemma-3-1b")
    try:
        floor.write(work)
        before = tree(tmp_path / "floor")
        floor.write(work)  # every block is found by its lstat: nothing written
        assert floor.written == len(work.hashes)
        assert tree(tmp_path / "floor") == before
        # Another writer publishing between our lstat and our rename: renameat2 refuses
        # to replace its file, ours is removed.
        monkeypatch.setattr(floor_module, "stored", lambda path: False)
        floor.write(work)
        assert floor.written == len(work.hashes)
        assert tree(tmp_path / "floor") == before
    finally:
        floor.close()


def test_publish_noreplace_refuses_an_existing_name(tmp_path: Path) -> None:
    (tmp_path / "tmp").write_bytes(b"new")
    (tmp_path / "final").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        floor_module.publish_noreplace(str(tmp_path / "tmp"), str(tmp_path / "final"))
    assert (tmp_path / "final").read_bytes() == b"old"
    floor_module.publish_noreplace(str(tmp_path / "tmp"), str(tmp_path / "other"))
    assert (tmp_path / "other").read_bytes() == b"new"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(
    ("where", "words"),
    [
        ("chunk", "inner chunk checksum mismatch"),
        ("last chunk", "inner chunk checksum mismatch"),
        ("key", "header does not match the array and key"),
        ("created", "header checksum mismatch"),
        ("slot", "inner chunk checksum mismatch"),
        ("short", "expected a regular file of"),
    ],
)
def test_a_damaged_file_fails_verification(
    tmp_path: Path, model: str, where: str, words: str
) -> None:
    floor, work = floor_for(tmp_path / "floor", model)
    try:
        floor.write(work)
        layout = floor.layout
        path = floor.path(work.hashes[1])
        offset = {
            "chunk": layout.data_offset + 5,
            "last chunk": layout.chunk_offset(layout.num_chunks - 1) + layout.chunk_nbytes - 1,
            "key": 60,
            "created": 162,
            "slot": 176 + 8 * (layout.num_chunks - 1),
        }.get(where)
        if offset is None:
            os.truncate(path, layout.file_nbytes - 1)
        else:
            with open(path, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x10]))
        outs = work.outs
        with pytest.raises(CorruptBlockError, match=words):
            floor.read(work, outs)
    finally:
        floor.close()


def test_a_block_read_under_another_key_fails(tmp_path: Path) -> None:
    floor, work = floor_for(tmp_path / "floor", "gemma-3-1b")
    try:
        floor.write(work)
        os.replace(floor.path(work.hashes[0]), floor.path(work.hashes[1]))  # mis-keyed
        Path(floor.path(work.hashes[0])).write_bytes(Path(floor.path(work.hashes[1])).read_bytes())
        out = np.zeros(work.block_nbytes, dtype=np.uint8)
        with pytest.raises(CorruptBlockError, match="header does not match"):
            floor._read_one((work.hashes[1], out))
    finally:
        floor.close()


# -- the syscall floor: the protocol's system calls alone, on the store's paths ------------------


def syscall_floor_for(tmp_path: Path) -> tuple[SyscallFloor, Workload, KvstoreSystem]:
    store = KvstoreSystem(tmp_path / "store", tiny_identity(), 1, "none", "none", "off")
    layout = store.group.layout
    calls = SyscallFloor(tmp_path / "calls", store.store.config.root, store.group.path_of, layout)
    return calls, make_workload(layout, 5, seed=5, tag="calls", batch=5), store


def test_syscall_floor_runs_on_paths_shaped_like_the_stores(tmp_path: Path) -> None:
    calls, work, store = syscall_floor_for(tmp_path)
    try:
        root = str(store.store.config.root)
        _, raw_paths = calls.raw_write(work)
        _, published = calls.protocol_write(work)
        for i, block_hash in enumerate(work.hashes):
            shape = store.group.path_of(block_hash)[len(root) :]  # /<namespace>/g0/c/.../<lo>
            assert raw_paths[i].endswith(shape) and published[i].endswith(shape)
            assert Path(raw_paths[i]).read_bytes() == work.data(i).tobytes()
            file = Path(published[i]).read_bytes()
            layout = calls.layout
            assert len(file) == layout.file_nbytes  # header page, data and index, as a block
            assert file[layout.data_offset : layout.data_end] == work.data(i).tobytes()
            assert file[layout.data_end :] == layout.index_bytes
        # published by rename: no temporary file is left beside the blocks
        assert not [p for p in (tmp_path / "calls").rglob(".*") if p.is_file()]
    finally:
        store.close()


def test_syscall_floor_reads_back_what_it_wrote_and_checks_the_size(tmp_path: Path) -> None:
    calls, work, store = syscall_floor_for(tmp_path)
    try:
        _, raw_paths = calls.raw_write(work)
        _, published = calls.protocol_write(work)
        for paths, read in ((raw_paths, calls.raw_read), (published, calls.protocol_read)):
            outs = [np.zeros(work.block_nbytes, dtype=np.uint8) for _ in range(len(paths))]
            read(paths, outs)
            for i, out in enumerate(outs):
                assert out.tobytes() == work.data(i).tobytes()
        # the protocol's read is kvstore's read_regular: a short file is refused, not read
        os.truncate(published[2], calls.layout.file_nbytes - 1)
        outs = [np.zeros(work.block_nbytes, dtype=np.uint8) for _ in range(len(published))]
        with pytest.raises(CorruptBlockError):
            calls.protocol_read(published, outs)
    finally:
        store.close()


def test_syscall_floor_refuses_a_padded_layout(tmp_path: Path) -> None:
    identity = load_model("deepseek-v3").identity(16)
    layout = ShardLayout.for_group(identity.groups[0], 16, identity.dtype.itemsize)
    assert not layout.dense
    with pytest.raises(ValueError, match="expected a dense layout"):
        SyscallFloor(tmp_path, tmp_path, str, layout)
