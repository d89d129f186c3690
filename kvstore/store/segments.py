"""Caller buffers and chunk selections as file segments ``(offset, bytes)`` for the engines.

The block operations accept anything with the buffer protocol or a contiguous
``torch.Tensor``; these helpers turn them into flat byte views without copying where they can
(a device tensor goes to a device engine as it is, and is copied to host memory for the
others), and map a list of inner chunks onto the fewest file segments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.io.engine import AnySegment, Data, DeviceEngine
from kvstore.io.types import Segment
from kvstore.store.format import ShardLayout


def nbytes(data: Data) -> int:
    return data.numel() if isinstance(data, torch.Tensor) else len(data)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (a view, no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("buffer: expected a contiguous tensor")
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def byte_view(buffer: object) -> memoryview:
    """A C-contiguous buffer's bytes as a flat ``memoryview`` of format "B" (no copy)."""
    view = memoryview(buffer)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise ValueError("buffer: expected C-contiguous memory")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def engine_data(buffer: object, device: DeviceEngine | None, *, host: bool = False) -> Data:
    """A caller's bytes as the engine takes them: a flat uint8 tensor for a device engine
    (unless ``host``), host memory otherwise (tensors copied there)."""
    if not isinstance(buffer, torch.Tensor):
        return byte_view(buffer)
    flat = tensor_bytes(buffer)
    if device is not None and not host:
        return flat
    if flat.device.type != "cpu":
        flat = flat.to("cpu")
    return flat.numpy().data


def host_segments(segments: Sequence[AnySegment]) -> list[Segment] | None:
    """``segments`` typed as host segments when none holds a tensor, else None."""
    if any(isinstance(data, torch.Tensor) for _, data in segments):
        return None
    return [(offset, data) for offset, data in segments if not isinstance(data, torch.Tensor)]


def consecutive_runs(chunks: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of ``chunks`` whose numbers increase by one."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(chunks) + 1):
        if i == len(chunks) or chunks[i] != chunks[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


def chunk_segments(layout: ShardLayout, chunks: Sequence[int], data: Data) -> list[AnySegment]:
    """File segments of inner chunks ``chunks`` whose bytes lie back to back in ``data``
    (chunks with consecutive numbers are one segment where the layout is dense)."""
    size = layout.chunk_nbytes
    if layout.dense and isinstance(chunks, range) and chunks.step == 1:  # one run (whole)
        return [(layout.chunk_offset(chunks.start), data[: len(chunks) * size])]
    if not layout.dense:  # a stride padding between any two chunks: one segment each
        return [
            (layout.chunk_offset(c), data[i * size : (i + 1) * size]) for i, c in enumerate(chunks)
        ]
    return [
        (layout.chunk_offset(chunks[i]), data[i * size : j * size])
        for i, j in consecutive_runs(chunks)
    ]
