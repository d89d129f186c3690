"""KV events for routers: which blocks this engine published to the store, which it found gone.

The manager announces through vLLM's ``OffloadingManager.take_events`` (0.32, 0.33), which
vLLM turns into ``BlockStored`` / ``BlockRemoved`` on its KV-event stream (ZMQ) with
``medium="STORAGE"`` and the configured locality (``kv_events_locality``), so a KV-aware
router tells the store apart from GPU (``GPU``) and CPU (``CPU``) caches. With
``self_describing_kv_events`` vLLM itself adds token ids, parent hash and block size to the
stored events of full-attention groups (it snapshots them when the store job is built); the
removal of a block it holds no payload for is a placeholder with the hash only.

* stored: a block this engine wrote and published (not one another server published first);
* removed: a block the engine believed present whose load found it missing, corrupt or
  foreign (those two are quarantined): no engine can load it any more.

Blocks ``kvstore gc`` evicts are seen by no engine and announced by none (docs/metrics.md).
Nothing is buffered unless vLLM publishes KV events (``enable_kv_cache_events``): vLLM only
drains ``take_events`` then.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

log = logging.getLogger("kvstore.connector")

# Events kept between two drains at most; vLLM drains every step, so this is only reached if
# it stopped doing so, and then the oldest are dropped rather than growing without bound.
MAX_EVENTS = 100_000


class StoreEvents:
    """Events since the last :meth:`take` (the scheduler thread only)."""

    def __init__(self, *, enabled: bool, locality: str) -> None:
        self.enabled = enabled
        self.locality = Locality(locality)
        self._events: list[OffloadingEvent] = []
        self._pending_keys = 0
        self._overflow_logged = False

    def stored(self, keys: Iterable[bytes]) -> None:
        self._add(keys, removed=False)

    def removed(self, keys: Iterable[bytes]) -> None:
        self._add(keys, removed=True)

    def take(self) -> list[OffloadingEvent]:
        out, self._events, self._pending_keys = self._events, [], 0
        return out

    def _add(self, keys: Iterable[bytes], *, removed: bool) -> None:
        if not self.enabled:
            return
        batch = [OffloadKey(bytes(k)) for k in keys]
        if not batch:
            return
        self._events.append(
            OffloadingEvent(
                keys=batch, medium=Medium.STORAGE, removed=removed, locality=self.locality
            )
        )
        self._pending_keys += len(batch)
        while self._pending_keys > MAX_EVENTS and len(self._events) > 1:
            self._pending_keys -= len(self._events.pop(0).keys)
            if not self._overflow_logged:
                self._overflow_logged = True
                log.warning(
                    "kvstore: KV events are not being drained; the oldest are dropped "
                    "(more than %d blocks pending)",
                    MAX_EVENTS,
                )
