"""Arguments as the C extensions' ``PyArg_ParseTuple`` and buffer requests take them, in
Python: the references of kvstore's native calls (:mod:`kvstore.io.callcheck`,
:func:`kvstore.checksum.reference_batch_sums`) convert and refuse alike, with the same
exception types (``n``: any integer within ``Py_ssize_t``, else OverflowError; ``i``: within a
C ``int``; a non-integer is TypeError; a buffer the C could not acquire is None here, for the
caller to name in its TypeError).
"""

from __future__ import annotations

import operator
import os
import sys
from typing import Any

import numpy as np

_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1
_SSIZE_MIN, _SSIZE_MAX = -sys.maxsize - 1, sys.maxsize


def ssize(value: object, name: str) -> int:
    """``value`` as ``PyArg_ParseTuple``'s ``n`` takes it: TypeError for a non-integer,
    OverflowError outside ``Py_ssize_t``."""
    number = _index(value, name)
    if not _SSIZE_MIN <= number <= _SSIZE_MAX:
        raise OverflowError(f"{name}: Python int too large to convert to C ssize_t")
    return number


def cint(value: object, name: str) -> int:
    """``value`` as ``PyArg_ParseTuple``'s ``i`` takes it (a C int)."""
    number = _index(value, name)
    if not _INT_MIN <= number <= _INT_MAX:
        raise OverflowError(f"{name}: signed integer is out of range of a C int")
    return number


def _index(value: object, name: str) -> int:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None


def path_bytes(path: object) -> bytes:
    """The bytes ``PyUnicode_FSConverter`` makes of ``path`` (str, bytes or os.PathLike):
    TypeError for anything else, ValueError for an embedded NUL (the C call would stop at it:
    a rename would name another file)."""
    encoded = os.fsencode(path)  # type: ignore[arg-type]
    if b"\0" in encoded:
        raise ValueError("embedded null byte")
    return encoded


def snapshot(items: object, what: str) -> tuple[Any, ...]:
    """``items`` as a tuple taken once (what the C iterates: a caller's list changed by an
    item's ``__fspath__`` or ``__index__`` changes nothing); TypeError naming ``what``."""
    try:
        return tuple(items)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what}, got {type(items).__name__}") from None


def buffer_view(obj: object, writable: bool) -> memoryview | None:
    """``obj``'s memory as a flat byte view, or None where the C's ``PyObject_GetBuffer``
    (``PyBUF_SIMPLE``, or ``PyBUF_WRITABLE``) would refuse it: not a buffer, not C-contiguous,
    read-only where writable memory is needed."""
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return None
    if not view.c_contiguous or (writable and view.readonly):
        return None
    if view.ndim == 1 and view.format == "B" and view.strides in ((1,), (0,)):
        return view
    if view.ndim == 1 and view.format == "B" and len(view) <= 1:
        # one byte at an odd stride is contiguous to the C: the same byte, flat
        return view if writable else memoryview(view.tobytes())
    try:
        return view.cast("B")
    except (TypeError, BufferError):
        # contiguous by its strides but not castable (one item, odd strides): its bytes as
        # the C sees them
        return None if writable else memoryview(view.tobytes())


def int64(value: object, name: str) -> int:
    """``PyArg_ParseTuple``'s ``L`` (a C long long)."""
    number = _index(value, name)
    if not -(2**63) <= number < 2**63:
        raise OverflowError(f"{name}: Python int too large to convert to C long long")
    return number


def typed_view(obj: object) -> memoryview | None:
    """``obj``'s C-contiguous memory with its format (``PyBUF_FORMAT | PyBUF_C_CONTIGUOUS``)."""
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return None
    return view if view.c_contiguous else None


def address(view: memoryview) -> int:
    """Where ``view``'s memory starts (read-only memory included): the ``buf`` the C sees."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def native_words(view: memoryview, signed: bool) -> bool:
    """Whether ``view`` holds native-endian 8-byte integers (int64 where ``signed``, else
    uint64) from an 8-byte-aligned address: what the C reads as ``int64_t``/``uint64_t``
    (the struct codes its format checks take)."""
    prefixes = "@=<" if sys.byteorder == "little" else "@=>!"
    fmt = view.format[1:] if view.format[:1] in prefixes else view.format
    codes = ("q", "l") if signed else ("Q", "L")
    return view.itemsize == 8 and fmt in codes and address(view) % 8 == 0
