"""Collectors that keep the first few findings in full and count the rest.

A store of 10^8 blocks can hold 10^8 damaged blocks or hostile entries; a view that listed
every one would need memory (and output) in proportion to the store. The views keep the first
:data:`LISTED` of each kind in full and the total of all, and say when the list is cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

#: Findings of one kind kept in full per group (the rest are counted).
LISTED = 1000


class BoundedList(Generic[T]):
    """The first ``limit`` items added, and how many were added in all."""

    def __init__(self, limit: int = LISTED) -> None:
        if limit < 0:
            raise ValueError(f"limit: expected a count >= 0, got {limit}")
        self.limit = limit
        self.items: list[T] = []
        self.total = 0

    def add(self, item: T) -> None:
        self.total += 1
        if len(self.items) < self.limit:
            self.items.append(item)

    @property
    def left_out(self) -> int:
        """Items counted but not kept."""
        return self.total - len(self.items)

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class BoundedProblems(dict[str, str]):
    """A ``problems`` mapping (path -> why, as :mod:`kvstore.store.paths` records them) that
    keeps the first ``limit`` paths and counts every distinct path recorded after them.

    :mod:`kvstore.store.paths` writes it with ``problems[path] = why`` and ``setdefault``; both
    are bounded here. A path recorded twice counts once while it is kept; past the limit a
    repeat cannot be told from a new path and counts again (the listing records each path once).
    """

    def __init__(self, limit: int = LISTED) -> None:
        super().__init__()
        self.limit = limit
        self.left_out = 0

    def __setitem__(self, key: str, value: str) -> None:
        if key in self or len(self) < self.limit:
            super().__setitem__(key, value)
        else:
            self.left_out += 1

    def setdefault(self, key: str, default: str = "", /) -> str:
        if key not in self:
            self[key] = default
        return self.get(key, default)

    @property
    def total(self) -> int:
        """Paths recorded, kept or not."""
        return len(self) + self.left_out
