"""Bad admin arguments are refused before anything is done: exit 2, one line naming the argument,
what was expected and what arrived (issue 14, item 5: ``inf`` and ``1e400`` durations ended in
an OverflowError traceback, and ``rm --grace inf`` unpublished the namespace first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.inspect.cli import main as inspect_main
from tests.admin.util import snapshot, write
from tests.helpers import StoreFactory, block_hash, make_small_identity

BAD_DURATIONS = [
    "inf",
    "-inf",
    "Infinity",
    "nan",
    "1e400",
    "-1",
    "-0.5",
    "9" * 400 + "d",
    "6000w0d",
]
DURATION_OPTIONS = [
    ("gc", "--max-age"),
    ("gc", "--grace"),
    ("gc", "--tmp-age"),
    ("gc", "--interval"),
    ("verify", "--tmp-age"),
]
BAD_SIZES = ["inf", "nan", "-1", "1e400", "9" * 400, "2000P", "10X"]


@pytest.fixture
def ns(root: Path, make_store: StoreFactory) -> str:
    ident = make_small_identity()
    write(make_store().namespace(ident).group(0), [block_hash(1), block_hash(2)])
    return ident.namespace


def refused(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """Run ``kvstore argv``: assert exit 2 with one line on stderr and none on stdout; it."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert exc.value.code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize(("command", "option"), DURATION_OPTIONS)
@pytest.mark.parametrize("value", BAD_DURATIONS)
def test_bad_durations_are_refused(
    root: Path,
    ns: str,
    capsys: pytest.CaptureFixture[str],
    command: str,
    option: str,
    value: str,
) -> None:
    before = snapshot(root)
    extra = ["--watch", "--max-passes", "1", "--max-bytes", "1G"] if option == "--interval" else []
    line = refused(capsys, command, root, f"{option}={value}", *extra)
    assert f"argument {option}: expected a duration" in line
    assert repr(value)[:40] in line
    assert snapshot(root) == before


@pytest.mark.parametrize("value", BAD_DURATIONS)
def test_rm_with_a_bad_grace_leaves_the_namespace(
    root: Path, ns: str, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    before = snapshot(root)
    line = refused(capsys, "rm", root, ns, "--yes", f"--grace={value}")
    assert line.startswith("kvstore rm: error: argument --grace: expected a duration")
    assert snapshot(root) == before  # not renamed away, nothing deleted
    assert (root / ns / "zarr.json").is_file()


@pytest.mark.parametrize("value", BAD_SIZES)
def test_bad_sizes_are_refused(
    root: Path, ns: str, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    before = snapshot(root)
    line = refused(capsys, "gc", root, f"--max-bytes={value}")
    assert "argument --max-bytes: expected a size" in line
    assert snapshot(root) == before


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["verify", "{root}", "--sample", "nan"], "--sample: expected a fraction in (0, 1]"),
        (["verify", "{root}", "--sample", "inf"], "--sample: expected a fraction in (0, 1]"),
        (["verify", "{root}", "--threads", "0"], "--threads: expected a positive integer"),
        (["gc", "{root}", "--max-passes=-3"], "--max-passes: expected a positive integer"),
    ],
)
def test_other_bad_numbers_are_refused(
    root: Path, ns: str, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    before = snapshot(root)
    line = refused(capsys, *(a.format(root=root) for a in argv))
    assert expected in line
    assert snapshot(root) == before


def test_good_durations_still_work(root: Path, ns: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["gc", str(root), "--max-age", "1h30m", "--grace", "0", "--tmp-age", "1e3"])
    assert rc == 0
    rc = main(["verify", str(root), "--tmp-age", "7d"])
    assert rc == 0
    capsys.readouterr()


@pytest.mark.parametrize("size", ["0x0", "-5x100", "99999x100", "100x99999", "axb"])
def test_inspect_picture_size_is_bounded(
    root: Path, ns: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str
) -> None:
    rc = inspect_main(["tree", str(root), ns, "--png", str(tmp_path / "t.png"), f"--size={size}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "argument --size: expected WIDTHxHEIGHT" in err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", ""],
        ["du", ""],
        ["verify", "", "--fix"],
        ["gc", "", "--max-bytes", "0"],
        ["rm", "", "ns", "--yes", "--now"],
        ["demo", "--root", ""],
    ],
)
def test_empty_root_is_not_the_current_directory(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
) -> None:
    """Issue 14 item 8: an empty root (an unset shell variable) meant the current directory."""
    monkeypatch.chdir(tmp_path)
    line = refused(capsys, *argv)
    assert "expected a store directory, got '' (an empty path)" in line
    assert list(tmp_path.iterdir()) == []
    rc = inspect_main(["overview", ""])
    assert rc == 2 and "expected a store directory, got ''" in capsys.readouterr().err
