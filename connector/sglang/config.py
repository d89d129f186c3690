"""The SGLang backend's settings, parsed once from ``--hicache-storage-backend-extra-config``.

The JSON object is shared by SGLang and kvstore, so every key belongs to exactly one reader:

* SGLang's keys (:data:`SGLANG_KEYS`: how the ``dynamic`` factory finds the class, whether the
  controller uses the zero-copy interface): accepted, otherwise ignored;
* store keys: the fields of :class:`kvstore.StoreConfig` (``root`` required, ``durability``,
  ``io_threads``, ...);
* backend keys: the other fields of :class:`SGLangBackendConfig`.

An unknown key or a value of the wrong type is a :class:`kvstore.ConfigError` naming the
accepted keys, raised when SGLang constructs the backend (at startup, not at the first page).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from connector.config import check_fields, check_number, convert_like, parse_store_keys
from kvstore import ConfigError, StoreConfig

# Keys SGLang 0.5.23 itself reads from the extra config (storage/backend_factory.py,
# managers/cache_controller.py; tp_lcm_size is popped before the backend sees the rest).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})

# The deadline settings (the vLLM connector's names): seconds > 0, then the size floor and the
# retry interval (connector/sglang/deadlines.py).
DEADLINE_KEYS = ("lookup_deadline_s", "load_deadline_s", "store_deadline_s")


@dataclass(frozen=True)
class SGLangBackendConfig:
    """Everything the kvstore HiCache backend reads from its extra config."""

    # The store: root directory, durability, I/O threads, checksums, ... (kvstore.StoreConfig).
    store: StoreConfig = field(default_factory=StoreConfig)
    # Model name in the namespace identity. "" = the name SGLang keys storage on (its
    # --served-model-name or model path, with the host pool's format tag).
    model_name: str = ""
    # The model's KV heads, when the pool cannot tell them: needed only when there are fewer
    # KV heads than TP ranks (each rank then holds one replicated head). 0 = pool heads x TP.
    num_kv_heads: int = 0
    # The model's layers: needed with pipeline parallelism (a stage's pool holds only its
    # own). 0 = the pool's layers.
    num_layers: int = 0
    # Seconds an exists / batch_exists(_v2) call may wait for the store before the keys it has
    # not answered are misses (SGLang then recomputes them).
    lookup_deadline_s: float = 2.0
    # Seconds a get / batch_get(_v1/_v2) call may wait (plus the size allowance below) before
    # the pages it has not read are misses: SGLang counts them and recomputes.
    load_deadline_s: float = 5.0
    # Seconds a set / batch_set(_v1/_v2) call may wait (plus the size allowance) before the
    # pages it has not stored are reported not stored (dropped and counted).
    store_deadline_s: float = 30.0
    # Floor rate (MB/s, 10^6 bytes) of the size allowance: a call moving N bytes may take
    # N / rate seconds more, so a large batch on slow but working storage is not cut short.
    # 0 = no allowance.
    deadline_min_mb_per_s: float = 100.0
    # While the store is unresponsive (a call passed its deadline), calls fail at once without
    # touching it, except one trial call at a time, at most one per this many seconds.
    unresponsive_retry_s: float = 5.0

    def __post_init__(self) -> None:
        check_fields(
            self,
            strings=("model_name",),
            ints=(("num_kv_heads", 0, 1 << 16), ("num_layers", 0, 1 << 16)),
        )
        for name in (*DEADLINE_KEYS, "unresponsive_retry_s"):
            check_number(name, getattr(self, name), positive=True)
        check_number("deadline_min_mb_per_s", self.deadline_min_mb_per_s, "MB/s", positive=False)

    @classmethod
    def backend_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "store")

    @classmethod
    def accepted_keys(cls) -> list[str]:
        """Every key the extra config may hold, sorted."""
        return sorted({*cls.backend_keys(), *StoreConfig.field_names(), *SGLANG_KEYS})

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> SGLangBackendConfig:
        """Parse the extra config; :class:`ConfigError` on anything unknown or mistyped."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(
                "--hicache-storage-backend-extra-config: expected a JSON object, got "
                f"{type(extra).__name__}"
            )
        where = "--hicache-storage-backend-extra-config"
        store = parse_store_keys(where, extra, cls.accepted_keys())
        defaults = cls(store=store)
        values: dict[str, Any] = {
            name: convert_like(name, extra[name], getattr(defaults, name))
            for name in cls.backend_keys()
            if name in extra
        }
        return dataclasses.replace(defaults, **values)
