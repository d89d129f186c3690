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

from connector.config import check_fields, check_number, convert_like, parse_store_keys
from kvstore import ConfigError, StoreConfig
from kvstore.config import Durability

# The tier's durability default (the store's own default, "full", is the direct connector's).
TIER_DURABILITY: Durability = "none"
LOCALITIES = ("LOCAL", "REMOTE")
# Settings in seconds that must be > 0 (a deadline of 0 would fail every call).
DEADLINE_KEYS = ("lookup_deadline_s", "load_deadline_s", "store_deadline_s", "unresponsive_retry_s")


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
    # Deadlines (a slow or hung file system never stalls the engine; the direct connector's
    # names and meanings). Seconds an existence probe may take before its keys are answered
    # miss (vLLM recomputes them) and the store counts as unresponsive.
    lookup_deadline_s: float = 2.0
    # Seconds a promotion job may take from its submission, plus its bytes at
    # deadline_min_mb_per_s: past it the job is reported failed (vLLM recomputes) and a late
    # read never writes into the CPU tier's chunks vLLM reuses.
    load_deadline_s: float = 5.0
    # The same for a store (cascade) job: past it the job is reported failed (vLLM's
    # backpressure counts it) and the write goes on from the tier's own copy of the rows.
    store_deadline_s: float = 30.0
    # Floor rate (MB/s, 10^6 bytes) of the size allowance: a job moving N bytes may take
    # N / rate seconds more, so a large promotion on slow but working storage is not cut
    # short. 0 = none.
    deadline_min_mb_per_s: float = 100.0
    # While the store is unresponsive (a call past its deadline, none returned since), lookups
    # are misses and jobs fail at once, except one trial job at a time, at most one per this
    # many seconds.
    unresponsive_retry_s: float = 5.0

    def __post_init__(self) -> None:
        check_fields(
            self,
            strings=("model_name", "model_revision", "locality"),
            ints=(
                ("store_threads", 1, 64),
                ("load_threads", 1, 64),
                ("index_capacity", 1, 1 << 40),
            ),
            bools=("default_backpressure", "enable_kv_events"),
        )
        for name in DEADLINE_KEYS:
            check_number(name, getattr(self, name), positive=True)
        check_number("deadline_min_mb_per_s", self.deadline_min_mb_per_s, "MB/s", positive=False)
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
        store = parse_store_keys(
            "kvstore tier (secondary_tiers entry)",
            options,
            cls.accepted_keys(),
            base=StoreConfig(durability=TIER_DURABILITY),
        )
        defaults = cls(store=store)
        values: dict[str, Any] = {
            name: convert_like(name, options[name], getattr(defaults, name))
            for name in cls.tier_keys()
            if name in options
        }
        return dataclasses.replace(defaults, **values)
