"""The connector's configuration is parsed once, strictly; what cannot work refuses to start."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

import connector
from connector.config import VLLM_KEYS, ConnectorConfig
from connector.identity import VLLM_DEFAULT_SEED, hash_seed_id
from kvstore import ConfigError, StoreConfig

from .harness import Engine, EngineOptions

BASE = {"spec_name": "KVStoreSpec", "spec_module_path": "connector", "root": "/data/kv"}


def test_defaults_and_vllm_keys() -> None:
    config = ConnectorConfig.from_extra_config({**BASE, "blocks_per_chunk": 1})
    assert config.store == StoreConfig(root=Path("/data/kv"))
    assert config == ConnectorConfig(store=StoreConfig(root=Path("/data/kv")))
    assert config.store.compression == "none"
    assert config.probe_batch == 256
    assert config.miss_ttl_s == 5.0
    assert set(ConnectorConfig.accepted_keys()) >= VLLM_KEYS | {"root", "durability"}


def test_store_and_connector_keys_are_typed_strictly() -> None:
    config = ConnectorConfig.from_extra_config(
        {**BASE, "durability": "none", "io_threads": "8", "probe_batch": "64", "miss_ttl_s": 1}
    )
    assert (config.store.durability, config.store.io_threads) == ("none", 8)
    assert (config.probe_batch, config.miss_ttl_s) == (64, 1.0)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"probe_batch": "many"}, "probe_batch: expected an int"),
        ({"probe_threads": 0}, "probe_threads: expected an int in"),
        ({"miss_ttl_s": -1}, "miss_ttl_s: expected a number of seconds"),
        ({"durability": "sometimes"}, "durability: expected one of"),
        ({"model_name": 3}, "model_name: expected a string"),
        ({"compression": "zstd"}, "compression: expected 'none', 'lz4' or 'zstd-<level"),
    ]
    for values, message in bad:
        with pytest.raises(ConfigError, match=message):
            ConnectorConfig.from_extra_config({**BASE, **values})


def test_unknown_key_names_the_accepted_ones() -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorConfig.from_extra_config({**BASE, "rooot": "/x"})
    assert "'rooot'" in str(info.value)
    assert "'probe_batch'" in str(info.value)
    assert "'io_threads'" in str(info.value)


def test_root_is_required() -> None:
    with pytest.raises(ConfigError, match="expected 'root'"):
        ConnectorConfig.from_extra_config({"spec_name": "KVStoreSpec"})


def test_hash_seed_ids() -> None:
    assert hash_seed_id("sha256", {}) == VLLM_DEFAULT_SEED
    seeded = hash_seed_id("xxhash", {"PYTHONHASHSEED": "42"})
    assert seeded.startswith("PYTHONHASHSEED:")
    assert "42" not in seeded.removeprefix("PYTHONHASHSEED:")  # only a digest is stored
    assert hash_seed_id("sha256", {"PYTHONHASHSEED": "42"}) == seeded
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        hash_seed_id("xxhash_cbor", {})


def test_kv_transfer_config_is_the_documented_json(tmp_path: Path) -> None:
    config = connector.kv_transfer_config(str(tmp_path), durability="none")
    assert json.loads(json.dumps(config)) == {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "KVStoreSpec",
            "spec_module_path": "connector",
            "root": str(tmp_path),
            "durability": "none",
        },
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"extra": {"blocks_per_chunk": 2}}, "blocks_per_chunk=2"),
        ({"extra": {"probe_batchs": 2}}, "unknown key"),
        ({"policy": "fail"}, "kv_load_failure_policy='fail'"),
        (
            {"connector_name": "OffloadingConnector", "module_path": None},
            "must be loaded by connector.KVStoreConnector",
        ),
        ({"hash_algo": "xxhash"}, "PYTHONHASHSEED"),
        (
            {"hybrid": True, "model": "tiny_hybrid", "extra": {"sync_load_budget_bytes": 1}},
            "sync_load_budget_bytes",
        ),
    ],
    ids=["blocks-per-chunk", "unknown-key", "fail-policy", "plain-connector", "xxhash", "sync"],
)
def test_engine_refuses_at_startup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], message: str
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigError, match=message):
        Engine(EngineOptions(root=tmp_path, **options))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing written


def test_docs_list_every_key_with_its_default() -> None:
    """docs/vllm.md's key tables name exactly the accepted keys, with the real defaults."""
    text = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    section = text.split("## Configuration keys", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for key in re.findall(r"`([a-z_0-9]+)`", cells[0]):
            documented[key] = cells[1]
    assert sorted(documented) == ConnectorConfig.accepted_keys()
    defaults = ConnectorConfig(store=StoreConfig(root=Path("/x")))
    store_defaults = dataclasses.asdict(defaults.store)
    for key, cell in documented.items():
        if key in VLLM_KEYS or cell.startswith("(required)"):
            continue
        expected = store_defaults[key] if key in store_defaults else getattr(defaults, key)
        shown = re.match(r"`([^`]*)`", cell)
        assert shown is not None, f"{key}: no default in {cell!r}"
        assert json.loads(shown.group(1)) == expected, f"{key}: docs say {cell}"
