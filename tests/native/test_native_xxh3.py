"""The native xxh3 batch (kvstore/_native/xxh3batch.c through kvstore.checksum): the same values as
python-xxhash for every shape of input, every bound checked, and the per-chunk fallback when
it cannot be bound."""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
import torch
import xxhash

from kvstore import checksum
from kvstore.checksum import XXH3_64, chunk_sums
from kvstore.native import import_extension, native_mode


def _native_module() -> ModuleType:
    """The extension, bound and active, or a skip (it is optional; see test_native_required)."""
    why = checksum.native_batch_unavailable()
    if why is not None:
        pytest.skip(f"native xxh3 batch not active: {why}")
    # the module bound (KVSTORE_NATIVE_DIR too)
    return import_extension("kvstore._native._xxh3batch")


def _reference(data: bytes | memoryview, chunk_nbytes: int, count: int, stride: int) -> list[int]:
    view = memoryview(data)
    return [
        xxhash.xxh3_64_intdigest(view[i * stride : i * stride + chunk_nbytes]) for i in range(count)
    ]


def _native(data: object, chunk_nbytes: int, count: int, stride: int) -> list[int]:
    module = _native_module()
    out = np.full(count, 0xDEAD, dtype=np.uint64)
    module.sums(data, chunk_nbytes, count, stride, out)
    return [int(x) for x in out]


@pytest.fixture(scope="module")
def noise() -> bytes:
    return np.random.default_rng(17).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()


def test_native_required() -> None:
    """CI sets KVSTORE_NATIVE=require: there the extension must build, bind and pass its
    self-test, or the fast path silently regressed to per-chunk calls."""
    if native_mode() != "require":
        pytest.skip("KVSTORE_NATIVE is not require")
    assert checksum.native_batch_unavailable() is None


@pytest.mark.parametrize(
    "chunk_nbytes", [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1000, 4096, 8192, 18432]
)
@pytest.mark.parametrize("count", [0, 1, 2, 7, 33])
def test_same_values_as_python_xxhash(noise: bytes, chunk_nbytes: int, count: int) -> None:
    assert _native(noise, chunk_nbytes, count, chunk_nbytes) == _reference(
        noise, chunk_nbytes, count, chunk_nbytes
    )


@pytest.mark.parametrize(("chunk_nbytes", "stride"), [(1, 7), (240, 4096), (18432, 20480)])
def test_strided_chunks(noise: bytes, chunk_nbytes: int, stride: int) -> None:
    count = 30
    assert _native(noise, chunk_nbytes, count, stride) == _reference(
        noise, chunk_nbytes, count, stride
    )


def test_last_chunk_may_end_at_the_buffer_end(noise: bytes) -> None:
    """The bound is ``(count - 1) * stride + chunk_nbytes``: the last chunk needs no padding."""
    data = memoryview(noise)[: 2 * 4096 + 100]
    assert _native(data, 100, 3, 4096) == _reference(data, 100, 3, 4096)


def test_both_symbols_give_the_same_values(noise: bytes) -> None:
    """XXH3_64bits_dispatch (python-xxhash's entry point) and XXH3_64bits agree."""
    module = _native_module()
    library = importlib.import_module("xxhash._xxhash").__file__
    assert library is not None
    results = []
    try:
        for symbol in checksum.NATIVE_SYMBOLS:
            module.bind(library, symbol)
            results.append(_native(noise, 1000, 200, 1003))
    finally:
        module.bind(library, checksum.NATIVE_SYMBOLS[0])
    assert results[0] == results[1] == _reference(noise, 1000, 200, 1003)


def test_inputs_of_every_buffer_kind(noise: bytes) -> None:
    array = np.frombuffer(noise, dtype=np.uint8)  # read-only numpy
    read_only = memoryview(bytearray(noise)).toreadonly()
    tensor = torch.frombuffer(bytearray(noise), dtype=torch.uint8)
    words = np.frombuffer(noise, dtype=np.float32).reshape(-1, 1024)  # not uint8, 2-D
    expected = _reference(noise, 4096, 64, 4096)
    for data in (noise, array, read_only, tensor.numpy(), words.data):
        assert _native(data, 4096, 64, 4096) == expected


def test_chunk_sums_uses_the_native_batch_for_xxh3(
    noise: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """chunk_sums goes through the batch (not python-xxhash per chunk) and returns the same
    uint64 array as before."""
    _native_module()
    calls: list[int] = []
    real = xxhash.xxh3_64_intdigest

    def counting(data: memoryview) -> int:
        calls.append(len(data))
        return int(real(data))

    monkeypatch.setitem(checksum._FUNCS, XXH3_64, counting)
    sums = chunk_sums(XXH3_64, memoryview(noise), 8192, 128)
    assert calls == []
    assert sums.dtype == np.uint64
    assert sums.tolist() == _reference(noise, 8192, 128, 8192)


def test_checksum_tensor_rows_of_host_rows(noise: bytes) -> None:
    rows = torch.frombuffer(bytearray(noise), dtype=torch.uint8)[: 64 * 1000].view(64, 1000)
    assert checksum.checksum_tensor_rows(XXH3_64, rows) == _reference(noise, 1000, 64, 1000)
    # Rows of wider elements are checksummed as their bytes (500 bf16 = 1000 bytes).
    wide = torch.frombuffer(bytearray(noise), dtype=torch.bfloat16)[: 64 * 500].view(64, 500)
    assert checksum.checksum_tensor_rows(XXH3_64, wide) == _reference(noise, 1000, 64, 1000)
    half = torch.frombuffer(bytearray(noise), dtype=torch.float16)[: 64 * 500].view(64, 500)
    assert checksum.checksum_tensor_rows(XXH3_64, half) == _reference(noise, 1000, 64, 1000)
    assert checksum.checksum_tensor_rows(XXH3_64, rows[:0]) == []


@pytest.mark.parametrize(
    ("chunk_nbytes", "count", "stride", "data_len", "expected"),
    [
        (100, 10, 100, 999, "expected at least 1000 bytes of data"),
        (100, 3, 4096, 8291, "expected at least 8292 bytes of data"),
        (100, 1, 100, 0, "expected at least 100 bytes of data"),
        (-1, 1, 1, 10, "expected chunk_nbytes >= 0 and count >= 0, got -1 and 1"),
        (1, -1, 1, 10, "expected chunk_nbytes >= 0 and count >= 0, got 1 and -1"),
        (100, 2, 99, 1000, r"expected stride >= chunk_nbytes \(100\), got 99"),
        (1, 1 << 62, 1 << 62, 10, "overflow the address space"),
    ],
)
def test_short_or_bad_data_is_a_value_error(
    chunk_nbytes: int, count: int, stride: int, data_len: int, expected: str
) -> None:
    module = _native_module()
    out = np.zeros(16, dtype=np.uint64)
    with pytest.raises(ValueError, match=expected):
        module.sums(bytes(data_len), chunk_nbytes, count, stride, out)


def test_short_or_bad_out_is_an_error() -> None:
    module = _native_module()
    data = bytes(1000)
    with pytest.raises(ValueError, match="expected out to hold at least 10 uint64 values, got 9"):
        module.sums(data, 100, 10, 100, np.zeros(9, dtype=np.uint64))
    items = "expected out of native uint64 items aligned to 8 bytes, got format"
    with pytest.raises(ValueError, match=f"{items} 'l'"):
        module.sums(data, 100, 10, 100, np.zeros(10, dtype=np.int64))
    with pytest.raises(ValueError, match=f"{items} 'B' with 1-byte items"):
        module.sums(data, 100, 10, 100, bytearray(80))
    misaligned = np.zeros(88, dtype=np.uint8)[1:81].view(np.uint64)
    with pytest.raises(ValueError, match="with 8-byte items at address % 8 = 1"):
        module.sums(data, 100, 10, 100, misaligned)
    writable = "expected out as a writable C-contiguous buffer"
    with pytest.raises(TypeError, match=f"{writable}, got bytes"):
        module.sums(data, 100, 10, 100, bytes(80))
    with pytest.raises(TypeError, match=rf"{writable}, got numpy\.ndarray"):
        module.sums(data, 100, 10, 100, np.zeros(20, dtype=np.uint64)[::2])
    with pytest.raises(
        TypeError, match=r"expected data as a contiguous buffer, got numpy\.ndarray"
    ):
        module.sums(np.zeros(2000, dtype=np.uint8)[::2], 100, 10, 100, np.zeros(10, np.uint64))
    with pytest.raises(TypeError, match="expected data as a contiguous buffer, got str"):
        module.sums("text", 1, 1, 1, np.zeros(1, np.uint64))


def test_chunk_sums_short_data_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="expected at least 1000 bytes, got 999"):
        chunk_sums(XXH3_64, memoryview(bytes(999)), 100, 10)


def test_two_threads_at_once_get_right_results(noise: bytes) -> None:
    """Concurrent calls (the GIL is released inside) each get their own right values."""
    _native_module()
    geometries = [(8192, 128), (16384, 64), (4096, 256), (1000, 1000)]
    expected = {g: _reference(noise, g[0], g[1], g[0]) for g in geometries}
    failures: list[str] = []
    barrier = threading.Barrier(2)

    def work(offset: int) -> None:
        barrier.wait()
        for rep in range(50):
            size, count = geometries[(rep + offset) % len(geometries)]
            got = chunk_sums(XXH3_64, memoryview(noise), size, count).tolist()
            if got != expected[size, count]:
                failures.append(f"thread {offset} rep {rep} {size}x{count}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@pytest.fixture
def unbound(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """checksum bound afresh with a binding that fails (as on a machine without the symbol)."""

    def missing(module: ModuleType) -> tuple[None, str]:
        return None, "dlsym(XXH3_64bits): undefined symbol"

    monkeypatch.delenv("KVSTORE_NATIVE", raising=False)  # auto: CI's require would raise
    monkeypatch.delenv("KVSTORE_NATIVE_DIR", raising=False)
    checksum.NATIVE_BATCH.reset()
    monkeypatch.setattr(checksum.NATIVE_BATCH, "_bind", missing)
    yield
    monkeypatch.undo()
    checksum.NATIVE_BATCH.reset()  # the next use binds the real extension again


def test_fallback_when_the_symbol_is_missing(
    noise: bytes, unbound: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.native"):
        first = chunk_sums(XXH3_64, memoryview(noise), 8192, 100)
        second = chunk_sums(XXH3_64, memoryview(noise), 4096, 10)
        why = checksum.native_batch_unavailable()
    assert first.tolist() == _reference(noise, 8192, 100, 8192)
    assert second.tolist() == _reference(noise, 4096, 10, 4096)
    assert why == "dlsym(XXH3_64bits): undefined symbol"
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstore.native"]
    assert lines == [
        "kvstore._native._xxh3batch unavailable: dlsym(XXH3_64bits): undefined symbol; "
        "using python-xxhash per chunk (the same values)"
    ]


def test_self_test_catches_a_wrong_function() -> None:
    """A bound function that is not xxh3 (wrong symbol, wrong library) is never used."""

    def off_by_one(data: memoryview, size: int, count: int, stride: int, out: memoryview) -> None:
        values = np.frombuffer(out, dtype=np.uint64)
        for i in range(count):
            at = i * stride
            values[i] = (xxhash.xxh3_64_intdigest(data[at : at + size]) + (size == 129)) % 2**64

    def strided_wrong(
        data: memoryview, size: int, count: int, stride: int, out: memoryview
    ) -> None:
        values = np.frombuffer(out, dtype=np.uint64)
        for i in range(count):
            values[i] = xxhash.xxh3_64_intdigest(data[i * size : (i + 1) * size])

    def good(data: memoryview, size: int, count: int, stride: int, out: memoryview) -> None:
        values = np.frombuffer(out, dtype=np.uint64)
        for i in range(count):
            values[i] = xxhash.xxh3_64_intdigest(data[i * stride : i * stride + size])

    assert checksum.self_test(off_by_one) is not None
    assert "129 bytes" in str(checksum.self_test(off_by_one))
    assert "stride" in str(checksum.self_test(strided_wrong))
    assert checksum.self_test(good) is None


def test_binder_reports_a_missing_symbol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real binder, asked for a symbol python-xxhash does not export, declines and says
    why (the extension's current binding is left as it was)."""
    module = _native_module()
    monkeypatch.setattr(checksum, "NATIVE_SYMBOLS", ("XXH3_no_such_symbol",))
    sums, why = checksum._bind_native(module)
    assert sums is None
    assert why is not None
    assert "dlsym(XXH3_no_such_symbol)" in why
    assert checksum.native_batch_unavailable() is None  # the process-wide binding is intact
    assert chunk_sums(XXH3_64, memoryview(bytes(64)), 8, 8).tolist() == _reference(
        bytes(64), 8, 8, 8
    )


def test_binder_reports_an_unbuilt_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_extension(name: str, package: str | None = None) -> ModuleType:
        if name == "kvstore._native._xxh3batch":
            raise ImportError("No module named 'kvstore._native._xxh3batch'")
        return real(name, package)

    monkeypatch.delenv("KVSTORE_NATIVE", raising=False)
    monkeypatch.delenv("KVSTORE_NATIVE_DIR", raising=False)
    monkeypatch.setattr(importlib, "import_module", no_extension)
    checksum.NATIVE_BATCH.reset()
    try:
        why = checksum.native_batch_unavailable()
    finally:
        monkeypatch.undo()
        checksum.NATIVE_BATCH.reset()
    assert why == (
        "extension kvstore._native._xxh3batch not built "
        "(No module named 'kvstore._native._xxh3batch')"
    )


@pytest.mark.parametrize("order", ["<u8", ">u8"])
@pytest.mark.parametrize("algo", [checksum.XXH3_64, checksum.CRC32C, checksum.WSUM64])
def test_chunk_sums_into_out(noise: bytes, algo: int, order: str) -> None:
    """``out`` (a header's slots, written in place by the publisher) is filled with the same
    values chunk_sums returns, in its own byte order, and returned; nothing past it changes."""
    want = chunk_sums(algo, memoryview(noise), 4096, 24)
    backing = np.full(26, 0xEE, dtype=order)
    out = backing[1:25]
    assert chunk_sums(algo, memoryview(noise), 4096, 24, out) is out
    assert out.tolist() == want.tolist()
    assert backing[0] == backing[25] == 0xEE


def test_chunk_sums_into_out_without_the_native_batch(noise: bytes, unbound: None) -> None:
    out = np.zeros(10, dtype=np.uint64)
    assert chunk_sums(XXH3_64, memoryview(noise), 4096, 10, out) is out
    assert out.tolist() == _reference(noise, 4096, 10, 4096)


def test_chunk_sums_refuses_a_wrong_out(noise: bytes) -> None:
    for bad in (np.zeros(9, np.uint64), np.zeros(10, np.int64), np.zeros(10, np.uint32)):
        with pytest.raises(ValueError, match="expected out of 10 uint64 values, got"):
            chunk_sums(XXH3_64, memoryview(noise), 4096, 10, bad)
