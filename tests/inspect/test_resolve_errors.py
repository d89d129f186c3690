"""Names, hash prefixes and ranges; every bad input is exit 2 with one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import InspectError
from kvstore.inspect.resolve import find_block, find_namespace, parse_hex, parse_range
from kvstore.store.view import StoreView
from tests.inspect.conftest import Reference, Run


def test_namespace_by_name_prefix_and_digest(reference: Reference) -> None:
    store = StoreView.open(reference.root)
    ns = reference.bf16.ns
    assert find_namespace(store, ns).name == ns
    assert find_namespace(store, "test-tiny-l").name == ns
    assert find_namespace(store, ns.rsplit("-", 1)[1][:6]).name == ns
    with pytest.raises(InspectError, match="ambiguous"):
        find_namespace(store, "test-tiny")
    with pytest.raises(InspectError, match="expected one of"):
        find_namespace(store, "nope")


def test_block_by_full_hash_and_prefixes(reference: Reference) -> None:
    space = reference.bf16
    group = find_namespace(StoreView.open(reference.root), space.ns).group(0)
    h = space.names["a0"]
    for text in (
        h.hex(),
        h.hex().upper(),
        "0x" + h.hex()[:20],
        h.hex()[:17],
        h.hex()[:18],
        h.hex()[:40],
    ):
        ref = find_block(group, text)
        assert ref.block_hash == h and ref.file.path == group.path_of(h)
    with pytest.raises(InspectError, match="found none"):
        find_block(group, "f" * 64 if not h.hex().startswith("ff") else "0" * 64)


def _shortest_unique_prefix(block_hash: bytes, hashes: list[bytes]) -> str:
    """The shortest hex prefix of ``block_hash`` that no other hash in ``hashes`` starts with."""
    text = block_hash.hex()
    others = [h.hex() for h in hashes if h != block_hash]
    return next(
        text[:n] for n in range(1, len(text) + 1) if not any(o.startswith(text[:n]) for o in others)
    )


def test_shortest_unique_prefix_names_the_block_one_digit_less_is_ambiguous(
    reference: Reference,
) -> None:
    space = reference.bf16
    group = find_namespace(StoreView.open(reference.root), space.ns).group(0)
    hashes = list(space.tensors)
    ambiguous_checked = 0
    for h in hashes:
        prefix = _shortest_unique_prefix(h, hashes)
        ref = find_block(group, prefix)
        assert ref.block_hash == h and ref.file.path == group.path_of(h), prefix
        if len(prefix) > 1:  # a shorter prefix is shared with another block
            with pytest.raises(InspectError, match="ambiguous"):
                find_block(group, prefix[:-1])
            ambiguous_checked += 1
    # 12 hashes over 16 first digits share some: the ambiguous branch ran (the data is fixed).
    assert ambiguous_checked > 0


def test_single_digit_prefix_is_ambiguous_or_unique(reference: Reference) -> None:
    space = reference.bf16
    group = find_namespace(StoreView.open(reference.root), space.ns).group(0)
    by_digit: dict[str, list[bytes]] = {}
    for h in space.tensors:
        by_digit.setdefault(h.hex()[0], []).append(h)
    for digit, hashes in by_digit.items():
        if len(hashes) == 1:
            assert find_block(group, digit).block_hash == hashes[0]
        else:
            with pytest.raises(InspectError, match="ambiguous"):
                find_block(group, digit)
    # Both outcomes are exercised by the fixed reference hashes.
    assert {len(hashes) == 1 for hashes in by_digit.values()} == {True, False}


@pytest.mark.parametrize(
    ("text", "size", "want"),
    [(None, 3, range(3)), (":", 3, range(3)), ("1", 3, range(1, 2)), ("-1", 3, range(2, 3)),
     ("0:2", 3, range(0, 2)), ("1:", 4, range(1, 4)), ("-2:", 4, range(2, 4)),
     ("-2", 4, range(2, 3))],
)  # fmt: skip
def test_parse_range(text: str | None, size: int, want: range) -> None:
    assert parse_range(text, size, "--layers") == want


@pytest.mark.parametrize("text", ["3", "0:4", "2:1", "a", "1:x", "-4"])
def test_parse_range_rejects(text: str) -> None:
    with pytest.raises(InspectError, match="--heads"):
        parse_range(text, 3, "--heads")


def test_parse_hex_rejects_non_hex() -> None:
    with pytest.raises(InspectError, match="hex digits"):
        parse_hex("xyz")
    assert parse_hex("0xAB") == "ab"


def test_errors_exit_2_with_one_line(reference: Reference, run: Run, tmp_path: Path) -> None:
    space = reference.bf16
    h = space.names["s0"].hex()
    (tmp_path / "empty").mkdir()
    cases = [
        (("overview", tmp_path / "absent"), "expected a directory"),
        (("overview", tmp_path / "empty"), "expected zarr.json"),
        (("tree", reference.root, "nope"), "namespace: expected one of"),
        (("block", reference.root, space.ns, "zz"), "hex digits"),
        (("block", reference.root, space.ns, "0" * 64), "found none"),
        (("block", reference.root, space.ns, h, "--group", "3"), "group: expected 0..0"),
        (("stats", reference.root, space.ns, h, "--heads", "5"), "--heads: expected"),
        (
            ("values", reference.root, space.ns, h, "--rank", "0"),
            "expected both --layout and --rank",
        ),
        (
            (
                "stats",
                reference.root,
                space.ns,
                h,
                "--layout",
                "tp=2",
                "--rank",
                "0",
                "--layers",
                "0",
            ),
            "expected no --heads / --layers",
        ),
        (("diff", reference.root, space.ns, h), "expected ROOT NS HASH HASH2 or ROOT ROOT2"),
        (
            (
                "heatmap",
                reference.root,
                space.ns,
                h,
                "--png",
                tmp_path / "x.png",
                "--size",
                "10x10",
            ),
            "picture size",
        ),
    ]
    for argv, message in cases:
        code, out, err = run(*argv)
        assert code == 2, (argv, out, err)
        assert err.startswith("kvstore-inspect: error: ") and message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1


def test_usage_errors_and_help_return_codes(run: Run) -> None:
    assert run("frobnicate")[0] == 2
    assert run("block")[0] == 2
    code, out, _ = run("--help")
    assert code == 0 and "overview" in out and "diff" in out
