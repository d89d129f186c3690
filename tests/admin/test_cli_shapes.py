"""The --json documents of every admin command: their keys are a contract (docs/admin.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.admin.util import cli, cli_json, write
from tests.helpers import StoreFactory, block_hash, chain_hashes, make_small_identity


@pytest.fixture
def ns(root: Path, make_store: StoreFactory) -> str:
    ident = make_small_identity()
    chain = chain_hashes(3)
    write(make_store().namespace(ident).group(0), chain, [None, *chain[:-1]])
    return ident.namespace


def test_json_shapes(root: Path, ns: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = cli_json(capsys, "ls", root)
    assert rc == 0 and set(doc) == {"root", "namespaces", "total", "problems"}
    namespace_keys = {
        "name", "model", "engine", "dtype", "tokens_per_block", "hash_lookahead_tokens", "groups",
        "blocks", "bytes", "oldest_ns", "newest_ns", "oldest", "newest",
    }  # fmt: skip
    assert set(doc["namespaces"][0]) == namespace_keys
    rc, out, _ = cli(capsys, "ls", root, ns, "--json")  # JSON Lines: blocks, then a summary
    *blocks, summary = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and len(blocks) == 3
    assert set(summary) == {"type", "root", "namespace", "problems"}
    assert summary["type"] == "summary" and set(summary["namespace"]) == set(namespace_keys)
    assert all(
        set(b) == {
            "type", "group", "hash_hi", "hash_lo", "hash", "parent", "tokens", "bytes",
            "last_access_ns", "last_access", "path", "error",
        } and b["type"] == "block"
        for b in blocks
    )  # fmt: skip
    rc, doc = cli_json(capsys, "du", root)
    assert rc == 0 and set(doc) == {
        "root", "namespaces", "root_entries", "total", "complete", "problems",
    }  # fmt: skip
    assert set(doc["namespaces"][0]) == {
        "name", "blocks", "block_bytes", "groups", "temp", "quarantine", "trash", "foreign",
        "bytes", "allocated_bytes",
    }  # fmt: skip
    assert set(doc["total"]) == {
        "blocks", "block_bytes", "temp", "quarantine", "trash", "foreign",
        "removed_namespaces", "gc_usage", "bytes", "allocated_bytes",
    }  # fmt: skip
    rc, doc = cli_json(capsys, "verify", root)
    assert rc == 0 and set(doc) == {
        "root", "fix", "sample", "blocks", "in_flight_temps", "counts", "findings",
        "findings_omitted",
    }  # fmt: skip
    assert set(doc["blocks"]) == {"found", "chosen", "checked", "checked_bytes", "vanished"}
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1G")
    assert rc == 0 and set(doc) == {
        "root", "dry_run", "time", "policy", "before", "trash_emptied", "temps_removed",
        "evicted", "after", "over_budget", "headers_read", "seconds", "usage_complete",
        "future_mtimes_reset", "findings", "by_namespace", "filesystem", "evict_ahead_bytes",
        "selection",
    }  # fmt: skip
    assert set(doc["evicted"]) == {
        "blocks", "bytes", "by_namespace", "kept_recently_used", "already_gone", "last_use",
    }  # fmt: skip
    rc, doc = cli_json(capsys, "rm", root, ns, "--yes", "--now")
    assert rc == 0 and set(doc) == {
        "root", "namespace", "files", "bytes", "deleted", "renamed_to", "expired_trash_deleted",
    }  # fmt: skip


def test_help_lists_admin_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli(capsys, "--help")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "ls", "du", "verify", "gc", "rm"):
        assert command in out


def test_no_progress_bar_when_not_a_tty(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    write(make_store().namespace(make_small_identity()).group(0), [block_hash(1)])
    for command in (["ls", root], ["du", root], ["verify", root], ["gc", root, "--max-age", "1d"]):
        rc, _, err = cli(capsys, *command)
        assert rc == 0 and err == ""


def test_progress_bar_on_a_terminal(
    root: Path,
    make_store: StoreFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    write(make_store().namespace(make_small_identity()).group(0), [block_hash(1)])
    monkeypatch.setattr("kvstore.admin.progress._stderr_is_tty", lambda: True)
    rc, out, err = cli(capsys, "verify", root, "--json")
    assert rc == 0 and "verifying" in err and out.startswith("{")  # bars on stderr only
