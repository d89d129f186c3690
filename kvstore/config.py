"""The one configuration object of kvstore.

:class:`StoreConfig` is a frozen dataclass: every knob of the store and its I/O engine, one
comment per field. It is built three ways, all strict (an unknown key or a wrong type is a
:class:`~kvstore.errors.ConfigError` naming the accepted keys or the expected type):

* directly, ``StoreConfig(root=...)``;
* from a mapping (the vLLM connector's ``kv_connector_extra_config``),
  :meth:`StoreConfig.from_mapping`;
* from the environment, :meth:`StoreConfig.from_env`: ``KVSTORE_<FIELD>`` variables, read here
  and nowhere else, override the given base config.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from kvstore.errors import ConfigError
from kvstore.native import PROCESS_VARIABLES

Durability = Literal["full", "none"]
DirectIO = Literal["auto", "on", "off"]
ChecksumName = Literal["auto", "xxh3_64", "crc32c", "wsum64"]
IOMode = Literal["auto", "gds", "pinned", "host"]
# Algorithms a GPU computes where the bytes are (kvstore/checksum.py DEVICE_ALGOS by name).
DEVICE_CHECKSUMS = ("wsum64",)

ENV_PREFIX = "KVSTORE_"


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one open store. Immutable; derive variants with :meth:`replace`."""

    # Root directory of the zarr hierarchy; created on first open.
    root: Path = field(default_factory=lambda: Path("kvcache"))
    # Threads doing pwritev/preadv (they release the GIL). Disk throughput on the reference
    # machine is flat from 4 threads; more mostly adds tail latency.
    io_threads: int = 4
    # "full": fdatasync every block file before it is published and fsync its directory after
    # the rename (batched per call), so an acknowledged block survives power loss.
    # "none": atomic visibility only; a crash may lose recent blocks (never tear one).
    durability: Durability = "full"
    # O_DIRECT for block writes. "auto" probes once per store and falls back to buffered I/O
    # with one log line; "on" makes a failing probe an error. Reads are buffered: with several
    # threads they beat O_DIRECT reads on the measured disks.
    direct_io: DirectIO = "auto"
    # O_DIRECT for whole-chunk reads into page-aligned buffers (when the write probe passed;
    # anything unaligned is read buffered). Bypasses the page cache: cold reads of large blocks
    # were up to 2x faster on the reference VM, but repeated ("hot") reads then go to the disk
    # again instead of the page cache. See docs/performance.md.
    direct_reads: bool = False
    # Checksum algorithm written into new block headers (readers accept every known one).
    # "auto": xxh3_64 for the host and pinned engines (fastest on a CPU), wsum64 for the gds
    # engine (computed on the GPU, no host round trip); see resolved_checksum().
    checksum: ChecksumName = "auto"
    # Which engine moves bytes between memory and files (docs/engines.md): "auto" probes once
    # (CUDA, kvikio, cuFile on this filesystem, O_DIRECT) and logs one line naming the choice;
    # "gds" (kvikio/cuFile from device memory), "pinned" (device pages staged through pinned
    # host buffers), "host" (host memory only) are forced, and an unusable one is an error.
    io_mode: IOMode = "auto"
    # Verify every inner chunk read against its header checksum. The header itself (magic,
    # namespace, key, geometry) is always verified.
    verify_reads: bool = True
    # Move blocks that fail verification to <namespace>/quarantine/ instead of deleting them.
    quarantine: bool = True
    # Readers record a block's last use as its file mtime, rewritten when older than this many
    # seconds (so at most one utime per block per interval); eviction orders by it. 0: never.
    access_granularity_s: int = 60
    # KV pages encode prompts: files are created owner-only (0600, directories 0700) unless
    # servers of one group share the store, then group read/write (0660/0770; the servers'
    # umask must not mask group bits, e.g. umask 007).
    group_access: bool = False
    # Compression of inner chunks in namespaces this store creates: "none" (raw chunks at fixed
    # offsets, the default), "lz4" (blosc lz4 + bit shuffle) or "zstd-<1..9>" (blosc zstd at that
    # blosc level + bit shuffle); see kvstore/store/compression.py and docs/format.md. An array
    # keeps the setting it was created with: opening it with another one is an error.
    compression: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", check_root(self.root))  # accept str from callers
        _check_choice("durability", self.durability, Durability)
        _check_choice("direct_io", self.direct_io, DirectIO)
        _check_choice("checksum", self.checksum, ChecksumName)
        _check_choice("io_mode", self.io_mode, IOMode)
        if self.io_mode == "gds" and self.checksum not in ("auto", *DEVICE_CHECKSUMS):
            raise ConfigError(
                f"io_mode='gds' with checksum={self.checksum!r}: the gds engine computes "
                f"checksums on the GPU, expected checksum in {['auto', *DEVICE_CHECKSUMS]}"
            )
        check_compression(self.compression)
        if not isinstance(self.io_threads, int) or isinstance(self.io_threads, bool):
            raise ConfigError(f"io_threads: expected an int, got {self.io_threads!r}")
        if not 1 <= self.io_threads <= 256:
            raise ConfigError(f"io_threads: expected 1..256, got {self.io_threads}")
        if (
            not isinstance(self.access_granularity_s, int)
            or isinstance(self.access_granularity_s, bool)
            or self.access_granularity_s < 0
        ):
            raise ConfigError(
                f"access_granularity_s: expected an int >= 0, got {self.access_granularity_s!r}"
            )
        for name in ("verify_reads", "quarantine", "group_access", "direct_reads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected a bool, got {getattr(self, name)!r}")

    @property
    def file_mode(self) -> int:
        """Permission bits of created files."""
        return 0o660 if self.group_access else 0o600

    @property
    def dir_mode(self) -> int:
        """Permission bits of created directories."""
        return 0o770 if self.group_access else 0o700

    def resolved_checksum(self, engine: str) -> str:
        """The algorithm new blocks get under the engine named ``engine`` ("gds", ...)."""
        if self.checksum != "auto":
            return self.checksum
        return "wsum64" if engine == "gds" else "xxh3_64"

    @property
    def durable(self) -> bool:
        """True when published blocks are fsynced (``durability == "full"``)."""
        return self.durability == "full"

    def replace(self, **changes: Any) -> StoreConfig:
        """A copy with ``changes`` applied, validated like :meth:`from_mapping`."""
        return StoreConfig.from_mapping(changes, base=self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The accepted configuration keys."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any], base: StoreConfig | None = None
    ) -> StoreConfig:
        """Build a config from ``values`` over ``base`` (defaults when None).

        Unknown keys and ill-typed values raise :class:`ConfigError`. Strings are accepted for
        every field (they come from JSON or the environment) and converted strictly.
        """
        base = base or cls()
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown kvstore config key(s) {unknown}; accepted keys: {sorted(known)}"
            )
        converted: dict[str, Any] = {
            name: _convert(name, value, getattr(base, name)) for name, value in values.items()
        }
        return dataclasses.replace(base, **converted)

    @classmethod
    def from_env(
        cls, base: StoreConfig | None = None, environ: Mapping[str, str] | None = None
    ) -> StoreConfig:
        """``base`` overridden by ``KVSTORE_<FIELD>`` environment variables.

        An unknown ``KVSTORE_*`` variable is an error, so a typo cannot silently do nothing;
        the process-wide switches of :mod:`kvstore.native` (``KVSTORE_NATIVE``,
        ``KVSTORE_NATIVE_DIR``) are not the store's and are passed over.
        """
        env = os.environ if environ is None else environ
        values: dict[str, str] = {}
        for key, value in env.items():
            if key.startswith(ENV_PREFIX) and key not in PROCESS_VARIABLES:
                name = key[len(ENV_PREFIX) :].lower()
                if name not in cls.field_names():
                    raise ConfigError(
                        f"unknown environment variable {key}; accepted: "
                        f"{[ENV_PREFIX + n.upper() for n in cls.field_names()]}"
                    )
                values[name] = value
        return cls.from_mapping(values, base=base)


# "none", "lz4", or "zstd-" and a blosc compression level 1..9.
COMPRESSION_NAME = re.compile(r"none|lz4|zstd-[1-9]")


def check_compression(value: object) -> str:
    """``value`` if it names a compression setting, else a :class:`ConfigError`."""
    if not isinstance(value, str) or not COMPRESSION_NAME.fullmatch(value):
        raise ConfigError(
            f"compression: expected 'none', 'lz4' or 'zstd-<level 1..9>' (e.g. 'zstd-1'), "
            f"got {value!r}"
        )
    return value


def check_root(value: object) -> Path:
    """``value`` as the store root, else a :class:`ConfigError` naming what arrived.

    A ``str`` or ``os.PathLike`` naming a path, not empty (``Path("")`` is the current
    directory: an unset variable must not silently put a store there) and without NUL bytes.
    """
    expected = "root: expected a non-empty path (str or os.PathLike)"
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(f"{expected}, got {value!r} ({type(value).__name__})")
    try:
        text = os.fspath(value)
    except TypeError as exc:  # a PathLike whose __fspath__ returns neither str nor bytes
        raise ConfigError(f"{expected}, got {value!r} ({exc})") from None
    if not isinstance(text, str):
        raise ConfigError(f"{expected}, got {value!r} (a bytes path)")
    if not text:
        raise ConfigError(
            f"{expected}, got '' (an empty root would silently be the current directory)"
        )
    if "\0" in text:
        raise ConfigError(f"{expected}, got {text!r} (it contains a NUL byte)")
    return Path(text)


def _check_choice(name: str, value: object, choices_type: Any) -> None:
    choices = get_args(choices_type)
    if value not in choices:
        raise ConfigError(f"{name}: expected one of {list(choices)}, got {value!r}")


def _convert(name: str, value: object, default: object) -> object:
    """Convert ``value`` to the type of the field's current value, strictly."""
    if isinstance(default, bool):  # before int: a bool is an int
        return strict_bool(name, value)
    if isinstance(default, int):
        return strict_int(name, value)
    if isinstance(default, Path):  # the root: checked before Path("") turns into "."
        return check_root(value)
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    raise ConfigError(f"{name}: cannot convert {value!r}")  # pragma: no cover - new field type


def strict_bool(name: str, value: object) -> bool:
    """``value`` as a bool: a bool or one of 1/true/yes/on, 0/false/no/off (any case); else
    :class:`ConfigError` naming ``name``. Shared like :func:`strict_int`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in {"1", "true", "yes", "on"}:
        return True
    if isinstance(value, str) and value.lower() in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}: expected a bool, got {value!r}")


def strict_int(name: str, value: object) -> int:
    """``value`` as an int: an int (not a bool) or a base-10 string; else :class:`ConfigError`
    naming ``name``. Shared by every config parser (env, mappings, the vLLM connector)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value, 10)
        except ValueError:
            pass
    raise ConfigError(f"{name}: expected an int, got {value!r}")
