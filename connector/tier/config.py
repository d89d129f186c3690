"""The tier's settings: one frozen dataclass, parsed once from its ``secondary_tiers`` entry.

vLLM's ``SecondaryTierFactory`` pops ``type``, ``module_path`` and ``backpressure`` from the
tier's entry and passes every other key to the tier's constructor. Those keys are either store
keys (the fields of :class:`kvstore.StoreConfig`: ``root``, ``durability``, ``io_threads``, ...)
or tier keys (the other fields of :class:`TierConfig`). Anything else, or a value of the wrong
type, is a :class:`kvstore.ConfigError` at startup naming the accepted keys; ``root`` is
required (a relative default would put the cache wherever the server happened to start).

Defaults differ from the direct connector's in one place: ``durability`` is ``"none"``
(docs/vllm.md, "Choosing durability"): the tier writes behind vLLM's CPU tier, every read is
verified, so a block lost or torn by a power failure is a miss, never a wrong page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore import ConfigError, StoreConfig
from kvstore.config import Durability, strict_int

# The tier's durability default (the store's own default, "full", is the direct connector's).
TIER_DURABILITY: Durability = "none"
LOCALITIES = ("LOCAL", "REMOTE")


@dataclass(frozen=True)
class TierConfig:
    """Everything the kvstore tier reads from its entry in ``secondary_tiers``."""

    # The store: root directory, durability, I/O threads, checksums, ... (kvstore.StoreConfig).
    store: StoreConfig = field(default_factory=lambda: StoreConfig(durability=TIER_DURABILITY))
    # Model name in the namespace identity. "" = vLLM's --model (as the direct connector).
    model_name: str = ""
    # Model revision in the namespace identity. "" = vLLM's --revision.
    model_revision: str = ""
    # Threads running store jobs (each writes a batch of blocks through the store's io_threads).
    store_threads: int = 2
    # Threads running promotion (load) jobs; separate from stores so loads never queue behind
    # a backlog of writes.
    load_threads: int = 2
    # Present-block keys remembered in memory (LRU), answered HIT without a probe.
    index_capacity: int = 1_000_000
    # vLLM's locality label of this tier's storage ("LOCAL" / "REMOTE"), used by request
    # tier filters and by the default backpressure watermarks; "" = unset.
    locality: str = ""
    # With no "backpressure" entry, use vLLM's EMABackpressureDetector with the fs tier's
    # local-storage defaults (watermarks by locality, 3 consecutive failed stores = pressure),
    # so a slow or full store drops stores instead of pinning the CPU tier. False: no detector.
    default_backpressure: bool = True
    # Emit vLLM KV events (BlockStored, medium STORAGE) for blocks this tier stored, as vLLM's
    # fs tier does; effective only with vLLM's KV cache events enabled (--kv-events-config).
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.store, StoreConfig):
            raise ConfigError(f"store: expected a StoreConfig, got {self.store!r}")
        for name in ("model_name", "model_revision", "locality"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name}: expected a string, got {getattr(self, name)!r}")
        for name, low, high in (
            ("store_threads", 1, 64),
            ("load_threads", 1, 64),
            ("index_capacity", 1, 1 << 40),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"{name}: expected an int in [{low}, {high}], got {value!r}")
        for name in ("default_backpressure", "enable_kv_events"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.locality and self.locality.upper() not in LOCALITIES:
            raise ConfigError(
                f"locality: expected one of {list(LOCALITIES)}, got {self.locality!r}"
            )

    @classmethod
    def tier_keys(cls) -> tuple[str, ...]:
        """Keys of this dataclass (``store`` excluded: its fields are given flat)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "store")

    @classmethod
    def accepted_keys(cls) -> list[str]:
        """Every key the tier's ``secondary_tiers`` entry may hold besides ``type``,
        ``module_path`` and ``backpressure`` (vLLM's own), sorted."""
        return sorted({*cls.tier_keys(), *StoreConfig.field_names()})

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TierConfig:
        """Parse the tier's constructor keywords; :class:`ConfigError` on anything unknown."""
        unknown = sorted(str(k) for k in options if k not in cls.accepted_keys())
        if unknown:
            raise ConfigError(
                f"kvstore tier (secondary_tiers entry): unknown key(s) {unknown}; accepted "
                f"keys: {cls.accepted_keys()}"
            )
        if "root" not in options:
            raise ConfigError(
                "kvstore tier (secondary_tiers entry): expected 'root' (the kvstore "
                'directory, e.g. "/mnt/kvcache"), got none'
            )
        store_keys = set(StoreConfig.field_names())
        store = StoreConfig.from_mapping(
            {k: v for k, v in options.items() if k in store_keys},
            base=StoreConfig(durability=TIER_DURABILITY),
        )
        values: dict[str, Any] = {"store": store}
        for name in cls.tier_keys():
            if name not in options:
                continue
            value = options[name]
            if name in ("store_threads", "load_threads", "index_capacity"):
                values[name] = strict_int(name, value)
            elif name in ("default_backpressure", "enable_kv_events"):
                values[name] = _strict_bool(name, value)
            elif isinstance(value, str):
                values[name] = value
            else:
                raise ConfigError(f"{name}: expected a string, got {value!r}")
        return cls(**values)


def _strict_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{name}: expected true or false, got {value!r}")
