"""Admission: store a block only once it was seen ``admit_after`` times (SSD wear filter).

A block is "seen" once per request that asks for it (``lookup``) or offers it for storing
(``prepare_store``): vLLM offers each computed block once per request, and asks for a prefix
again every step while it probes, so a per-request set keeps one request from counting twice.
With ``admit_after=1`` (the default) every block is admitted and nothing is tracked.

Counts live in memory, in an LRU of ``capacity`` keys: a prefix not seen again before it
falls out starts over, and a restart forgets every count (a block then needs ``admit_after``
new sightings). Admitted keys are forgotten: the store (or the manager's index) remembers them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import ReqContext


@dataclass
class _Seen:
    """Per request: keys it already counted."""

    keys: set[bytes] = field(default_factory=set)


class Admission:
    """Sighting counts of not-yet-admitted keys (the scheduler thread only)."""

    def __init__(self, admit_after: int, capacity: int) -> None:
        if admit_after < 1 or capacity < 1:
            raise ValueError(
                f"admit_after and capacity must be >= 1, got {admit_after}, {capacity}"
            )
        self.admit_after = admit_after
        self.capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    @property
    def tracked(self) -> int:
        """Keys with a count (tests, metrics)."""
        return len(self._counts)

    def see(self, key: bytes, req_context: ReqContext) -> int:
        """Count a sighting of ``key`` by this request (once per request); the count."""
        if self.admit_after == 1:
            return 1
        seen = req_context.get_state(_Seen)
        if seen is None:
            seen = _Seen()
            req_context.set_state(seen)
        count = self._counts.get(key, 0)
        if key not in seen.keys:
            seen.keys.add(key)
            count += 1
            self._counts[key] = count
            self._counts.move_to_end(key)
            while len(self._counts) > self.capacity:
                self._counts.popitem(last=False)
        return count

    def admit(self, key: bytes, req_context: ReqContext) -> bool:
        """Count the offer of ``key`` for storing; whether it may be stored now."""
        if self.see(key, req_context) < self.admit_after:
            return False
        self._counts.pop(key, None)
        return True
