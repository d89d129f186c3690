"""Format v1 names (kvstore/store/paths.py): parse what is written, list only real blocks."""

from __future__ import annotations

import os
import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.keys import HASH_LO_BITS, hash_coords
from kvstore.store import paths
from kvstore.store.paths import ArrayPaths
from tests.helpers import block_hash


def test_temp_names_round_trip_and_parse_both_shapes() -> None:
    final = "/r/ns/g0/c/0/0/0/0/0/7/1234"
    temp = paths.temp_path_for(final, "00ff")
    assert temp == "/r/ns/g0/c/0/0/0/0/0/7/.1234.tmp-00ff"
    assert paths.final_path_of(temp) == final
    for name, expected in [
        ("1234", ".1234.tmp-00ff"),
        ("/1234", "/.1234.tmp-00ff"),
        ("a/zarr.json", "a/.zarr.json.tmp-00ff"),
    ]:  # bare, at /, dotted
        assert paths.temp_path_for(name, "00ff") == expected
        assert paths.final_path_of(expected) == name
    assert paths.parse_temp_lo(".1234.tmp-00ff") == 1234
    assert paths.parse_temp_lo("1234.tmp-00ff") == 1234  # the shape before the dot-name
    assert paths.parse_temp_lo("1234") is None
    assert paths.parse_temp_lo(".zarr.json.tmp-1") is None


def test_block_names_are_canonical_decimals() -> None:
    assert paths.parse_lo("0") == 0
    assert paths.parse_lo(str((1 << HASH_LO_BITS) - 1)) == (1 << HASH_LO_BITS) - 1
    for name in ["01", "", "-1", "1 ", "12\n", "\u00b2", str(1 << HASH_LO_BITS), ".1.tmp-x",
                 "\u0663", "+1", "1_0", "0" * 30, "9" * 300]:  # fmt: skip
        assert paths.parse_lo(name) is None, name


_CANONICAL_DECIMAL = re.compile(r"(0|[1-9][0-9]*)")


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=24), st.from_regex(r"[0-9]{1,21}", fullmatch=True)))
def test_block_names_match_the_format_rule(name: str) -> None:
    """parse_lo is string predicates for speed; the format's rule is this regex and bound."""
    expected = None
    if _CANONICAL_DECIMAL.fullmatch(name) and int(name) < 1 << HASH_LO_BITS:
        expected = int(name)
    assert paths.parse_lo(name) == expected
    assert paths.parse_group_dir("g12") == 12
    assert paths.parse_group_dir("g012") is None


def test_held_names_carry_their_time() -> None:
    name = paths.held_block_name(1, 2, 3, 456)
    assert name == "g1-2-3-456" and paths.held_since_ns(name) == 456
    removed = paths.removed_namespace_name("m-0123456789ab", 789)
    assert removed.startswith(paths.REMOVED_PREFIX) and paths.held_since_ns(removed) == 789
    assert paths.held_since_ns("no-time-x") is None


def test_array_paths_and_listing_skip_what_is_not_a_block(tmp_path: Path) -> None:
    array = ArrayPaths(tmp_path / "g0", 3)
    h = block_hash(1)
    hi, lo = hash_coords(h)
    assert array.block(h) == str(tmp_path / "g0" / "c" / "0" / "0" / "0" / str(hi) / str(lo))
    assert array.block_at(hi, lo) == array.block(h)
    assert array.chain()[-1] == array.fanout_root and len(array.chain()) == 4
    directory = array.fanout_dir(hi)
    directory.mkdir(parents=True)
    Path(array.block(h)).write_bytes(b"x" * 10)
    Path(paths.temp_path_for(array.block(h), "ab")).write_bytes(b"t")
    (directory / "5").symlink_to(array.block(h))  # a link is never a block
    (directory / "6").mkdir()
    os.mkfifo(directory / "7")
    (directory / "08").write_bytes(b"not canonical")
    (array.fanout_dir(3)).symlink_to(directory)  # a linked fan-out directory is not entered
    found = list(array.list_blocks())
    assert [(f.hash_hi, f.hash_lo, f.nbytes) for f in found] == [(hi, lo, 10)]
    assert found[0].path_hex == h.hex()[: paths.PATH_HEX_DIGITS]
    assert [p.name for p in array.list_temps()] == [f".{lo}.tmp-ab"]
    assert list(array.list_blocks([hi + 1 if hi < 255 else 0])) == []
    both = list(array.list_blocks_and_temps())  # one listing: the same blocks and temporaries
    assert [f for f in both if isinstance(f, paths.BlockFile)] == found
    assert [f for f in both if isinstance(f, Path)] == list(array.list_temps())


def test_listing_reports_what_it_cannot_use(tmp_path: Path) -> None:
    array = ArrayPaths(tmp_path / "ns" / "g0", 1)
    good = array.fanout_dir(1)
    good.mkdir(parents=True)
    os.mkfifo(good / "5")  # a block name holding a FIFO: never opened
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "c" / "0" / "2").mkdir(parents=True)
    (elsewhere / "c" / "0" / "2" / "9").write_bytes(b"x")
    (tmp_path / "other" / "g0").mkdir(parents=True)
    (tmp_path / "other" / "g0" / "c").symlink_to(elsewhere / "c")
    problems: paths.Problems = {}
    assert list(array.list_blocks([1], root=tmp_path, problems=problems)) == []
    assert list(problems) == [str(good / "5")] and "FIFO" in problems[str(good / "5")]
    linked = ArrayPaths(tmp_path / "other" / "g0", 1)
    problems = {}
    assert list(linked.list_blocks([2], root=tmp_path, problems=problems)) == []
    (why,) = problems.values()  # the link below the root is named, never followed
    assert "expected a directory, got a symbolic link" in why
    assert [f.hash_lo for f in linked.list_blocks([2])] == [9]  # without a root: only the last
    problems = {}
    assert list(array.list_blocks_and_temps([1], root=tmp_path, problems=problems)) == []
    assert list(problems) == [str(good / "5")]


def test_prefix_names_the_fanout_directories(tmp_path: Path) -> None:
    """GroupArray checks a fan-out directory by ``prefix + hash_hi`` (no Path per check): the
    same string as fanout_dir, for every fan-out directory."""
    paths = ArrayPaths(tmp_path / "ns-0123456789ab" / "g1", 5)
    assert [f"{paths.prefix}{hi}" for hi in range(256)] == [
        os.fspath(paths.fanout_dir(hi)) for hi in range(256)
    ]
