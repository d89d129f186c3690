"""The operating keys (admission, backpressure, event locality) are parsed strictly, and the
stats payload uses only what vLLM 0.32 and 0.33 both offer."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from connector.config import ConnectorConfig
from connector.offload import metrics as m
from connector.offload.spec import KVStoreSpec
from kvstore import ConfigError

BASE = {"spec_name": "KVStoreSpec", "spec_module_path": "connector", "root": "/data/kv"}


def test_defaults_store_every_block_within_a_gibibyte_of_pending_bytes() -> None:
    config = ConnectorConfig.from_extra_config(BASE)
    assert config.admit_after == 1
    assert config.max_pending_store_bytes == 1 << 30
    assert config.kv_events_locality == "LOCAL"


def test_operating_keys_are_converted_strictly() -> None:
    config = ConnectorConfig.from_extra_config(
        {
            **BASE,
            "admit_after": "3",
            "max_pending_store_bytes": 1 << 20,
            "kv_events_locality": "remote",
        }
    )
    assert (config.admit_after, config.max_pending_store_bytes) == (3, 1 << 20)
    assert config.kv_events_locality == "REMOTE"


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("admit_after", 0, r"admit_after: expected an int in \[1, 1048576\], got 0"),
        ("admit_after", 1.5, r"admit_after: expected an int, got 1.5|admit_after: .*1.5"),
        ("admit_after", True, r"admit_after: .*True"),
        ("max_pending_store_bytes", 0, r"max_pending_store_bytes: expected an int in \[1, "),
        ("max_pending_store_bytes", "1G", r"max_pending_store_bytes: .*'1G'"),
        ("kv_events_locality", "nearby", r"kv_events_locality: expected one of \['LOCAL', "),
        ("kv_events_locality", 3, r"kv_events_locality: expected a string, got 3"),
    ],
)
def test_bad_operating_values_are_refused_by_name(key: str, value: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ConnectorConfig.from_extra_config({**BASE, key: value})


def test_the_spec_declares_every_series_and_info_label() -> None:
    definitions = KVStoreSpec.build_metric_definitions(BASE)
    assert all(name.startswith("vllm:kvstore_") for name in definitions)
    assert set(definitions) == {
        m.LOOKUP_BLOCKS,
        m.LOOKUP_TOKENS,
        m.LOADED_BLOCKS,
        m.LOADED_BYTES,
        m.LOAD_SECONDS,
        m.STORED_BLOCKS,
        m.STORED_BYTES,
        m.STORE_SECONDS,
        m.FAILED_BLOCKS,
        m.STORE_SKIPPED_BLOCKS,
        m.STORE_DROPPED_BLOCKS,
        m.WRITE_BACKOFF,
        m.PENDING_STORE_BYTES,
        m.PENDING_STORE_BLOCKS,
        m.PENDING_JOBS,
        m.LOOKUP_TIMEOUTS,
        m.UNRESPONSIVE,
        m.UNRESPONSIVE_SECONDS,
        m.WORKER_UNRESPONSIVE,
        m.WORKER_UNRESPONSIVE_SECONDS,
        m.LATE_JOBS,
        m.LATE_BYTES,
    }
    assert KVStoreSpec.config_info_keys(BASE) == m.CONFIG_INFO_KEYS


class Payload032:
    """vLLM 0.32's OffloadingConnectorStats surface: no set_info, no metric_sections."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any, tuple[str, ...]]] = []

    def increase_counter(self, name: str, value: float = 1, labelvalues: Any = ()) -> None:
        self.calls.append(("counter", name, value, labelvalues))

    def set_gauge(self, name: str, value: float, labelvalues: Any = ()) -> None:
        self.calls.append(("gauge", name, value, labelvalues))

    def observe_histogram(self, name: str, value: float, labelvalues: Any = ()) -> None:
        self.calls.append(("histogram", name, value, labelvalues))


def as_stats(payload: Payload032) -> Any:
    return payload


def test_metrics_fill_a_vllm_032_payload() -> None:
    metrics = m.StoreMetrics()
    metrics.count(m.FAILED_BLOCKS, 2, m.LOAD, m.CORRUPT)
    metrics.observe(m.LOAD_SECONDS, 0.5)
    metrics.gauge(m.WRITE_BACKOFF, 1)
    payload = Payload032()
    assert metrics.take(as_stats(payload))
    assert payload.calls == [
        ("counter", m.FAILED_BLOCKS, 2, (m.LOAD, m.CORRUPT)),
        ("histogram", m.LOAD_SECONDS, 0.5, ()),
        ("gauge", m.WRITE_BACKOFF, 1, ()),
    ]
    again = Payload032()
    assert not metrics.take(as_stats(again))  # nothing new; an unchanged gauge is not resent
    assert again.calls == []


def test_histogram_observations_are_bounded_between_drains() -> None:
    metrics = m.StoreMetrics()
    for _ in range(m.MAX_OBSERVATIONS + 10):
        metrics.observe(m.STORE_SECONDS, 0.1)
    payload = Payload032()
    metrics.take(as_stats(payload))
    assert len(payload.calls) == m.MAX_OBSERVATIONS


@pytest.mark.parametrize(
    ("a", "b", "worse"),
    [
        (m.MISSING, m.CORRUPT, m.CORRUPT),
        (m.CORRUPT, m.MISSING, m.CORRUPT),
        (m.IO_ERROR, m.MISSING, m.IO_ERROR),
        (m.CORRUPT, m.IDENTITY_MISMATCH, m.IDENTITY_MISMATCH),
        (m.DISK_FULL, m.IO_ERROR, m.DISK_FULL),
    ],
)
def test_the_more_telling_cause_wins_across_ranks(a: str, b: str, worse: str) -> None:
    causes = {b"k": a}
    m.merge_causes(causes, {b"k": b})
    assert causes == {b"k": worse}
