"""An :class:`Engine` whose kvstore metrics and KV events are recorded, for the metrics tests.

vLLM's scheduler drains the connector's stats (``get_kv_connector_stats``) and KV events
(``take_events``) every step; :class:`Metered` wraps both on the engine's scheduler and keeps
what went through, merged the way vLLM's frontend merges payloads
(``OffloadingConnectorStats.aggregate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from vllm.config import KVEventsConfig, VllmConfig
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

from . import harness
from .harness import Engine, EngineOptions


@dataclass
class Metered:
    engine: Engine
    stats: OffloadingConnectorStats = field(default_factory=OffloadingConnectorStats)
    batches: list[KVEventBatch] = field(default_factory=list)

    def __post_init__(self) -> None:
        conn: Any = self.engine.scheduler.connector
        original_stats = conn.get_kv_connector_stats

        def grab() -> Any:
            got = original_stats()
            if got is not None and not got.is_empty():
                self.stats.aggregate(got)
            return got

        conn.get_kv_connector_stats = grab
        publisher: Any = self.engine.scheduler.kv_event_publisher
        original_publish = publisher.publish

        def publish(batch: KVEventBatch) -> None:
            self.batches.append(batch)
            original_publish(batch)

        publisher.publish = publish

    def value(self, name: str, *labels: str) -> Any:
        """A counter's sum or gauge's last value (0 when never reported), or a histogram's
        observations."""
        types, values = self.stats.data["types"], self.stats.data["data"]
        got = values.get(name, {}).get(tuple(labels))
        if got is None:
            return [] if types.get(name) == "histogram" else 0
        return got

    def labelled(self, name: str) -> dict[tuple[str, ...], Any]:
        return dict(self.stats.data["data"].get(name, {}))

    def events(self) -> list[Any]:
        return [e for batch in self.batches for e in batch.events]


def engine(monkeypatch: pytest.MonkeyPatch, *, kv_events: bool = False, **options: Any) -> Metered:
    """A metered engine; ``kv_events``: vLLM publishes KV events (to a null publisher)."""
    base = harness.vllm_config

    def with_events(opts: EngineOptions, rank: int) -> VllmConfig:
        config = base(opts, rank)
        if kv_events:
            config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        return config

    with monkeypatch.context() as patch:
        patch.setattr(harness, "vllm_config", with_events)
        return Metered(Engine(EngineOptions(**options)))
