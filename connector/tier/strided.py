"""A unit permutation as one pair of strided views: copies without an index gather.

A :class:`connector.tier.chunks.ChunkMap` moves a block's bytes in units (its plan: unit ``k``
of the destination comes from unit ``source[k]``). For the layouts vLLM produces, that
permutation is an axis transpose: a TP=1 row holds ``[layer][head]`` pages where the canonical
block holds ``[head][layer]``; TP ranks add a ``[rank]`` axis; replicas a stride-0 one. Such a
permutation is one strided view of the source copied into one strided view of the destination:
one ``numpy.copyto`` per block (no index tensor, no GIL held during the copy, no OpenMP team
spinning after it as torch's ``index_select`` leaves one on a busy machine), and when the
permutation is the identity no copy at all: the block is a slice of the row.

:func:`fit_strided` finds the views, or answers None (the caller keeps its index gather); the
views it returns are checked to enumerate exactly the given index pairs, so a wrong fit can
only be a missed fast path, never a wrong byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided


@dataclass(frozen=True)
class StridedCopy:
    """Pair ``k`` (C order over ``shape``) moves unit ``src_start + sum(i_d * src_strides[d])``
    to unit ``dst_start + sum(i_d * dst_strides[d])``; units are ``unit`` bytes."""

    unit: int
    shape: tuple[int, ...]
    src_start: int
    src_strides: tuple[int, ...]
    dst_start: int
    dst_strides: tuple[int, ...]

    @property
    def is_identity(self) -> bool:
        """Consecutive source units to consecutive destination units from 0: the destination
        is ``src_bytes[src_start * unit :][:size]``, no copy needed."""
        return (
            len(self.shape) == 1
            and self.src_strides == (1,)
            and self.dst_strides == (1,)
            and self.dst_start == 0
        )

    def indices(self) -> tuple[np.ndarray, np.ndarray]:
        """The (destination, source) unit index pairs the views enumerate, in order."""
        grids = np.indices(self.shape).reshape(len(self.shape), -1)
        dst = self.dst_start + np.asarray(self.dst_strides, dtype=np.int64) @ grids
        src = self.src_start + np.asarray(self.src_strides, dtype=np.int64) @ grids
        return dst, src

    def source_view(self, data: np.ndarray) -> np.ndarray:
        """The source units of flat uint8 ``data`` (one block or one row), in pair order."""
        return self._view(data, self.src_start, self.src_strides)

    def destination_view(self, data: np.ndarray) -> np.ndarray:
        """The destination units of flat uint8 ``data``, in pair order (writable if it is)."""
        return self._view(data, self.dst_start, self.dst_strides)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Move every unit of ``src`` to its place in ``dst`` (flat uint8 arrays)."""
        np.copyto(self.destination_view(dst), self.source_view(src), casting="no")

    def _view(self, data: np.ndarray, start: int, strides: tuple[int, ...]) -> np.ndarray:
        unit = self.unit
        extent = start + sum((n - 1) * s for n, s in zip(self.shape, strides, strict=True)) + 1
        if data.ndim != 1 or data.dtype != np.uint8 or data.size < extent * unit:
            raise ValueError(
                f"strided copy: expected a flat uint8 buffer of at least {extent * unit} "
                f"bytes, got {data.dtype} of shape {data.shape}"
            )
        base = data[start * unit :]
        if base.flags.c_contiguous:
            # The common case (a row or a block): the ndarray constructor over the buffer,
            # ~1 us where as_strided builds an array interface, ~6 us, once per block moved.
            # Writable exactly when ``data`` is; the bounds were checked above.
            return np.ndarray(
                (*self.shape, unit), np.uint8, base, 0, (*(s * unit for s in strides), 1)
            )
        return as_strided(
            base,
            shape=(*self.shape, unit),
            strides=(*(s * unit * base.strides[0] for s in strides), base.strides[0]),
            writeable=base.flags.writeable,
        )


def fit_strided(dst: np.ndarray, src: np.ndarray, unit: int) -> StridedCopy | None:
    """The strided views that move unit ``src[k]`` to unit ``dst[k]`` for every ``k``, or
    None when the pairs are not such a product of axes (then gather by index).

    Peels axes from the innermost out: the longest run from the start where both sequences
    advance by constant steps is an axis if every following run of that length repeats it;
    the runs' first elements are the next, outer sequence. Destination strides must be
    positive and the destination units distinct (each is written once); source strides may
    be 0 (replicas).
    The result is checked against the pairs, so a coincidental fit is refused.
    """
    dst = np.asarray(dst, dtype=np.int64)
    src = np.asarray(src, dtype=np.int64)
    if dst.ndim != 1 or dst.shape != src.shape or dst.size == 0:
        return None
    seqs = [dst - dst[0], src - src[0]]
    axes: list[tuple[int, int, int]] = []  # (length, dst step, src step), innermost first
    while seqs[0].size > 1:
        size = seqs[0].size
        steps = [int(s[1] - s[0]) for s in seqs]
        run = size
        for seq, step in zip(seqs, steps, strict=True):
            off = np.flatnonzero(seq != np.arange(size, dtype=np.int64) * step)
            if off.size:
                run = min(run, int(off[0]))
        if size % run:
            return None
        rows = [seq.reshape(-1, run) for seq in seqs]
        for block, step in zip(rows, steps, strict=True):
            if not np.array_equal(block - block[:, :1], np.arange(run) * step + 0 * block):
                return None
        axes.append((run, steps[0], steps[1]))
        seqs = [block[:, 0] for block in rows]
    if not axes:
        axes.append((1, 1, 1))
    axes.reverse()
    if any(d <= 0 or s < 0 for n, d, s in axes if n > 1) or np.unique(dst).size != dst.size:
        return None
    plan = StridedCopy(
        unit=unit,
        shape=tuple(n for n, _, _ in axes),
        src_start=int(src[0]),
        src_strides=tuple(s for _, _, s in axes),
        dst_start=int(dst[0]),
        dst_strides=tuple(d for _, d, _ in axes),
    )
    got_dst, got_src = plan.indices()
    if not (np.array_equal(got_dst, dst) and np.array_equal(got_src, src)):
        return None
    return plan
