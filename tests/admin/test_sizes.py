"""Sizes and durations as operators type them."""

from __future__ import annotations

import pytest

from kvstore.admin.sizes import (
    MAX_DURATION_S,
    format_size,
    iso_time,
    parse_duration,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("10G", 10 * 2**30),
        ("10g", 10 * 2**30),
        ("10GiB", 10 * 2**30),
        ("500MiB", 500 * 2**20),
        ("500M", 500 * 2**20),
        ("500MB", 500 * 10**6),
        ("2TB", 2 * 10**12),
        ("1.5T", int(1.5 * 2**40)),
        ("64 KiB", 64 * 1024),
        ("12B", 12),
        ("0", 0),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "10X", "-5G", "10 GiBs", "1e3", "10iB", "ten"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90", 90.0),
        ("0.5", 0.5),
        ("45s", 45.0),
        ("12h", 12 * 3600.0),
        ("7d", 7 * 86400.0),
        ("1w", 7 * 86400.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("0.5d", 43200.0),
        ("2M", 120.0),
    ],
)
def test_parse_duration(text: str, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        *["", "d", "7x", "-3", "3d-", "h12", "nan", "inf", "-inf", "Infinity", "1e400"],
        *["-0.5", "9" * 400 + "d", "6000w", "-1s"],
    ],
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["inf", "1e400", "nan", "-2", "9" * 400 + "s"])
def test_parse_duration_non_finite_or_negative_says_so(text: str) -> None:
    with pytest.raises(ValueError, match=r"\(finite, >= 0\), got '"):
        parse_duration(text)


def test_parse_duration_bounds() -> None:
    assert parse_duration("0") == 0.0
    assert parse_duration(str(MAX_DURATION_S)) == MAX_DURATION_S
    assert parse_duration("5200w") == 5200 * 7 * 86400.0  # just under 100 years
    with pytest.raises(ValueError, match="at most 100 years"):
        parse_duration(str(MAX_DURATION_S + 1))


@pytest.mark.parametrize("text", ["9" * 400, "9" * 400 + "P", "2000P", "1025PiB"])
def test_parse_size_rejects_huge(text: str) -> None:
    with pytest.raises(ValueError, match="expected a size of at most 1 EiB"):
        parse_size(text)


def test_format_size_and_time() -> None:
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(64 * 2**20) == "64.0 MiB"
    assert iso_time(0) == "1970-01-01T00:00:00.000Z"
    assert iso_time(None) is None
