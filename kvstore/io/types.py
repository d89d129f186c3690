"""The types of the engine contract, shared by :mod:`kvstore.io.engine` and the engines.

They live apart from any engine so that the contract imports no implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

Segment = tuple[int, memoryview]  # (file offset, host bytes)


@dataclass(frozen=True)
class DirectIOProbe:
    """Outcome of the O_DIRECT probe of a store directory."""

    enabled: bool
    reason: str
