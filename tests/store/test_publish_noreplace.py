"""Publishing never replaces a name (issue 10: several nodes on one shared file system).

``FileIO.rename`` fails with FileExistsError instead of replacing, on each of its three paths
(renameat2 RENAME_NOREPLACE, link + unlink where that flag is refused, check + rename where
hard links are missing too), and a publish that loses the race to another writer reports
EXISTS, keeps the winner's file and leaves no temporary file.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from kvstore.io import rename
from kvstore.io.fileio import FileIO
from kvstore.store import metadata
from kvstore.store.paths import DOC_TMP_PREFIX, ZARR_JSON
from kvstore.store.types import BlockWrite, ChunkWrite, WriteStatus
from tests.helpers import StoreFactory, block_bytes, block_hash, make_small_identity, tmp_files


def _refuse_flag(*args: Any) -> int:
    """renameat2 as FUSE file systems and NFS answer RENAME_NOREPLACE: EINVAL."""
    ctypes.set_errno(errno.EINVAL)
    return -1


@pytest.fixture(params=["renameat2", "link", "check"])
def path_taken(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param in ("link", "check"):
        monkeypatch.setattr(rename, "_renameat2", _refuse_flag)
    if request.param == "check":

        def no_links(src: str, dst: str) -> None:
            raise OSError(errno.EPERM, "hard links not supported")

        monkeypatch.setattr(os, "link", no_links)
    return str(request.param)


def test_rename_publishes_a_new_name(tmp_path: Path, path_taken: str) -> None:
    src, dst = tmp_path / "a.tmp-1", tmp_path / "a"
    src.write_bytes(b"new")
    FileIO().rename(str(src), str(dst))
    assert dst.read_bytes() == b"new" and not src.exists()


def test_rename_never_replaces(tmp_path: Path, path_taken: str) -> None:
    src, dst = tmp_path / "a.tmp-1", tmp_path / "a"
    src.write_bytes(b"loser")
    dst.write_bytes(b"winner")
    with pytest.raises(FileExistsError) as info:
        FileIO().rename(str(src), str(dst))
    assert info.value.filename2 == str(dst)
    assert dst.read_bytes() == b"winner" and src.read_bytes() == b"loser"


def test_other_errors_are_not_swallowed(tmp_path: Path, path_taken: str) -> None:
    with pytest.raises(FileNotFoundError):
        FileIO().rename(str(tmp_path / "missing"), str(tmp_path / "x"))


class _RacingFileIO(FileIO):
    """Lets ``rival`` publish the block just before our publishing rename."""

    def __init__(self) -> None:
        self.rival: Any = None

    def rename(self, src: str, dst: str) -> None:
        if self.rival is not None and ".tmp-" in src:
            rival, self.rival = self.rival, None
            rival()
        super().rename(src, dst)


@pytest.mark.parametrize("protocol", ["whole", "multi"])
def test_publish_that_loses_the_race_is_exists(
    make_store: StoreFactory, root: Path, protocol: str
) -> None:
    identity = make_small_identity()
    winner = make_store().namespace(identity).group(0)
    racing = _RacingFileIO()
    loser = make_store(fio=racing).namespace(identity).group(0)
    h = block_hash(1, "race")
    data = block_bytes(loser.layout, 1)
    racing.rival = lambda: winner.write_blocks([BlockWrite(h, data)])
    if protocol == "whole":
        (result,) = loser.write_blocks([BlockWrite(h, data)])
    else:
        (pending,) = loser.begin_blocks([h])
        chunks = list(range(loser.layout.num_chunks))
        assert loser.write_chunks([ChunkWrite(pending, chunks, data)]) == [None]
        (result,) = loser.commit_blocks([pending])
    assert result.status is WriteStatus.EXISTS, result
    assert tmp_files(root) == []
    header, _ = winner.read_header(h)
    path = Path(winner.path_of(h))
    assert path.stat().st_nlink == 1
    assert header.block_hash == h
    assert loser.stats.snapshot()["write_failures"] == 0


class _DocumentRace(FileIO):
    """Writes another creator's document just before our document's publishing rename."""

    def __init__(self, theirs: bytes) -> None:
        self.theirs: bytes | None = theirs

    def rename(self, src: str, dst: str) -> None:
        if self.theirs is not None and os.path.basename(src).startswith(DOC_TMP_PREFIX):
            Path(dst).write_bytes(self.theirs)
            self.theirs = None
        super().rename(src, dst)


def test_metadata_document_created_meanwhile_is_kept(tmp_path: Path) -> None:
    theirs = b'{"zarr_format": 3, "node_type": "group"}'
    metadata.write_document(_DocumentRace(theirs), tmp_path, b'{"zarr_format": 3}', True)
    assert (tmp_path / ZARR_JSON).read_bytes() == theirs
    assert sorted(p.name for p in tmp_path.iterdir()) == [ZARR_JSON]
