"""The connector's settings: one frozen dataclass, parsed once from ``kv_connector_extra_config``.

``kv_connector_extra_config`` is one flat JSON object shared by three readers, so every key
belongs to exactly one of them:

* vLLM's own keys (:data:`VLLM_KEYS`): read by vLLM's ``OffloadingConnector`` and spec
  factory; accepted here and otherwise ignored (``blocks_per_chunk`` / ``block_size`` are then
  checked against what the store supports, see :mod:`connector.identity`);
* store keys: the fields of :class:`kvstore.StoreConfig` (``root``, ``io_threads``,
  ``durability``, ...), parsed by :meth:`kvstore.StoreConfig.from_mapping`;
* connector keys: the other fields of :class:`ConnectorConfig`.

A key none of them knows, or a value of the wrong type, is a :class:`kvstore.ConfigError` at
startup naming the accepted keys. ``root`` is required: a relative default would put the cache
in whatever directory the server happened to start in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore import ConfigError, StoreConfig
from kvstore.config import strict_bool, strict_int

# Keys of kv_connector_extra_config that vLLM 0.33 itself reads (offloading/config.py,
# kv_offload/base.py, offloading/scheduler.py, kv_offload/factory.py); 0.32 reads all of them
# but sync_load_budget_bytes.
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "sync_load_budget_bytes",
        "offload_prompt_only",
        "self_describing_kv_events",
    }
)

# Values of kv_events_locality (vLLM's kv_offload.base.Locality, by value).
LOCALITIES = frozenset({"LOCAL", "REMOTE"})


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the kvstore connector reads from ``kv_connector_extra_config``."""

    # The store: root directory, I/O threads, durability, checksums, ... (kvstore.StoreConfig).
    store: StoreConfig = field(default_factory=StoreConfig)
    # Model name in the namespace identity. "" = vLLM's --model. Set it when the same
    # checkpoint is served from different local paths and should share one cache.
    model_name: str = ""
    # Model revision in the namespace identity. "" = vLLM's --revision ("" when unset).
    model_revision: str = ""
    # Scheduler: keys checked per batched existence probe of the shared store.
    probe_batch: int = 256
    # Scheduler: background threads running existence probes and block publishes.
    probe_threads: int = 2
    # Scheduler: seconds a "not in the store" answer is trusted before it is probed again
    # (another server sharing the directory may have written the block since).
    miss_ttl_s: float = 5.0
    # Scheduler: seconds an existence probe may take before its keys are answered "miss"
    # (vLLM recomputes them) and the store counts as unresponsive: until a probe answers
    # again, new lookups are misses at once and no new probe is started (docs/operating.md).
    lookup_deadline_s: float = 2.0
    # Scheduler: keys remembered as present (LRU); older ones are simply probed again.
    index_capacity: int = 1_000_000
    # Worker: threads running store and load jobs (the file I/O itself uses store io_threads).
    worker_threads: int = 2
    # Worker: seconds a load job may take, plus its bytes at deadline_min_mb_per_s. Past it
    # its blocks are reported failed (vLLM recomputes them), the late read never writes into
    # the KV cache, and the store counts as unresponsive (docs/operating.md).
    load_deadline_s: float = 5.0
    # Worker and scheduler: the same for a store job's file writes (the GPU pages are free
    # once the snapshot is taken, so only host staging waits) and for the scheduler's publish
    # or abort of its blocks: past it the blocks are not published (a late publish's result
    # is applied when it returns) and the store counts as unresponsive.
    store_deadline_s: float = 30.0
    # Worker: the slowest rate (MB/s, 10^6 bytes) a working store is allowed: a job moving
    # N bytes gets N / rate seconds on top of its deadline. 0: no allowance for size.
    deadline_min_mb_per_s: float = 100.0
    # Worker: while the store is unresponsive, loads fail and stores are dropped at once but
    # one job at a time, at most one per this many seconds, goes to it as a trial.
    unresponsive_retry_s: float = 5.0
    # Scheduler: after a failed store (e.g. a full disk), offer no new stores for this many
    # seconds; lookups and loads go on.
    write_backoff_s: float = 30.0
    # Scheduler: store a block only once it was seen this many times (by this many requests,
    # each counted once: asked for at lookup or offered for storing). 1 stores every block;
    # 2+ keeps one-off prefixes off the disk (SSD wear). Counted as skipped "not_admitted".
    admit_after: int = 1
    # Scheduler: bytes of whole blocks offered to the store and not yet published (workers
    # writing, or publish queued). New stores beyond it are dropped, never waited for, and
    # counted as dropped "backpressure". Bounds the staging memory a slow store can hold.
    max_pending_store_bytes: int = 1 << 30
    # KV events: locality of the store relative to this engine, for routers: "LOCAL" (a disk
    # of this node) or "REMOTE" (a filesystem shared by several nodes). Medium is STORAGE.
    kv_events_locality: str = "LOCAL"

    def __post_init__(self) -> None:
        check_fields(
            self,
            strings=("model_name", "model_revision"),
            ints=(
                ("probe_batch", 1, 1 << 20),
                ("probe_threads", 1, 64),
                ("index_capacity", 1, 1 << 40),
                ("worker_threads", 1, 64),
                ("admit_after", 1, 1 << 20),
                ("max_pending_store_bytes", 1, 1 << 50),
            ),
        )
        for name in ("miss_ttl_s", "write_backoff_s"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < math.inf:
                raise ConfigError(f"{name}: expected a number of seconds >= 0, got {value!r}")
        positive = (
            "lookup_deadline_s",
            "load_deadline_s",
            "store_deadline_s",
            "unresponsive_retry_s",
        )
        for name in positive:
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < math.inf:
                raise ConfigError(f"{name}: expected a number of seconds > 0, got {value!r}")
        rate = self.deadline_min_mb_per_s
        if not _is_number(rate) or not 0 <= rate < math.inf:
            raise ConfigError(
                f"deadline_min_mb_per_s: expected a number of MB/s >= 0 (0: no allowance for "
                f"size), got {rate!r}"
            )
        if isinstance(self.kv_events_locality, str):  # "local" is as clear as "LOCAL"
            object.__setattr__(self, "kv_events_locality", self.kv_events_locality.upper())
        if self.kv_events_locality not in LOCALITIES:
            raise ConfigError(
                f"kv_events_locality: expected one of {sorted(LOCALITIES)}, got "
                f"{self.kv_events_locality!r}"
            )

    @classmethod
    def connector_keys(cls) -> tuple[str, ...]:
        """Keys of this dataclass (``store`` excluded: its fields are given flat)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "store")

    @classmethod
    def accepted_keys(cls) -> list[str]:
        """Every key ``kv_connector_extra_config`` may hold, sorted."""
        return sorted({*cls.connector_keys(), *StoreConfig.field_names(), *VLLM_KEYS})

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; :class:`ConfigError` on anything unknown."""
        if not isinstance(extra, Mapping):
            raise ConfigError(
                f"kv_connector_extra_config: expected a JSON object, got {type(extra).__name__}"
            )
        store = parse_store_keys("kv_connector_extra_config", extra, cls.accepted_keys())
        defaults = cls(store=store)
        values: dict[str, Any] = {
            name: convert_like(name, extra[name], getattr(defaults, name))
            for name in cls.connector_keys()
            if name in extra
        }
        return dataclasses.replace(defaults, **values)


def parse_store_keys(
    where: str, options: Mapping[str, Any], accepted: list[str], base: StoreConfig | None = None
) -> StoreConfig:
    """The store's keys among ``options`` (a flat entry of ``where``: vLLM's extra config, a
    tier entry) as a :class:`StoreConfig` over ``base``; :class:`ConfigError` for a key not in
    ``accepted`` or a missing ``root``."""
    unknown = sorted(str(k) for k in options if k not in accepted)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; accepted keys: {accepted}")
    if "root" not in options:
        raise ConfigError(
            f"{where}: expected 'root' (the kvstore directory, e.g. \"/mnt/kvcache\"), got none"
        )
    store_keys = set(StoreConfig.field_names())
    return StoreConfig.from_mapping({k: v for k, v in options.items() if k in store_keys}, base)


def check_fields(
    config: object,
    strings: Iterable[str],
    ints: Iterable[tuple[str, int, int]],
    bools: Iterable[str] = (),
) -> None:
    """:class:`ConfigError` naming the first field of ``config`` that is not a string
    (``strings``), not an int in its range (``ints``: name, low, high) or not a bool
    (``bools``); ``config.store`` must be a :class:`StoreConfig`."""
    store = getattr(config, "store", None)
    if not isinstance(store, StoreConfig):
        raise ConfigError(f"store: expected a StoreConfig, got {store!r}")
    for name in strings:
        if not isinstance(getattr(config, name), str):
            raise ConfigError(f"{name}: expected a string, got {getattr(config, name)!r}")
    for name, low, high in ints:
        value = getattr(config, name)
        if not _is_int(value) or not low <= value <= high:
            raise ConfigError(f"{name}: expected an int in [{low}, {high}], got {value!r}")
    for name in bools:
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"{name}: expected a bool, got {getattr(config, name)!r}")


def convert_like(name: str, value: object, default: object) -> object:
    """``value`` as the type of ``default``; strings from JSON are converted strictly."""
    if isinstance(default, bool):  # before int: a bool is an int
        return strict_bool(name, value)
    if isinstance(default, int):
        return strict_int(name, value)
    if isinstance(default, float):
        if _is_number(value):
            return float(value)  # type: ignore[arg-type]
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    raise ConfigError(f"{name}: cannot convert {value!r}")  # pragma: no cover


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_number(name: str, value: object, unit: str = "seconds", *, positive: bool) -> None:
    """:class:`ConfigError` unless ``value`` is a finite number, > 0 (``positive``) or >= 0;
    the message names the key, the unit and the bound, and what arrived."""
    valid = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > 0 if positive else value >= 0)
    )
    if not valid:
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name}: expected a number of {unit} {bound}, got {value!r}")
