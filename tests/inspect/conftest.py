"""A reference store for the inspection tests, written once per session from known tensors.

Four namespaces, each exercising one decode path: bfloat16 (dense chunks), float16 with
head_dim 40 (padded chunks), float8_e4m3fn, and MLA (bfloat16 latent). Every block's values
come from a torch tensor of the real dtype kept in :class:`Reference`, so tests compare what
the tool prints against numbers computed directly from those tensors.

The bfloat16 namespace holds a known prefix forest (see ``FOREST``): a system prompt shared by
three branches, a separate two-block chain, and a chain whose first block was evicted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.identity import GroupSpec, Identity, attention_group
from kvstore.inspect.cli import main
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockWrite, WriteStatus
from tests.helpers import layer_names, make_mla_identity, make_odd_identity, make_small_identity

# name -> parent name (None: first block of a chain). "o0" is never written (evicted).
FOREST: dict[str, str | None] = {
    "s0": None, "s1": "s0", "s2": "s1",
    "a0": "s2", "a1": "a0",
    "b0": "s2",
    "c0": "s2", "c1": "c0", "c2": "c1",
    "x0": None, "x1": "x0",
    "o1": "o0", "o2": "o1",
}  # fmt: skip
NAN_AT = ("a1", 0, 1, 3, 0, 5)  # block, head, layer, token, kv, dim
INF_AT = ("a1", 0, 1, 0, 1, 0)


def hash_of(name: str, salt: str = "") -> bytes:
    return hashlib.sha256(f"inspect-test/{salt}/{name}".encode()).digest()


def make_fp8_identity() -> Identity:
    return Identity(
        model="test/fp8",
        kv_dtype="float8_e4m3fn",
        tokens_per_block=16,
        groups=(attention_group("full", layer_names(2), num_kv_heads=2, head_dim=128),),
    )


def block_shape(identity: Identity) -> tuple[int, ...]:
    g: GroupSpec = identity.groups[0]
    t = identity.tokens_per_block
    return (
        (g.num_layers, t, g.latent_dim)
        if g.kind == "mla"
        else (g.num_kv_heads, g.num_layers, t, 2, g.head_dim)
    )


def to_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The canonical block bytes of a real-dtype tensor (C order)."""
    return tensor.contiguous().view(torch.uint8).reshape(-1).numpy().copy()


@dataclass
class Space:
    """One namespace of the reference store."""

    identity: Identity
    tensors: dict[bytes, torch.Tensor] = field(default_factory=dict)  # real dtype, block shape
    parents: dict[bytes, bytes | None] = field(default_factory=dict)
    names: dict[str, bytes] = field(default_factory=dict)  # FOREST name -> hash (bf16 only)

    @property
    def ns(self) -> str:
        return self.identity.namespace

    def floats(self, block_hash: bytes) -> np.ndarray:
        return self.tensors[block_hash].float().numpy()


@dataclass
class Reference:
    root: Path
    bf16: Space
    f16: Space
    fp8: Space
    mla: Space

    @property
    def spaces(self) -> list[Space]:
        return [self.bf16, self.f16, self.fp8, self.mla]


def _tensor(identity: Identity, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(block_shape(identity), generator=gen) * (1 + seed % 3)
    return values.to(getattr(torch, identity.kv_dtype))


def write_space(root: Path, space: Space) -> None:
    with KVStore(StoreConfig(root=root, durability="none", io_threads=2)) as store:
        group = store.namespace(space.identity).group(0)
        writes = [BlockWrite(h, to_bytes(t), space.parents[h]) for h, t in space.tensors.items()]
        assert all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))


def build_reference(root: Path) -> Reference:
    bf16 = Space(make_small_identity())
    for i, (name, parent_name) in enumerate(FOREST.items()):
        h = hash_of(name)
        bf16.names[name] = h
        bf16.parents[h] = hash_of(parent_name) if parent_name is not None else None
        bf16.tensors[h] = _tensor(bf16.identity, i)
    for (name, head, layer, token, kv, dim), value in (
        (NAN_AT, float("nan")),
        (INF_AT, float("inf")),
    ):
        bf16.tensors[bf16.names[name]][head, layer, token, kv, dim] = value
    spaces = [bf16]
    for salt, identity in (
        ("f16", make_odd_identity()),
        ("fp8", make_fp8_identity()),
        ("mla", make_mla_identity()),
    ):
        space = Space(identity)
        parent: bytes | None = None
        for i in range(3):
            h = hash_of(str(i), salt)
            space.parents[h] = parent
            space.tensors[h] = _tensor(identity, 100 + i)
            parent = h
        spaces.append(space)
    for space in spaces:
        write_space(root, space)
    return Reference(root, *spaces)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The shared reference store. Tests must not modify it (copy it with ``store_copy``)."""
    return build_reference(tmp_path_factory.mktemp("inspect") / "store")


@pytest.fixture
def store_copy(reference: Reference, tmp_path: Path) -> Path:
    """A private copy of the reference store, for tests that damage or change it."""
    target = tmp_path / "copy"
    shutil.copytree(reference.root, target)
    return target


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Iterator[Run]:
    """Run ``kvstore-inspect`` in process: ``run(*argv) -> (exit code, stdout, stderr)``."""

    def invoke(*argv: object) -> tuple[int, str, str]:
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    yield invoke


def run_json(run: Run, *argv: object, expect: int = 0) -> dict[str, Any]:
    """Run a view with ``--json``, check its exit code, return the parsed document."""
    code, out, err = run(*argv, "--json")
    assert code == expect, (code, out, err)
    doc: dict[str, Any] = json.loads(out)
    return doc


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every path below ``root`` with (size, mtime_ns, small-file content)."""
    out: dict[str, tuple[int, int, bytes | None]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            st = path.stat()
            content = path.read_bytes() if path.is_file() else None
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, content)
    return out
