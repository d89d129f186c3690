"""Plain helpers shared by the tests (fixtures live in conftest.py).

Identities are tiny so that tests run in milliseconds, but each exercises a distinct layout
path of format v1:

* :func:`make_small_identity`: 2 KV heads x 3 layers x 16 tokens x head_dim 64, bfloat16. One
  inner chunk is 16 * 2 * 64 * 2 = 4096 bytes, so chunks are back to back (dense layout).
* :func:`make_odd_identity`: head_dim 40, float16: 2560-byte chunks padded to a 4096-byte
  stride (the non-dense path: per-chunk segments and padding).
* :func:`make_mla_identity`: one latent of 576 per token (DeepSeek geometry), 4 layers,
  bfloat16: 18432-byte chunks padded to a 20480-byte stride (non-dense, one head).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore.config import StoreConfig
from kvstore.identity import GroupSpec, Identity, attention_group
from kvstore.io.fileio import FileIO
from kvstore.store.format import ShardLayout
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.paths import TMP_MARK
from kvstore.store.types import ChunkWrite, PendingBlock

StoreFactory = Callable[..., KVStore]
FROZEN_NS = 1_700_000_000_123_456_789  # created_ns under the frozen_time fixture


def layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def make_small_identity(model: str = "test/tiny-llama", revision: str = "") -> Identity:
    return Identity(
        model=model,
        kv_dtype="bfloat16",
        tokens_per_block=16,
        groups=(attention_group("full", layer_names(3), num_kv_heads=2, head_dim=64),),
        revision=revision,
    )


def make_odd_identity() -> Identity:
    return Identity(
        model="test/odd-f16",
        kv_dtype="float16",
        tokens_per_block=16,
        groups=(attention_group("full", layer_names(3), num_kv_heads=2, head_dim=40),),
    )


def make_mla_identity() -> Identity:
    return Identity(
        model="test/tiny-mla",
        kv_dtype="bfloat16",
        tokens_per_block=16,
        groups=(GroupSpec(kind="mla", layer_names=tuple(layer_names(4)), latent_dim=576),),
    )


def make_two_group_identity() -> Identity:
    """Two groups of identical geometry (gpt-oss style), to test cross-group copies."""
    return Identity(
        model="test/two-groups",
        kv_dtype="bfloat16",
        tokens_per_block=16,
        groups=(
            attention_group("sliding", layer_names(3)[0::2], 2, 64, sliding_window=128),
            attention_group("full", [*layer_names(3)[1::2], "extra"], 2, 64),
        ),
    )


def block_hash(i: int, salt: str = "") -> bytes:
    """A deterministic 32-byte block hash (sha256, like vLLM's default)."""
    return hashlib.sha256(f"block{salt}-{i}".encode()).digest()


def chain_hashes(n: int, salt: str = "") -> list[bytes]:
    """Hashes of a chain of ``n`` blocks, each covering its parent's hash."""
    out: list[bytes] = []
    parent = b"root" + salt.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


def block_bytes(layout: ShardLayout, seed: int) -> np.ndarray:
    """Deterministic canonical block bytes (uint8, ``layout.block_nbytes``) for ``seed``.

    Every chunk differs from every other and from other seeds' chunks, and no chunk is all
    zeros, so a misplaced or missing chunk is always detected.
    """
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=layout.block_nbytes, dtype=np.uint8)
    # Stamp (seed, chunk) at the start of every chunk so equal-by-chance is impossible.
    for c in range(layout.num_chunks):
        start = c * layout.chunk_nbytes
        data[start : start + 8] = np.frombuffer(
            (seed & 0xFFFFFFFF).to_bytes(4, "little") + (c | 0x80000000).to_bytes(4, "little"),
            dtype=np.uint8,
        )
    return data


def chunk_bytes(layout: ShardLayout, data: np.ndarray, chunks: list[int]) -> np.ndarray:
    """The bytes of ``chunks`` of canonical block ``data``, back to back."""
    size = layout.chunk_nbytes
    return np.concatenate([data[c * size : (c + 1) * size] for c in chunks])


def tmp_files(root: Path) -> list[Path]:
    """Every temporary file (``*.tmp-*``) below ``root``."""
    found: list[Path] = []
    for dirpath, _dirs, files in os.walk(root):
        found.extend(Path(dirpath) / f for f in files if TMP_MARK in f)
    return found


def shard_files(root: Path) -> list[Path]:
    """Every published shard file below ``root`` (paths through a ``c`` directory)."""
    found: list[Path] = []
    for dirpath, _dirs, files in os.walk(root):
        if f"{os.sep}c{os.sep}" in dirpath + os.sep:
            found.extend(Path(dirpath) / f for f in files if f.isdigit())
    return found


def open_group(
    make_store: StoreFactory, identity: Identity, index: int = 0, **overrides: object
) -> GroupStore:
    """Group ``index`` of ``identity``'s namespace in a fresh store from ``make_store``."""
    return make_store(**overrides).namespace(identity).group(index)


class RecordingFileIO(FileIO):
    """A FileIO that records (operation, path, second path) of every call, thread-safely."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str, str]] = []
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()

    def _record(self, op: str, path: str, other: str = "") -> None:
        with self._lock:
            self.ops.append((op, path, other))

    def path_of_fd(self, fd: int) -> str:
        with self._lock:
            return self._paths.get(fd, f"<fd {fd}>")

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        with self._lock:
            self._paths[fd] = path
        self._record("open", path)
        return fd

    def close(self, fd: int) -> None:
        path = self.path_of_fd(fd)
        with self._lock:
            self._paths.pop(fd, None)
        super().close(fd)
        self._record("close", path)

    def fdatasync(self, fd: int) -> None:
        self._record("fdatasync", self.path_of_fd(fd))
        super().fdatasync(fd)

    def fsync_dir(self, path: str) -> None:
        self._record("fsync_dir", path)
        super().fsync_dir(path)

    def rename(self, src: str, dst: str) -> None:
        self._record("rename", src, dst)
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        self._record("unlink", path)
        super().unlink(path)

    def clear(self) -> None:
        with self._lock:
            self.ops.clear()


def write_chunks_in_process(
    root: str, identity_json: dict[str, object], pending: PendingBlock, chunks: list[int], seed: int
) -> str | None:
    """A writer rank in its own process: open the store, write ``chunks`` of block ``seed``.

    Returns None or the error's repr (exceptions do not always pickle). Top level, so that
    ``multiprocessing`` with the spawn method can import it.
    """
    identity = Identity.from_json(identity_json)
    config = StoreConfig(root=Path(root), durability="none", io_threads=1)
    with KVStore(config) as store:
        group = store.namespace(identity).group(pending.group)
        data = block_bytes(group.layout, seed)
        payload = chunk_bytes(group.layout, data, chunks)
        (error,) = group.write_chunks([ChunkWrite(pending, chunks, payload)])
    return None if error is None else repr(error)
