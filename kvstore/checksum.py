"""Checksums of inner chunks, by the id recorded in each block header.

New blocks use the configured algorithm; readers verify with whichever algorithm the header
names, so stores stay readable when the default changes. Values are unsigned 64-bit integers
(crc32c's 32 bits are zero-extended); 0 is never a valid value of ``wsum64`` (a header slot
holding 0 means "not written yet" in the multi-writer protocol).

* ``xxh3_64`` (id 1, the host engines' default): ~25+ GB/s per core, 64 bits. python-xxhash
  holds the GIL for inputs up to at least 128 KiB, so :func:`chunk_sums` hashes a block's
  chunks in one call of the small C extension ``kvstore._native._xxh3batch`` with the GIL released
  (see "Native batch" below).
* ``crc32c`` (id 2): hardware CRC, the checksum zarr's sharding index already uses.
* ``wsum64`` (id 3, the GPUDirect engine's default): a keyed 64-bit weighted word sum that a
  GPU computes where the bytes are, so the GDS engine never copies a chunk to the host just
  to checksum it, and every engine writes byte-identical files for the same data.

``wsum64``: view the chunk as little-endian signed 32-bit words ``w_i`` (a length that is not a
multiple of 4 is zero-padded; the length itself is mixed in), fixed odd 64-bit keys
``k_i = splitmix64(SEED + i) | 1``, ``h = sum(w_i * k_i) mod 2**64``, then a 64-bit finalizer
of ``(h, byte length)`` on the host (one integer per chunk), 0 mapped to 1. One torch
implementation runs on CPU and CUDA tensors, batched over chunks (``[n, words]`` -> multiply
-> ``sum(dim=1)``; integer addition mod 2**64 is associative, so any reduction order on any
device gives the same value).

Strength (not cryptographic; it detects accidents, not adversaries):

* every single-word error is detected: changing ``w_i`` by ``d`` (``0 < |d| < 2**32``) changes
  ``h`` by ``d * k_i``, non-zero mod 2**64 because ``k_i`` is odd and ``|d| < 2**64``;
* random corruption of several words goes unnoticed only if ``sum(d_i * k_i)`` vanishes mod
  2**64: at most ``2**-33`` in the worst case (word differences are below 2**33 in magnitude,
  so the lowest set bit of a difference is bit 32 at most), about ``2**-64`` typically;
* an all-zero chunk checksums to a non-zero value that depends on its length.

Speed: on the CPU ``torch.dot`` over int64 words, up to ~8.5 GB/s on a 4 MiB chunk on the
2-core development VM (``python -m kvstore.bench.engines --checksum``); xxh3 is ~10x faster
there, which is why host engines keep xxh3 (``checksum="auto"``). On a GPU it runs at memory
bandwidth, far above any storage.

Native batch (xxh3_64 only): ``kvstore._native._xxh3batch`` contains no hash code. It opens
python-xxhash's already loaded extension module (``dlopen``) and calls the XXH3 function that module
exports (xxHash's public C API: ``XXH3_64bits_dispatch``, the runtime-SIMD entry point
python-xxhash itself calls, else ``XXH3_64bits``), once per chunk in a C loop without the GIL.
It is used only when the extension was built (``pip install`` compiles it; a machine without a
C compiler still installs), the symbol is found, and a self-test at first use agrees with
``xxhash.xxh3_64_intdigest`` on every size class of xxh3 and on strided chunks; otherwise one
log line says why and python-xxhash is called per chunk. The values are the same either way.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache
from types import ModuleType
from typing import TYPE_CHECKING

import crc32c as _crc32c
import numpy as np
import xxhash

from kvstore.callargs import address, buffer_view, native_words, ssize, typed_view
from kvstore.errors import StoreFormatError
from kvstore.native import NativeBinding

if TYPE_CHECKING:
    import torch

Checksum = Callable[[memoryview], int]
# kvstore._native._xxh3batch.sums(data, chunk_nbytes, count, stride, out)
BatchSums = Callable[[memoryview, int, int, int, memoryview], None]

log = logging.getLogger("kvstore.checksum")

XXH3_64 = 1
CRC32C = 2
WSUM64 = 3

NAMES: dict[int, str] = {XXH3_64: "xxh3_64", CRC32C: "crc32c", WSUM64: "wsum64"}
_BY_NAME: dict[str, int] = {name: algo for algo, name in NAMES.items()}
# Algorithms computed by the torch implementation, on whatever device holds the bytes.
DEVICE_ALGOS = frozenset({WSUM64})

_SEED = 0x6B7673746F726531  # "kvstore1": fixes the keys, hence the format; never change it
_MASK64 = (1 << 64) - 1
# Words multiplied per pass: bounds the int64 temporaries to ~2 x 64 MiB whatever the batch.
_WORDS_PER_PASS = 1 << 23


def checksum_id(name: str) -> int:
    """The header id of algorithm ``name``."""
    return _BY_NAME[name]


def checksum_function(algo_id: int) -> Checksum:
    """The function of header id ``algo_id``; a format error for an unknown id."""
    try:
        return _FUNCS[algo_id]
    except KeyError:
        raise StoreFormatError(
            f"checksum algorithm id: expected one of {sorted(_FUNCS)}, got {algo_id}"
        ) from None


def checksum_chunks(algo_id: int, data: memoryview, chunk_nbytes: int, count: int) -> list[int]:
    """Checksums of ``count`` consecutive ``chunk_nbytes`` slices of ``data``."""
    return list(chunk_sums(algo_id, data, chunk_nbytes, count).tolist())


def chunk_sums(
    algo_id: int, data: memoryview, chunk_nbytes: int, count: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Checksums of ``count`` consecutive ``chunk_nbytes`` slices of ``data``, as a uint64
    array (what the header's slots hold, ready to compare or encode): ``out`` (``count``
    uint64 values, filled and returned: a header's slots, written in place) or a new one.

    The hot path of every block write and verified read: a llama-8B block of 16 tokens is 256
    chunks. xxh3_64 is one call of the native batch when it is active (no GIL held while it
    hashes). Otherwise the per-chunk calls are driven from C (``map`` over precomputed slices
    into ``np.fromiter``), so no Python bytecode runs per chunk; what remains per chunk is the
    checksum function's own call.
    """
    if count and len(data) < count * chunk_nbytes:
        raise ValueError(
            f"checksum: expected at least {count * chunk_nbytes} bytes, got {len(data)}"
        )
    if out is not None and (
        out.dtype.kind != "u" or out.dtype.itemsize != 8 or out.shape != (count,)
    ):
        raise ValueError(
            f"checksum: expected out of {count} uint64 values, got {out.dtype} {out.shape}"
        )
    native = _native_sums() if algo_id == XXH3_64 else None
    if native is not None:
        if out is not None and out.dtype == np.uint64 and out.ctypes.data % 8 == 0:
            # Native byte order, aligned: the batch writes into ``out`` itself (no copy).
            native(data, chunk_nbytes, count, chunk_nbytes, out.data)
            return out
        sums = np.empty(count, dtype=np.uint64)
        native(data, chunk_nbytes, count, chunk_nbytes, sums.data)
        if out is None:
            return sums
    elif algo_id == WSUM64:
        if not count:
            sums = np.zeros(0, dtype=np.uint64)
        else:
            rows = _host_tensor(data[: count * chunk_nbytes]).view(count, chunk_nbytes)
            sums = np.asarray(wsum64_rows(rows), dtype=np.uint64)
    else:
        fn = checksum_function(algo_id)
        pieces = map(data.__getitem__, _chunk_slices(chunk_nbytes, count))
        sums = np.fromiter(map(fn, pieces), dtype=np.uint64, count=count)
    if out is None:
        return sums
    out[:] = sums
    return out


def strided_chunk_sums(  # noqa: PLR0913 - the native batch's geometry, one argument each
    algo_id: int,
    data: memoryview,
    starts: Sequence[int],
    stride: int,
    count: int,
    chunk_nbytes: int,
) -> np.ndarray:
    """Checksums of the chunks ``data[s + i * stride :][:chunk_nbytes]`` for each ``s`` in
    ``starts`` and ``i`` in ``range(count)``, start-major, as a uint64 array (the chunks of a
    block whose pieces lie at a constant stride in a larger buffer: no gather copy).

    xxh3_64 with the native batch: one call per start. Other algorithms: one call per chunk
    (all of them have a host function per chunk).
    """
    last = max(starts, default=0) + (count - 1) * stride + chunk_nbytes
    if count and starts and (min(starts) < 0 or stride < 0 or last > len(data)):
        raise ValueError(
            f"checksum: chunks up to byte {last} at a stride of {stride}, got {len(data)} bytes"
        )
    out = np.empty(len(starts) * count, dtype=np.uint64)
    if not count or not len(starts):
        return out
    native = _native_sums() if algo_id == XXH3_64 else None
    if native is not None:
        for j, start in enumerate(starts):
            native(data[start:], chunk_nbytes, count, stride, out[j * count : (j + 1) * count].data)
        return out
    fn = checksum_function(algo_id)
    at = (s + i * stride for s in starts for i in range(count))
    out[:] = [fn(data[a : a + chunk_nbytes]) for a in at]
    return out


@lru_cache(maxsize=256)
def _chunk_slices(chunk_nbytes: int, count: int) -> tuple[slice, ...]:
    """The slices of ``count`` back-to-back chunks (one tuple per block geometry)."""
    return tuple(slice(i * chunk_nbytes, (i + 1) * chunk_nbytes) for i in range(count))


def checksum_slices(algo_id: int, slices: Sequence[memoryview]) -> list[int]:
    """Checksums of each buffer in ``slices``."""
    fn = checksum_function(algo_id)
    return [fn(s) for s in slices]


def checksum_tensor_rows(algo_id: int, rows: torch.Tensor) -> list[int]:
    """Checksums of each row of a 2-D uint8 tensor, on its device when ``algo_id`` allows.

    Algorithms not in :data:`DEVICE_ALGOS` copy the rows to the host first (a round trip the
    caller chose by picking such an algorithm for device data).
    """
    import torch  # noqa: PLC0415 - lazy: reading a store with host checksums needs no torch

    if algo_id in DEVICE_ALGOS:
        return wsum64_rows(rows)
    # As bytes: each row's checksum is of its bytes whatever the element type.
    host = rows.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    count, nbytes = host.shape
    return checksum_chunks(algo_id, host.reshape(-1).data, nbytes, count)


def crc32c(data: bytes | memoryview) -> int:
    """crc32c of ``data`` (zarr's sharding index checksum, and our header checksum)."""
    return int(_crc32c.crc32c(data))


# -- native batch of xxh3_64 ------------------------------------------------------------------

# The bind-time self-test hashes both sides of each of xxh3's internal size classes (0, 1-3,
# 4-8, 9-16, 17-128, 129-240, > 240 bytes) and a few block-sized inputs.
SELF_TEST_LENGTHS = (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4096, 8192, 65536)
# Symbols tried in order: python-xxhash's own entry point (runtime SIMD dispatch), then the
# plain one (both compute the same function; tests/native/test_native_xxh3.py checks).
NATIVE_SYMBOLS = ("XXH3_64bits_dispatch", "XXH3_64bits")


def _bind_native(native: ModuleType) -> tuple[tuple[BatchSums, object] | None, str | None]:
    """Bind python-xxhash's XXH3 function in the imported extension and self-test it: the
    batch function and its capsule (kvstore._native._fileproto hashes with it while it reads or
    writes), or why not."""
    bind: Callable[[str, str], None] = native.bind
    sums: BatchSums = native.sums
    library = getattr(getattr(xxhash, "_xxhash", None), "__file__", None)
    if not isinstance(library, str):
        return None, "python-xxhash has no compiled xxhash._xxhash module to bind"
    problems: list[str] = []
    for symbol in NATIVE_SYMBOLS:
        try:
            bind(library, symbol)
        except OSError as exc:
            problems.append(str(exc))
            continue
        wrong = self_test(sums)
        if wrong is None:
            return (sums, native.function()), None
        problems.append(f"{symbol} failed its self-test: {wrong}")
    return None, "; ".join(problems)


NATIVE_BATCH = NativeBinding(
    "kvstore._native._xxh3batch", _bind_native, "using python-xxhash per chunk (the same values)"
)


def native_batch_unavailable() -> str | None:
    """Why the native xxh3 batch is not used (binding it on first call), None when it is."""
    return NATIVE_BATCH.unavailable()


def native_xxh3_capsule() -> object | None:
    """The self-tested XXH3 function of the native batch as a PyCapsule (for the fused reads
    and writes of :mod:`kvstore.io.fileproto`), binding it on first call; None when the
    native batch is not used (then those run their Python reference)."""
    bound = NATIVE_BATCH.get()
    return None if bound is None else bound[1]


def reference_batch_sums(
    data: object, chunk_nbytes: int, count: int, stride: int, out: object
) -> None:
    """``kvstore._native._xxh3batch.sums`` in Python, its reference: ``out[i]`` = xxh3_64 of the
    ``chunk_nbytes`` bytes of ``data`` at ``i * stride``, for ``i < count``, with the C's
    checks in the C's order and the same exception types (tests/native holds the two to each
    other)."""
    chunk_nbytes = ssize(chunk_nbytes, "chunk_nbytes")
    count = ssize(count, "count")
    stride = ssize(stride, "stride")
    if chunk_nbytes < 0 or count < 0:
        raise ValueError(
            f"xxh3 batch: expected chunk_nbytes >= 0 and count >= 0, got {chunk_nbytes} and {count}"
        )
    if stride < chunk_nbytes:
        raise ValueError(
            f"xxh3 batch: expected stride >= chunk_nbytes ({chunk_nbytes}), got {stride}"
        )
    source = buffer_view(data, writable=False)
    if source is None:
        raise TypeError(
            f"xxh3 batch: expected data as a contiguous buffer, got {type(data).__name__}"
        )
    target = typed_view(out)
    if target is None or target.readonly:
        raise TypeError(
            f"xxh3 batch: expected out as a writable C-contiguous buffer, got {type(out).__name__}"
        )
    if not native_words(target, signed=False):
        raise ValueError(
            f"xxh3 batch: expected out of native uint64 items aligned to 8 bytes, got format "
            f"'{target.format}' with {target.itemsize}-byte items at address % 8 = "
            f"{address(target) % 8}"
        )
    if count > 0:
        needed = (count - 1) * stride + chunk_nbytes
        if needed > sys.maxsize:
            raise ValueError(
                f"xxh3 batch: {count} chunks of {chunk_nbytes} bytes at a stride of {stride} "
                "overflow the address space"
            )
        if len(source) < needed:
            raise ValueError(
                f"xxh3 batch: expected at least {needed} bytes of data ({count} chunks of "
                f"{chunk_nbytes} at a stride of {stride}), got {len(source)}"
            )
    if target.nbytes // 8 < count:
        raise ValueError(
            f"xxh3 batch: expected out to hold at least {count} uint64 values, got "
            f"{target.nbytes // 8}"
        )
    values = np.frombuffer(target, dtype=np.uint8)[: 8 * count].view(np.uint64)
    values[:] = [
        xxhash.xxh3_64_intdigest(source[i * stride : i * stride + chunk_nbytes])
        for i in range(count)
    ]


def _native_sums() -> BatchSums | None:
    bound = NATIVE_BATCH.get()
    return None if bound is None else bound[0]


def self_test(sums: BatchSums) -> str | None:
    """Where ``sums`` disagrees with ``xxhash.xxh3_64_intdigest`` (None if nowhere): each of
    :data:`SELF_TEST_LENGTHS` from an odd address, and strided chunks."""
    data = np.random.default_rng(_SEED).integers(0, 256, size=3 << 16, dtype=np.uint8)
    view = data.data
    out = np.zeros(8, dtype=np.uint64)
    for n in SELF_TEST_LENGTHS:
        sums(view[1 : 1 + n], n, 1, n, out.data)
        if int(out[0]) != xxhash.xxh3_64_intdigest(view[1 : 1 + n]):
            return f"{n} bytes: got {int(out[0]):#x}"
    size, stride, start = 1000, 4099, 3
    sums(view[start:], size, len(out), stride, out.data)
    for i in range(len(out)):
        at = start + i * stride
        if int(out[i]) != xxhash.xxh3_64_intdigest(view[at : at + size]):
            return f"chunk {i} of {size} bytes at a stride of {stride}: got {int(out[i]):#x}"
    return None


# -- wsum64 ----------------------------------------------------------------------------------


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 output function over uint64 values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def wsum64_keys(words: int) -> np.ndarray:
    """The odd per-position keys of a chunk of ``words`` 32-bit words, as uint64."""
    return splitmix64(np.arange(words, dtype=np.uint64) + np.uint64(_SEED)) | np.uint64(1)


_KEYS: dict[tuple[int, torch.device], torch.Tensor] = {}
_KEYS_LOCK = threading.Lock()


def _keys_on(words: int, device: torch.device) -> torch.Tensor:
    """Keys as int64 (the same bits) on ``device``, built once per chunk size and device."""
    import torch  # noqa: PLC0415 - lazy: reading a store with host checksums needs no torch

    cache_key = (words, device)
    keys = _KEYS.get(cache_key)
    if keys is None:
        with _KEYS_LOCK:
            keys = _KEYS.get(cache_key)
            if keys is None:
                host = torch.from_numpy(wsum64_keys(words).view(np.int64))
                keys = _KEYS[cache_key] = host.to(device)
    return keys


def wsum64_finalize(h: int, nbytes: int) -> int:
    """Final 64-bit mix of the word sum ``h`` and the chunk length; never 0."""
    x = (h ^ ((nbytes * 0x9E3779B97F4A7C15) & _MASK64)) & _MASK64
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _MASK64
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & _MASK64
    x ^= x >> 33
    return x or 1


def wsum64_sums(rows: torch.Tensor) -> torch.Tensor:
    """The raw word sums ``h`` (int64, one per row) of a 2-D uint8 tensor, on its device.

    Rows whose length is not a multiple of 4, or whose address or storage offset is not
    4-byte aligned (``Tensor.view(torch.int32)`` checks the offset), are copied once
    (zero-padded) so they can be viewed as int32 words.
    """
    import torch  # noqa: PLC0415 - lazy: reading a store with host checksums needs no torch

    if rows.dim() != 2 or rows.dtype != torch.uint8:
        raise ValueError(
            f"wsum64: expected a 2-D uint8 tensor, got {rows.dtype} {tuple(rows.shape)}"
        )
    n, nbytes = rows.shape
    words = -(-nbytes // 4)
    if (
        nbytes % 4
        or rows.stride(1) != 1
        or rows.stride(0) % 4
        or rows.data_ptr() % 4
        or rows.storage_offset() % 4
    ):
        padded = torch.zeros(n, words * 4, dtype=torch.uint8, device=rows.device)
        padded[:, :nbytes] = rows
        rows = padded
    out = torch.zeros(n, dtype=torch.int64, device=rows.device)
    if n == 0 or words == 0:
        return out
    w = rows.view(torch.int32)
    keys = _keys_on(words, rows.device)
    if rows.device.type == "cpu":
        # torch.dot on int64 is ~2x faster than multiply + sum on the CPU (no product
        # temporary); CUDA has no integer dot. Both are exact mod 2**64: same values.
        for r in range(n):
            for c0 in range(0, words, _WORDS_PER_PASS):
                c1 = min(words, c0 + _WORDS_PER_PASS)
                out[r] += torch.dot(w[r, c0:c1].to(torch.int64), keys[c0:c1])
        return out
    # Integer adds wrap mod 2**64 and are associative: slicing rows or words changes nothing.
    per_pass = max(1, _WORDS_PER_PASS // words)
    col_step = min(words, _WORDS_PER_PASS)
    for r0 in range(0, n, per_pass):
        r1 = min(n, r0 + per_pass)
        for c0 in range(0, words, col_step):
            c1 = min(words, c0 + col_step)
            part = (w[r0:r1, c0:c1].to(torch.int64) * keys[c0:c1]).sum(dim=1)
            out[r0:r1] += part
    return out


def wsum64_rows(rows: torch.Tensor) -> list[int]:
    """wsum64 of each row of a 2-D uint8 tensor (CPU or CUDA); one small copy to the host."""
    nbytes = int(rows.shape[1]) if rows.dim() == 2 else 0
    sums = wsum64_sums(rows).to("cpu").numpy().view(np.uint64)
    return [wsum64_finalize(int(h), nbytes) for h in sums]


def wsum64(data: bytes | bytearray | memoryview) -> int:
    """wsum64 of one host buffer."""
    view = memoryview(data).cast("B")
    return wsum64_rows(_host_tensor(view).view(1, len(view)))[0]


def _host_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor over ``view`` without a copy (read-only memory is only read)."""
    import torch  # noqa: PLC0415 - lazy: reading a store with host checksums needs no torch

    if len(view) == 0:
        return torch.zeros(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # torch warns that read-only memory is exposed as a writable tensor; we only read it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


_FUNCS: dict[int, Checksum] = {
    XXH3_64: xxhash.xxh3_64_intdigest,
    CRC32C: _crc32c.crc32c,
    WSUM64: wsum64,
}
