"""wsum64: one torch implementation, checked against an independent numpy uint64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.checksum import (
    WSUM64,
    checksum_chunks,
    checksum_function,
    checksum_id,
    checksum_tensor_rows,
    wsum64,
    wsum64_finalize,
    wsum64_keys,
    wsum64_rows,
)


def reference(data: bytes) -> int:
    """wsum64 by the definition, in numpy uint64 arithmetic (wrapping)."""
    padded = data + bytes(-len(data) % 4)
    words = np.frombuffer(padded, dtype="<i4").astype(np.int64).view(np.uint64)
    keys = wsum64_keys(len(words))
    with np.errstate(over="ignore"):
        h = int((words * keys).sum(dtype=np.uint64)) if len(words) else 0
    return wsum64_finalize(h, len(data))


@pytest.mark.parametrize("nbytes", [0, 1, 3, 4, 5, 4095, 4096, 18432, 1 << 20])
def test_torch_matches_the_numpy_reference(nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    assert wsum64(data) == reference(data)


def test_batched_rows_equal_one_at_a_time_and_host_chunks() -> None:
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 256, (7, 2560), dtype=np.uint8)
    batched = wsum64_rows(torch.from_numpy(rows))
    assert batched == [wsum64(r.tobytes()) for r in rows]
    assert checksum_chunks(WSUM64, rows.reshape(-1).data, 2560, 7) == batched
    assert checksum_tensor_rows(WSUM64, torch.from_numpy(rows)) == batched


def test_unaligned_and_non_contiguous_rows() -> None:
    raw = torch.randint(0, 256, (4 * 1001 + 1,), dtype=torch.uint8, generator=torch.Generator())
    shifted = raw[1:].view(4, 1001)  # odd length, address off by one
    assert wsum64_rows(shifted) == [reference(bytes(r.numpy())) for r in shifted]


def test_words_are_signed_and_extreme_values_wrap() -> None:
    data = bytes.fromhex("ffffffff00000080ffffff7f") * 1000
    assert wsum64(data) == reference(data)


def test_every_single_word_change_is_detected() -> None:
    rng = np.random.default_rng(2)
    base = rng.integers(0, 256, 4096, dtype=np.uint8)
    good = wsum64(base.tobytes())
    words = base.view("<u4")
    for i in range(len(words)):
        for delta in (1, 0x80000000, int(rng.integers(1, 1 << 32))):
            changed = words.copy()
            changed[i] = (int(changed[i]) + delta) & 0xFFFFFFFF
            assert wsum64(changed.tobytes()) != good, (i, delta)


def test_zero_chunks_have_nonzero_length_dependent_checksums() -> None:
    values = {wsum64(bytes(n)) for n in (0, 4, 8, 4096, 4097)}
    assert 0 not in values
    assert len(values) == 5


def test_finalize_never_returns_zero() -> None:
    # The finalizer is a bijection of x; find nothing maps to 0 except via the 0 -> 1 rule.
    assert wsum64_finalize(0, 0) != 0


def test_registered_for_headers_and_readers() -> None:
    assert checksum_id("wsum64") == WSUM64 == 3
    assert checksum_function(WSUM64)(memoryview(b"abcd")) == reference(b"abcd")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_device_equals_host() -> None:  # pragma: no cover - needs CUDA
    rows = torch.randint(0, 256, (33, 18432), dtype=torch.uint8)
    assert wsum64_rows(rows.cuda()) == wsum64_rows(rows)


def test_rows_with_an_aligned_address_but_odd_storage_offset() -> None:
    # Memory whose start is not 4-byte aligned, viewed from byte 1: the address is aligned,
    # the storage offset is not, and Tensor.view(torch.int32) refuses that offset.
    raw = np.zeros(256, dtype=np.uint8)
    base = torch.from_numpy(raw[(3 - raw.ctypes.data) % 4 :])
    rows = base[1 : 1 + 2 * 64].view(2, 64)
    assert rows.data_ptr() % 4 == 0 and rows.storage_offset() % 4
    rows.copy_(torch.arange(128, dtype=torch.uint8).view(2, 64))
    expected = [reference(bytes(r.tolist())) for r in rows]
    assert wsum64_rows(rows) == expected
