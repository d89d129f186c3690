"""A store written by kvstore is a plain zarr v3 hierarchy: zarr-python reads every value.

The reads here use zarr and numpy only; the chunk coordinates are computed from the hash by
hand (first byte; next 62 bits), not with kvstore.keys. One test runs the read in a separate
interpreter that never imports kvstore.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import zarr

from kvstore.identity import Identity
from kvstore.store.group_store import GroupStore
from kvstore.store.types import BlockWrite, ChunkWrite, WriteStatus
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    make_mla_identity,
    make_odd_identity,
    make_small_identity,
)


def coords(h: bytes) -> tuple[int, int]:
    return h[0], int.from_bytes(h[1:9], "big") >> 2


def bits_dtype(identity: Identity) -> str:
    """The unsigned type whose values are the raw element bits."""
    return {1: "<u1", 2: "<u2", 4: "<u4"}[identity.dtype.itemsize]


def logical(group: GroupStore, data: np.ndarray, bits: str) -> np.ndarray:
    """Canonical block bytes as the array's logical block: (H, L, T, 2, D) or (L, T, latent)."""
    spec = group.spec
    tokens = group.layout.tokens
    values = data.view(bits)
    if spec.kind == "mla":
        return values.reshape(spec.num_layers, tokens, spec.latent_dim)
    return values.reshape(spec.num_kv_heads, spec.num_layers, tokens, 2, spec.head_dim)


def write_some(group: GroupStore, n: int, salt: str) -> dict[bytes, np.ndarray]:
    blocks = {block_hash(i, salt): block_bytes(group.layout, 1000 + i) for i in range(n)}
    results = group.write_blocks([BlockWrite(h, d) for h, d in blocks.items()])
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * n
    return blocks


def test_zarr_reads_values(make_store: StoreFactory, any_identity: Identity) -> None:
    group = make_store().namespace(any_identity).group(0)
    blocks = write_some(group, 4, any_identity.model)
    bits = bits_dtype(any_identity)
    spec = group.spec

    array = zarr.open_array(str(group.array_path), mode="r")
    expected_dtype = {"bfloat16": "uint16", "float16": "float16"}[any_identity.kv_dtype]
    assert str(array.dtype) == expected_dtype
    attrs = array.attrs["kvstore"]
    assert isinstance(attrs, dict)
    assert attrs["dtype"] == any_identity.kv_dtype
    if spec.kind == "mla":
        assert array.shape == (spec.num_layers, 16, spec.latent_dim, 256, 2**62)
        names: tuple[str, ...] = ("layer", "token", "latent", "hash_hi", "hash_lo")
    else:
        heads, layers = spec.num_kv_heads, spec.num_layers
        assert array.shape == (heads, layers, 16, 2, spec.head_dim, 256, 2**62)
        names = ("kv_head", "layer", "token", "kv", "head_dim", "hash_hi", "hash_lo")
    assert array.metadata.dimension_names == names  # type: ignore[union-attr]

    for h, data in blocks.items():
        hi, lo = coords(h)
        want = logical(group, data, bits)
        if spec.kind == "mla":
            whole = np.asarray(array[:, :, :, hi, lo])
            assert whole.view(bits).shape == want.shape
            np.testing.assert_array_equal(whole.view(bits), want)
            third = np.asarray(array[2, :, :, hi, lo])
            np.testing.assert_array_equal(third.view(bits), want[2])
        else:
            whole = np.asarray(array[:, :, :, :, :, hi, lo])
            assert whole.view(bits).shape == want.shape
            np.testing.assert_array_equal(whole.view(bits), want)
            for head, layer in [(0, 0), (1, 2), (0, 1)]:
                inner = np.asarray(array[head, layer, :, :, :, hi, lo])
                np.testing.assert_array_equal(inner.view(bits), want[head, layer])
            # K and V of one token of one head and layer: token-major, K then V.
            kv = np.asarray(array[1, 1, 5, :, :, hi, lo]).view(bits)
            chunk = 1 * spec.num_layers + 1
            per_token = 2 * spec.head_dim
            start = chunk * 16 * per_token + 5 * per_token
            flat = data.view(bits)
            np.testing.assert_array_equal(kv[0], flat[start : start + spec.head_dim])
            np.testing.assert_array_equal(kv[1], flat[start + spec.head_dim : start + per_token])

    # A block that was never written reads as the fill value.
    hi, lo = coords(block_hash(999, "absent"))
    absent = np.asarray(array[..., hi, lo])
    assert not absent.any()


_READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import zarr

    cases = json.loads(sys.argv[1])
    for case in cases:
        array = zarr.open_array(case["array"], mode="r")
        want = np.load(case["expected"])
        hi, lo = case["hi"], case["lo"]
        lead = array.ndim - 2
        whole = np.asarray(array[(slice(None),) * lead + (hi, lo)])
        assert whole.view(want.dtype).shape == want.shape, (whole.shape, want.shape)
        assert np.array_equal(whole.view(want.dtype), want), case["array"]
        if lead == 5:  # attention: head 0, layer 0
            first, ref = np.asarray(array[0, 0, :, :, :, hi, lo]), want[0, 0]
        else:  # MLA: layer 0
            first, ref = np.asarray(array[0, :, :, hi, lo]), want[0]
        assert np.array_equal(first.view(want.dtype), ref), case["array"]
    assert not any(name == "kvstore" or name.startswith("kvstore.") for name in sys.modules)
    print("zarr-only read ok:", len(cases))
    """
)


def test_zarr_only_reader_process(make_store: StoreFactory, root: Path, tmp_path: Path) -> None:
    """A separate interpreter with only zarr and numpy imported reads all three layouts."""
    store = make_store()
    cases = []
    for identity in (make_small_identity(), make_odd_identity(), make_mla_identity()):
        group = store.namespace(identity).group(0)
        (h, data), *_ = write_some(group, 2, identity.model).items()
        expected = tmp_path / f"{identity.namespace}.npy"
        np.save(expected, logical(group, data, bits_dtype(identity)))
        hi, lo = coords(h)
        cases.append(
            {"array": str(group.array_path), "expected": str(expected), "hi": hi, "lo": lo}
        )
    proc = subprocess.run(
        [sys.executable, "-c", _READER, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "zarr-only read ok: 3"


@pytest.mark.parametrize("kind", ["bfloat16", "mla"])
def test_zarr_reads_multi_writer_block(make_store: StoreFactory, kind: str) -> None:
    """A block assembled by two writers is as readable as one written whole."""
    identity = make_small_identity() if kind == "bfloat16" else make_mla_identity()
    group = make_store().namespace(identity).group(0)
    layout = group.layout
    data = block_bytes(layout, 77)
    h = block_hash(77)
    (pending,) = group.begin_blocks([h])
    chunks = list(range(layout.num_chunks))
    mine, theirs = chunks[::2], chunks[1::2]
    size = layout.chunk_nbytes
    for part in (mine, theirs):
        payload = np.concatenate([data[c * size : (c + 1) * size] for c in part])
        assert group.write_chunks([ChunkWrite(pending, part, payload)]) == [None]
    assert group.commit_blocks([pending])[0].status is WriteStatus.WRITTEN
    array = zarr.open_array(str(group.array_path), mode="r")
    hi, lo = coords(h)
    whole = np.asarray(array[(slice(None),) * (array.ndim - 2) + (hi, lo)])
    np.testing.assert_array_equal(whole.view("<u2"), logical(group, data, "<u2"))
