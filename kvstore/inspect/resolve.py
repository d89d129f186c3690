"""Turn what a person types into store objects: namespace names, block hashes, selections.

* A namespace is named by its directory name, a unique prefix of it, or a unique prefix of
  its 12-digit digest suffix.
* A block is named by its full hash in hex, or a unique hex prefix. The first 17 hex digits
  of a hash are encoded in the shard file's path, so prefixes up to that length are resolved
  from directory listings alone (a block whose header is damaged is still found); longer
  prefixes are confirmed against the headers. A prefix of two or more digits lists one
  fan-out directory only; a full hash lists none (one ``lstat`` of its path).
* ``--heads`` / ``--layers`` selections are ``N`` or ``A:B`` (Python slice bounds, either
  side may be empty).
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.errors import InspectError
from kvstore.inspect.blockfile import quick_header
from kvstore.keys import MAX_HASH_BYTES, MIN_HASH_BYTES
from kvstore.store.paths import PATH_HEX_DIGITS, BlockFile
from kvstore.store.view import GroupView, NamespaceView, StoreView

_HEX = set(string.hexdigits.lower())


def find_namespace(store: StoreView, text: str) -> NamespaceView:
    """The namespace ``text`` names (exact, unique name prefix, or unique digest prefix)."""
    names = store.namespace_names()
    if text in names:
        return store.namespace(text)
    matches = [n for n in names if n.startswith(text)]
    if not matches:
        matches = [n for n in names if n.rsplit("-", 1)[-1].startswith(text.lower())]
    if len(matches) == 1:
        return store.namespace(matches[0])
    if not matches:
        raise InspectError(
            f"namespace: expected one of {names or '(none: the store is empty)'}, got {text!r}"
        )
    raise InspectError(f"namespace {text!r} is ambiguous: matches {matches}")


@dataclass(frozen=True)
class BlockRef:
    """A resolved block: its file and, when known, its full hash."""

    file: BlockFile
    block_hash: bytes | None  # None when only a prefix was given and the header is unusable

    @property
    def label(self) -> str:
        return self.block_hash.hex() if self.block_hash is not None else self.file.path_hex + "..."


def parse_hex(text: str) -> str:
    """``text`` as lower-case hex digits (a ``0x`` prefix is accepted), else InspectError."""
    value = text.lower().removeprefix("0x")
    if not value or not set(value) <= _HEX or len(value) > 2 * MAX_HASH_BYTES:
        raise InspectError(
            f"block hash: expected 1..{2 * MAX_HASH_BYTES} hex digits (a full hash or a unique "
            f"prefix), got {text!r}"
        )
    return value


def find_block(group: GroupView, text: str) -> BlockRef:
    """The one block of ``group`` whose hash is, or starts with, hex ``text``.

    A file whose header is unusable (damaged, mis-keyed) matches on the hash bits its path
    carries, so a damaged block can still be named and inspected.
    """
    value = parse_hex(text)
    full = len(value) % 2 == 0 and len(value) >= 2 * MIN_HASH_BYTES
    if full:
        # A full hash names one path: one lstat, whatever the size of its fan-out directory.
        found = group.file_of(bytes.fromhex(value))
        candidates: Iterable[BlockFile] = [] if found is None else [found]
    else:
        digits = "0123456789abcdef"
        fanouts = [int(value[:2], 16)] if len(value) >= 2 else [int(value + d, 16) for d in digits]
        # Streamed: only the matching files are kept (a fan-out directory holds 390k
        # entries at 10^8 blocks, a one-digit prefix spans 16 of them).
        candidates = group.iter_files(fanouts)
    refs: list[BlockRef] = []
    for f in candidates:
        if not f.path_hex.startswith(value[:PATH_HEX_DIGITS]):
            continue
        header, _ = quick_header(group, f.path)
        if header is None:
            refs.append(BlockRef(f, bytes.fromhex(value) if full else None))
        elif header.block_hash.hex().startswith(value):
            refs.append(BlockRef(f, header.block_hash))
    if len(refs) == 1:
        return refs[0]
    if not refs:
        raise InspectError(
            f"block: expected a block of {group.label} with hash {value}..., found none"
        )
    shown = ", ".join(r.label[:20] for r in refs[:5])
    raise InspectError(
        f"block hash prefix {value!r} is ambiguous in {group.label}: {len(refs)} blocks match "
        f"({shown}{', ...' if len(refs) > 5 else ''}); give more digits"
    )


def parse_range(text: str | None, size: int, what: str) -> range:
    """``N`` or ``A:B`` (slice bounds; negative counts from the end) within ``[0, size)``.

    None, ``""`` or ``":"`` select everything. Bounds outside ``[0, size]`` are an error, not
    silently clipped.
    """
    if text is None or text.strip() in ("", ":"):
        return range(size)
    try:
        if ":" in text:
            start_text, stop_text = text.split(":", 1)
            start = int(start_text) if start_text.strip() else 0
            stop = int(stop_text) if stop_text.strip() else size
        else:
            start = int(text)
            stop = start + 1 if start != -1 else size
    except ValueError:
        raise InspectError(f"{what}: expected N or A:B, got {text!r}") from None
    start = start + size if start < 0 else start
    stop = stop + size if stop < 0 else stop
    if not 0 <= start < stop <= size:
        raise InspectError(f"{what}: expected a non-empty range within 0..{size - 1}, got {text!r}")
    return range(start, stop)
