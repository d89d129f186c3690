"""The alignment direct I/O needs: 4 KiB for file offsets, lengths and buffer addresses.

O_DIRECT requires multiples of the device's logical block size (512 B or 4 KiB on every
file system we target) and cuFile/GPUDirect requires 4 KiB; 4 KiB covers both. The engines
own this number; the on-disk format (:mod:`kvstore.store.format`) adopts it, so that header,
chunk offsets and strides of a block file can go to disk without a bounce buffer.
"""

from __future__ import annotations

ALIGN = 4096


def align_up(n: int, alignment: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment
