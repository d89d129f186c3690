"""``kvstore gc --metrics FILE``: the Prometheus textfile parses with prometheus_client, its
values are the scenario's, counters grow across --watch passes, the file is replaced
atomically, and bad or hostile metrics paths are refused or never followed."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.admin import gc
from kvstore.admin.textfile import Family, Textfile, exposition
from kvstore.io.dirlist import ListedStat
from kvstore.store import paths
from tests.admin.util import NS_PER_S, age, cli, held, set_mtime, snapshot, write
from tests.helpers import StoreFactory, block_hash, make_small_identity

REPO = Path(__file__).resolve().parents[2]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """(sample name and labels -> value, family name -> type) via prometheus_client's parser."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def read_metrics(path: Path) -> Samples:
    return parse(path.read_text(encoding="utf-8"))[0]


@pytest.fixture
def textdir(tmp_path: Path) -> Path:
    d = tmp_path / "textfile"
    d.mkdir()
    return d


def test_watch_metrics_match_the_scenario(
    root: Path,
    make_store: StoreFactory,
    textdir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Namespace A: 6 blocks, B: 2 blocks, one of them corrupt and quarantined by verify --fix.
    Budget 5 blocks: pass 1 evicts A's 3 oldest; before pass 2, A gets 2 new blocks and pass 2
    evicts 2 more. Every figure of both files is the scenario's."""
    store = make_store()
    id_a, id_b = make_small_identity(), make_small_identity(revision="b")
    ga, gb = store.namespace(id_a).group(0), store.namespace(id_b).group(0)
    pa = write(ga, [block_hash(i, "a") for i in range(6)])
    pb = write(gb, [block_hash(i, "b") for i in range(2)])
    file_size = ga.layout.file_nbytes
    assert gb.layout.file_nbytes == file_size
    size = held(pa[0])  # what gc counts of each block: what it holds on the disk
    age(pa + pb)  # A's blocks are the oldest
    with open(pb[1], "r+b") as f:  # a flipped byte in a chunk: verify --fix quarantines it
        f.seek(file_size - 100)
        byte = f.read(1)
        f.seek(file_size - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc, _out, _err = cli(capsys, "verify", root, "--fix")
    assert rc == 1 and not os.path.exists(pb[1])
    a, b = id_a.namespace, id_b.namespace
    metrics = textdir / "kvstore-gc.prom"
    real_pass = gc.gc_pass
    between: list[str] = []

    def gc_pass(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if between or metrics.exists():  # pass 2: keep pass 1's file, then two new blocks
            between.append(metrics.read_text(encoding="utf-8"))
            write(ga, [block_hash(i, "new") for i in range(2)])
        return real_pass(*args, **kwargs)

    monkeypatch.setattr(gc, "gc_pass", gc_pass)
    rc, _out, err = cli(
        capsys,
        "gc",
        root,
        "--max-bytes",
        5 * size,
        "--watch",
        "--interval",
        "0.01",
        "--max-passes",
        "2",
        "--metrics",
        metrics,
    )
    assert rc == 0, err
    assert len(between) == 1
    first, types = parse(between[0])
    second = read_metrics(metrics)
    assert sorted(os.listdir(textdir)) == ["kvstore-gc.prom"]  # no temporary file left

    # Naming conventions: counters end in _total, everything is kvstore_gc_*.
    for name, kind in types.items():
        assert name.startswith("kvstore_gc_") and kind in ("counter", "gauge"), (name, kind)
    assert {k[0] for k in first if types.get(k[0].removesuffix("_total")) == "counter"} == {
        k[0] for k in first if k[0].endswith("_total")
    }

    # Pass 1: scanned 6 + 1 blocks and 1 quarantined file; 3 of A evicted; trash still empty.
    assert value(first, "kvstore_gc_usage_bytes", kind="blocks") == 7 * size
    assert value(first, "kvstore_gc_usage_bytes", kind="quarantine") == size
    assert value(first, "kvstore_gc_usage_bytes", kind="temp") == 0
    assert value(first, "kvstore_gc_usage_after_pass_bytes") == 5 * size
    assert value(first, "kvstore_gc_max_bytes") == 5 * size
    assert value(first, "kvstore_gc_over_budget") == 0
    assert value(first, "kvstore_gc_usage_complete") == 1
    assert value(first, "kvstore_gc_interval_seconds") == 0.01
    assert value(first, "kvstore_gc_blocks", namespace=a) == 6
    assert value(first, "kvstore_gc_blocks", namespace=b) == 1
    assert value(first, "kvstore_gc_block_bytes", namespace=a) == 6 * size
    assert value(first, "kvstore_gc_quarantine_entries", namespace=a) == 0
    assert value(first, "kvstore_gc_quarantine_entries", namespace=b) == 1
    assert value(first, "kvstore_gc_quarantine_bytes", namespace=b) == size
    assert value(first, "kvstore_gc_trash_entries") == 0
    assert value(first, "kvstore_gc_evicted_blocks_total", namespace=a) == 3
    assert value(first, "kvstore_gc_evicted_bytes_total", namespace=a) == 3 * size
    assert value(first, "kvstore_gc_evicted_blocks_total", namespace=b) == 0
    assert value(first, "kvstore_gc_passes_total") == 1
    assert value(first, "kvstore_gc_pass_errors_total") == 0
    for kind in ("unreadable", "bad-namespace", "trash-unusable", "undeletable"):
        assert value(first, "kvstore_gc_findings", kind=kind) == 0

    # Pass 2: 3 + 2 new A blocks and B's one; 2 more evicted; the 3 from pass 1 in trash.
    assert value(second, "kvstore_gc_blocks", namespace=a) == 5
    assert value(second, "kvstore_gc_usage_bytes", kind="blocks") == 6 * size
    assert value(second, "kvstore_gc_usage_after_pass_bytes") == 5 * size
    assert value(second, "kvstore_gc_trash_entries") == 3
    assert value(second, "kvstore_gc_trash_bytes") == 3 * size
    assert value(second, "kvstore_gc_evicted_blocks_total", namespace=a) == 5
    assert value(second, "kvstore_gc_evicted_bytes_total", namespace=a) == 5 * size
    assert value(second, "kvstore_gc_passes_total") == 2
    assert value(second, "kvstore_gc_quarantine_entries", namespace=b) == 1
    assert (
        value(second, "kvstore_gc_last_pass_timestamp_seconds")
        >= value(first, "kvstore_gc_last_pass_timestamp_seconds")
        > 0
    )
    assert value(second, "kvstore_gc_last_pass_duration_seconds") > 0
    assert stat.S_IMODE(metrics.stat().st_mode) == 0o644  # the collector may run as another user


def test_one_pass_metrics_unreadable_directory(
    root: Path,
    make_store: StoreFactory,
    textdir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--metrics without --watch: one pass, one file. A fan-out directory that cannot be listed
    (mode 000; a PermissionError injected at the one listing, since root reads everything):
    the file is still written, with usage_complete 0 and the finding counted."""
    group = make_store().namespace(make_small_identity()).group(0)
    hashes = [block_hash(i) for i in range(16)]
    written = write(group, hashes)
    hidden = Path(written[0]).parent
    assert any(Path(p).parent != hidden for p in written)
    real_batches = paths.iter_dir_batches

    def iter_dir_batches(
        p: str | Path, *, root: str | Path | None = None
    ) -> Iterator[list[tuple[str, ListedStat]]]:
        if Path(p) == hidden:
            raise PermissionError(13, "Permission denied", str(p))
        return real_batches(p, root=root)

    if os.geteuid() == 0:
        monkeypatch.setattr(paths, "iter_dir_batches", iter_dir_batches)
    hidden.chmod(0)
    metrics = textdir / "gc.prom"
    try:
        rc, _out, err = cli(capsys, "gc", root, "--max-bytes", "1T", "--metrics", metrics)
    finally:
        hidden.chmod(0o755)
    assert rc == 1 and str(hidden) in err
    samples = read_metrics(metrics)
    assert value(samples, "kvstore_gc_usage_complete") == 0
    assert value(samples, "kvstore_gc_findings", kind="unreadable") == 1
    in_hidden = sum(Path(p).parent == hidden for p in written)
    ns = make_small_identity().namespace
    assert value(samples, "kvstore_gc_blocks", namespace=ns) == len(written) - in_hidden
    assert value(samples, "kvstore_gc_passes_total") == 1
    assert "kvstore_gc_interval_seconds" not in {k[0] for k in samples}  # no --watch


@pytest.mark.parametrize("case", ["missing-dir", "parent-is-file", "is-dir", "not-writable"])
def test_bad_metrics_path_exits_2_before_the_first_pass(
    root: Path,
    make_store: StoreFactory,
    tmp_path: Path,
    textdir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    group = make_store().namespace(make_small_identity()).group(0)
    age(write(group, [block_hash(i) for i in range(3)]))
    (tmp_path / "afile").write_text("x")
    target = {
        "missing-dir": tmp_path / "nope" / "gc.prom",
        "parent-is-file": tmp_path / "afile" / "gc.prom",
        "is-dir": textdir,
        "not-writable": textdir / "gc.prom",
    }[case]
    if case == "not-writable":
        textdir.chmod(0o555)
        if os.geteuid() == 0:  # root writes anywhere: refuse the create as the kernel would
            real_open = os.open

            def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
                if flags & os.O_CREAT:
                    raise PermissionError(13, "Permission denied", str(path))
                return real_open(path, flags, *args, **kwargs)

            monkeypatch.setattr(os, "open", refuse)
    before = snapshot(root)
    try:
        rc, out, err = cli(capsys, "gc", root, "--max-bytes", "1", "--metrics", target)
    finally:
        textdir.chmod(0o755)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(target) in lines[0] and lines[0].startswith("kvstore: error:")
    assert snapshot(root) == before  # checked before the first pass: nothing evicted
    assert os.listdir(textdir) == [] or case == "is-dir"


@pytest.mark.parametrize("where", ["root", "namespace"])
def test_metrics_file_inside_the_store_is_refused(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """Inside the store the file would be a foreign entry (counted, quarantined by verify)."""
    ident = make_small_identity()
    make_store().namespace(ident)
    target = (root if where == "root" else root / ident.namespace) / "gc.prom"
    before = snapshot(root)
    rc, _out, err = cli(capsys, "gc", root, "--max-bytes", "1G", "--metrics", target)
    assert rc == 2 and "expected a file outside the store" in err and str(target) in err
    assert snapshot(root) == before


def test_empty_metrics_path_is_a_usage_error(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    make_store()
    with pytest.raises(SystemExit) as exc:
        cli(capsys, "gc", root, "--max-bytes", "1G", "--metrics", "")
    assert exc.value.code == 2
    assert "expected a file path, got ''" in capsys.readouterr().err


def test_symlink_at_the_final_name_is_replaced_not_followed(
    root: Path,
    make_store: StoreFactory,
    tmp_path: Path,
    textdir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    make_store().namespace(make_small_identity())
    outside = tmp_path / "precious"
    outside.write_text("keep me")
    metrics = textdir / "gc.prom"
    metrics.symlink_to(outside)
    dangling = textdir / "other.prom"
    dangling.symlink_to(tmp_path / "never-created")
    for path in (metrics, dangling):
        rc, _out, err = cli(capsys, "gc", root, "--max-bytes", "1G", "--metrics", path)
        assert rc == 0, err
        assert not path.is_symlink() and path.is_file()
        assert value(read_metrics(path), "kvstore_gc_passes_total") == 1
    assert outside.read_text() == "keep me"
    assert not (tmp_path / "never-created").exists()


def test_fifo_at_the_final_name_does_not_block(
    root: Path, make_store: StoreFactory, textdir: Path
) -> None:
    """A FIFO where the file goes: opening it for writing would block forever; the rename
    replaces it. In a child process, so a regression fails on its timeout, not by hanging."""
    make_store().namespace(make_small_identity())
    metrics = textdir / "gc.prom"
    os.mkfifo(metrics)
    cmd = [sys.executable, "-m", "kvstore.cli", "gc", str(root), "--max-bytes", "1G"]
    proc = subprocess.run(
        [*cmd, "--metrics", str(metrics)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert stat.S_ISREG(metrics.lstat().st_mode)
    assert value(read_metrics(metrics), "kvstore_gc_passes_total") == 1


def fixed_token(monkeypatch: pytest.MonkeyPatch, tokens: list[str]) -> None:
    """The temporary file names ``Textfile`` will pick: ``tokens`` in turn, then random."""
    real = secrets.token_hex

    def token_hex(n: int) -> str:
        return tokens.pop(0) if tokens else real(n)

    monkeypatch.setattr(secrets, "token_hex", token_hex)


def test_planted_link_at_the_temp_name_is_not_followed(
    tmp_path: Path, textdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "precious"
    outside.write_text("keep me")
    tf = Textfile(textdir / "gc.prom")
    (textdir / ".gc.prom.0000000000000000.tmp").symlink_to(outside)
    fixed_token(monkeypatch, ["0000000000000000"])
    with pytest.raises(FileExistsError):
        tf.write("x 1\n")
    assert outside.read_text() == "keep me"
    assert not (textdir / "gc.prom").exists()
    assert (textdir / ".gc.prom.0000000000000000.tmp").is_symlink()  # not ours: left alone


def test_watch_counts_a_failed_write_and_carries_on(
    root: Path,
    make_store: StoreFactory,
    tmp_path: Path,
    textdir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pass 1's write meets a planted link at its temporary name: a warning, the passes go on,
    and pass 2's file counts the failed write. (The check before pass 1 takes a token too.)"""
    make_store().namespace(make_small_identity())
    (textdir / ".gc.prom.0000000000000000.tmp").symlink_to(tmp_path / "elsewhere")
    fixed_token(monkeypatch, ["1111111111111111", "0000000000000000"])
    metrics = textdir / "gc.prom"
    rc, _out, err = cli(
        capsys,
        "gc",
        root,
        "--max-bytes",
        "1G",
        "--watch",
        "--interval",
        "0.01",
        "--max-passes",
        "2",
        "--metrics",
        metrics,
    )
    assert rc == 0
    assert err.count("cannot write --metrics") == 1
    samples = read_metrics(metrics)
    assert value(samples, "kvstore_gc_metrics_write_errors_total") == 1
    assert value(samples, "kvstore_gc_passes_total") == 2
    assert not (tmp_path / "elsewhere").exists()


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(
    textdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tf = Textfile(textdir / "gc.prom")
    tf.write("a 1\n")

    def fail(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output error"):
        tf.write("a 2\n")
    assert (textdir / "gc.prom").read_text() == "a 1\n"
    assert os.listdir(textdir) == ["gc.prom"]


def test_reader_never_sees_a_partial_file(textdir: Path) -> None:
    """Two large, different contents written in turn while a reader reads the file in a loop:
    every read is one of them, whole."""
    contents = [
        exposition(
            [
                Family(
                    f"m{k}",
                    "gauge",
                    "padding",
                    [({"i": str(i)}, float(i)) for i in range(8000)],
                )
            ]
        )
        for k in range(2)
    ]
    tf = Textfile(textdir / "gc.prom")
    tf.write(contents[0])
    stop = threading.Event()
    seen: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append((textdir / "gc.prom").read_text(encoding="utf-8"))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(60):
            tf.write(contents[i % 2])
    finally:
        stop.set()
        thread.join()
    assert seen
    bad = [len(s) for s in seen if s not in contents]
    assert not bad, f"{len(bad)} partial reads of {len(seen)} (sizes {bad[:5]})"
    assert os.listdir(textdir) == ["gc.prom"]


def test_label_values_are_escaped() -> None:
    """Hostile namespace names (quote, backslash, newline, undecodable bytes) round-trip
    through prometheus_client's parser; the file is valid UTF-8."""
    names = ['a"b', "c\\d", "e\nf", os.fsdecode(b"g\xffh")]
    text = exposition(
        [
            Family(
                "kvstore_gc_blocks",
                "gauge",
                "help\nwith \\",
                [({"namespace": n}, 1) for n in names],
            )
        ]
    )
    text.encode("utf-8")  # no surrogates left
    samples, _ = parse(text)
    got = sorted(dict(labels)["namespace"] for _name, labels in samples)
    assert got == sorted(['a"b', "c\\d", "e\nf", "g\\xffh"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: Family("kvstore_gc_passes", "counter", "h", [({}, 1)]),
        lambda: Family("bad-name", "gauge", "h", [({}, 1)]),
        lambda: Family("x", "summary", "h", [({}, 1)]),
        lambda: Family("x", "gauge", "h", [({"bad-label": "v"}, 1)]),
    ],
)
def test_family_refuses_invalid_names(make: Callable[[], Family]) -> None:
    with pytest.raises(ValueError, match="expected"):
        make()


def test_metrics_written_after_a_failed_pass(
    root: Path,
    make_store: StoreFactory,
    textdir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --watch pass that fails after the first is counted in pass_errors_total at once."""
    make_store().namespace(make_small_identity())
    real_pass = gc.gc_pass
    calls: list[int] = []

    def gc_pass(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real_pass(*args, **kwargs)

    monkeypatch.setattr(gc, "gc_pass", gc_pass)
    metrics = textdir / "gc.prom"
    rc, _out, err = cli(
        capsys,
        "gc",
        root,
        "--max-bytes",
        "1G",
        "--watch",
        "--interval",
        "0.01",
        "--max-passes",
        "2",
        "--metrics",
        metrics,
    )
    assert rc == 0 and "gc pass failed" in err
    assert len(calls) == 3
    samples = read_metrics(metrics)
    assert value(samples, "kvstore_gc_pass_errors_total") == 1
    assert value(samples, "kvstore_gc_passes_total") == 2


def test_trash_and_temp_counters(
    root: Path,
    make_store: StoreFactory,
    textdir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An expired trash entry and a crashed writer's temporary file: both counted as found,
    then as unlinked / removed."""
    store = make_store()
    ident = make_small_identity()
    paths_ = write(store.namespace(ident).group(0), [block_hash(1)])
    hour_ago = time.time_ns() - 3600 * NS_PER_S
    orphan = Path(paths_[0] + ".tmp-00000000000000ff")
    orphan.write_bytes(b"o" * 100)
    set_mtime(orphan, hour_ago - 3600 * NS_PER_S)
    trash = root / ident.namespace / "trash"
    trash.mkdir()
    trashed = trash / f"g0-1-2-{hour_ago}"
    trashed.write_bytes(b"t" * 50)
    # gc counts what files hold on the disk: a page each for these (at least their size).
    orphan_bytes, trashed_bytes = held(orphan), held(trashed)
    assert orphan_bytes >= 100 and trashed_bytes >= 50
    metrics = textdir / "gc.prom"
    rc, _out, err = cli(capsys, "gc", root, "--max-bytes", "1G", "--metrics", metrics)
    assert rc == 0, err
    samples = read_metrics(metrics)
    assert value(samples, "kvstore_gc_trash_entries") == 1
    assert value(samples, "kvstore_gc_trash_bytes") == trashed_bytes
    assert value(samples, "kvstore_gc_trash_unlinked_entries_total") == 1
    assert value(samples, "kvstore_gc_trash_unlinked_bytes_total") == trashed_bytes
    assert value(samples, "kvstore_gc_usage_bytes", kind="temp") == orphan_bytes
    assert value(samples, "kvstore_gc_temps_removed_files_total") == 1
    assert value(samples, "kvstore_gc_temps_removed_bytes_total") == orphan_bytes
    assert value(samples, "kvstore_gc_evicted_blocks_total", namespace=ident.namespace) == 0
    assert not orphan.exists() and not any(trash.iterdir())
