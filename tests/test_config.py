"""StoreConfig: strict construction from keyword arguments, mappings and the environment."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError

FIELDS = [
    "access_granularity_s",
    "checksum",
    "compression",
    "direct_io",
    "direct_reads",
    "durability",
    "group_access",
    "io_mode",
    "io_threads",
    "quarantine",
    "root",
    "verify_reads",
]


def test_defaults() -> None:
    config = StoreConfig()
    assert config.root == Path("kvcache")
    assert config.io_threads == 4
    assert config.durability == "full"
    assert config.durable is True
    assert config.direct_io == "auto"
    assert config.checksum == "auto"
    assert config.io_mode == "auto"
    assert config.verify_reads is True
    assert config.quarantine is True
    assert config.access_granularity_s == 60
    assert config.group_access is False
    assert config.compression == "none"
    assert (config.file_mode, config.dir_mode) == (0o600, 0o700)
    assert (StoreConfig(group_access=True).file_mode, StoreConfig(group_access=True).dir_mode) == (
        0o660,
        0o770,
    )
    assert sorted(StoreConfig.field_names()) == FIELDS


def test_root_string_becomes_path() -> None:
    assert StoreConfig(root="somewhere").root == Path("somewhere")  # type: ignore[arg-type]


def test_from_mapping_converts_strings_strictly() -> None:
    config = StoreConfig.from_mapping(
        {
            "root": "/data/kv",
            "io_threads": "8",
            "durability": "none",
            "direct_io": "off",
            "checksum": "crc32c",
            "verify_reads": "false",
            "quarantine": "0",
            "access_granularity_s": "0",
        }
    )
    assert config == StoreConfig(
        root=Path("/data/kv"),
        io_threads=8,
        durability="none",
        direct_io="off",
        checksum="crc32c",
        verify_reads=False,
        quarantine=False,
        access_granularity_s=0,
    )
    assert config.durable is False


@pytest.mark.parametrize("text", ["1", "true", "YES", "on"])
def test_bool_truthy_strings(text: str) -> None:
    base = StoreConfig(verify_reads=False)
    assert StoreConfig.from_mapping({"verify_reads": text}, base=base).verify_reads is True


def test_from_mapping_keeps_base_values() -> None:
    base = StoreConfig(root=Path("/a"), io_threads=7, durability="none")
    config = StoreConfig.from_mapping({"checksum": "crc32c"}, base=base)
    assert (config.root, config.io_threads, config.durability, config.checksum) == (
        Path("/a"),
        7,
        "none",
        "crc32c",
    )


def test_unknown_key_names_the_accepted_keys() -> None:
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_mapping({"io_thread": 4, "root": "/x"})
    message = str(info.value)
    assert "['io_thread']" in message
    assert str(FIELDS) in message  # "accepted keys: [...]" in sorted order


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("io_threads", "four", "io_threads: expected an int, got 'four'"),
        ("io_threads", 2.5, "io_threads: expected an int, got 2.5"),
        ("io_threads", True, "io_threads: expected an int, got True"),
        ("io_threads", 0, "io_threads: expected 1..256, got 0"),
        ("io_threads", "300", "io_threads: expected 1..256, got 300"),
        ("verify_reads", "maybe", "verify_reads: expected a bool, got 'maybe'"),
        ("quarantine", 1, "quarantine: expected a bool, got 1"),
        ("root", 5, "root: expected a non-empty path (str or os.PathLike), got 5 (int)"),
        (
            "durability",
            "sometimes",
            "durability: expected one of ['full', 'none'], got 'sometimes'",
        ),
        ("direct_io", "yes", "direct_io: expected one of ['auto', 'on', 'off'], got 'yes'"),
        (
            "checksum",
            "md5",
            "checksum: expected one of ['auto', 'xxh3_64', 'crc32c', 'wsum64'], got 'md5'",
        ),
        (
            "io_mode",
            "cuda",
            "io_mode: expected one of ['auto', 'gds', 'pinned', 'host'], got 'cuda'",
        ),
        ("checksum", 1, "checksum: expected a string, got 1"),
        ("access_granularity_s", "-1", "access_granularity_s: expected an int >= 0, got -1"),
        ("access_granularity_s", 1.5, "access_granularity_s: expected an int, got 1.5"),
    ],
)
def test_wrong_types_and_values(key: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_mapping({key: value})
    assert str(info.value) == expected


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="durability: expected one of"):
        StoreConfig(durability="always")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="io_threads: expected an int"):
        StoreConfig(io_threads="4")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="verify_reads: expected a bool"):
        StoreConfig(verify_reads=1)  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown kvstore config key"):
        StoreConfig.from_mapping({"nope": 1})


def test_replace_validates() -> None:
    base = StoreConfig(io_threads=3)
    assert base.replace(durability="none") == StoreConfig(io_threads=3, durability="none")
    with pytest.raises(ConfigError, match="unknown kvstore config key"):
        base.replace(threads=2)


def test_from_env_overrides_base() -> None:
    environ = {
        "KVSTORE_IO_THREADS": "3",
        "KVSTORE_DURABILITY": "none",
        "KVSTORE_ROOT": "/env/root",
        "KVSTORE_VERIFY_READS": "off",
        "HOME": "/home/x",  # not ours: ignored
        "KVSTOREX": "1",  # no underscore after the prefix: not ours either
    }
    base = StoreConfig(checksum="crc32c", io_threads=9)
    config = StoreConfig.from_env(base, environ=environ)
    assert config == StoreConfig(
        root=Path("/env/root"),
        io_threads=3,
        durability="none",
        checksum="crc32c",
        verify_reads=False,
    )


def test_from_env_without_variables_is_base() -> None:
    base = StoreConfig(io_threads=5)
    assert StoreConfig.from_env(base, environ={"PATH": "/bin"}) == base


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_DIRECT_IO", "off")
    assert StoreConfig.from_env().direct_io == "off"


def test_from_env_unknown_variable() -> None:
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_env(environ={"KVSTORE_IO_THREAD": "4"})
    message = str(info.value)
    assert message.startswith("unknown environment variable KVSTORE_IO_THREAD;")
    for name in FIELDS:
        assert f"KVSTORE_{name.upper()}" in message


def test_from_env_bad_value() -> None:
    with pytest.raises(ConfigError, match="io_threads: expected an int, got 'many'"):
        StoreConfig.from_env(environ={"KVSTORE_IO_THREADS": "many"})


def test_bool_is_not_an_int_for_access_granularity() -> None:
    with pytest.raises(ConfigError, match="access_granularity_s"):
        StoreConfig(access_granularity_s=True)


@pytest.mark.parametrize(
    ("checksum", "engine", "expected"),
    [
        ("auto", "host", "xxh3_64"),
        ("auto", "pinned", "xxh3_64"),
        ("auto", "gds", "wsum64"),
        ("crc32c", "pinned", "crc32c"),
        ("wsum64", "host", "wsum64"),
        ("wsum64", "gds", "wsum64"),
    ],
)
def test_auto_checksum_resolves_per_engine(checksum: str, engine: str, expected: str) -> None:
    assert StoreConfig(checksum=checksum).resolved_checksum(engine) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("checksum", ["xxh3_64", "crc32c"])
def test_forced_gds_with_a_host_checksum_is_refused(checksum: str) -> None:
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_mapping({"io_mode": "gds", "checksum": checksum})
    message = str(info.value)
    assert f"io_mode='gds' with checksum={checksum!r}" in message
    assert "expected checksum in ['auto', 'wsum64']" in message


def test_io_mode_from_env() -> None:
    config = StoreConfig.from_env(environ={"KVSTORE_IO_MODE": "pinned"})
    assert config.io_mode == "pinned"


@pytest.mark.parametrize(
    ("value", "arrived"),
    [
        (1, "got 1 (int)"),
        (None, "got None (NoneType)"),
        (b"/data/kv", "got b'/data/kv' (bytes)"),
        (2.5, "got 2.5 (float)"),
        ("", "got '' (an empty root would silently be the current directory)"),
        ("/data/k\0v", "got '/data/k\\x00v' (it contains a NUL byte)"),
    ],
)
def test_bad_root_is_a_config_error(value: object, arrived: str) -> None:
    """Issue 14 item 8: ``StoreConfig(root=1)`` raised TypeError, ``root=""`` was the cwd."""
    expected = f"root: expected a non-empty path (str or os.PathLike), {arrived}"
    with pytest.raises(ConfigError) as direct:
        StoreConfig(root=value)  # type: ignore[arg-type]
    assert str(direct.value) == expected
    with pytest.raises(ConfigError) as mapped:
        StoreConfig.from_mapping({"root": value})
    assert str(mapped.value) == expected


def test_empty_root_from_the_environment_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"root: expected a non-empty path .*got ''"):
        StoreConfig.from_env(environ={"KVSTORE_ROOT": ""})
    assert StoreConfig.from_env(environ={"KVSTORE_ROOT": "."}).root == Path(".")  # explicit


def test_pathlike_root_is_accepted() -> None:
    class Where:
        def __fspath__(self) -> str:
            return "/data/kv"

    assert StoreConfig(root=Where()).root == Path("/data/kv")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(
    "value", [None, b"x", 1.5, float("nan"), [], {}, object(), -1, 10**30, "nonsense"]
)
def test_every_field_refuses_wrong_types_with_config_error(field: str, value: object) -> None:
    """Whatever arrives, a field either accepts it or raises ConfigError naming the field."""
    kwargs: dict[str, Any] = {field: value}
    builds: list[Callable[[], StoreConfig]] = [
        lambda: StoreConfig(**kwargs),
        lambda: StoreConfig.from_mapping(kwargs),
    ]
    for build in builds:
        try:
            build()
        except ConfigError as exc:
            assert str(exc).startswith(f"{field}: expected "), str(exc)


def test_from_env_passes_over_the_native_switch() -> None:
    """KVSTORE_NATIVE and KVSTORE_NATIVE_DIR are the process's (kvstore/native.py), not a
    store's: CI exports them, and a store configured from the environment still opens."""
    base = StoreConfig(root=Path("/base"))
    environ = {"KVSTORE_NATIVE": "require", "KVSTORE_NATIVE_DIR": "/build", "PATH": "/bin"}
    assert StoreConfig.from_env(base, environ=environ) == base
    with pytest.raises(ConfigError, match="unknown environment variable KVSTORE_NATIVES"):
        StoreConfig.from_env(base, environ={"KVSTORE_NATIVES": "off"})
