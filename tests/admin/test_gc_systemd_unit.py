"""scripts/systemd/kvstore-gc.service and its environment file: the unit parses, is hardened
as documented, its ExecStart uses only flags ``kvstore gc --help`` lists, and that command line
(with the example environment, paths moved to a temporary directory) runs a pass that writes
the metrics file."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.cli import build_parser
from tests.admin.util import cli
from tests.helpers import StoreFactory, make_small_identity

REPO = Path(__file__).resolve().parents[2]
UNIT_DIR = REPO / "scripts" / "systemd"
UNIT = UNIT_DIR / "kvstore-gc.service"
ENV = UNIT_DIR / "kvstore-gc.env"
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def load_unit() -> configparser.ConfigParser:
    # strict: a key given twice in one section is an error (systemd would take both; the unit
    # does not rely on that). interpolation=None: systemd's % specifiers are not ours.
    parser = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(UNIT.read_text(encoding="utf-8"), source=str(UNIT))
    return parser


def load_env() -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in ENV.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and key and " " not in key, f"not KEY=VALUE: {raw!r}"
        assert key not in out, f"{key} twice"
        out[key] = value
    return out


def exec_argv(env: dict[str, str]) -> list[str]:
    """ExecStart as systemd runs it: ``${VAR}`` replaced by one argument each."""
    words = shlex.split(load_unit()["Service"]["ExecStart"])
    return [VAR.sub(lambda m: env[m.group(1)], w) for w in words]


def gc_help_flags(capsys: pytest.CaptureFixture[str]) -> set[str]:
    with pytest.raises(SystemExit) as exc:
        cli(capsys, "gc", "--help")
    assert exc.value.code == 0
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out))


def test_unit_parses_and_is_hardened() -> None:
    unit = load_unit()
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert service["User"] not in ("", "root", "0")
    assert service["EnvironmentFile"] == "/etc/kvstore/gc.env"
    for key, want in {
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "PrivateNetwork": "yes",
        "CapabilityBoundingSet": "",
        "RestrictSUIDSGID": "yes",
    }.items():
        assert service[key] == want, key
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "Type" in service and service["Type"] == "exec"


def test_exec_start_uses_existing_gc_flags(capsys: pytest.CaptureFixture[str]) -> None:
    env = load_env()
    words = shlex.split(load_unit()["Service"]["ExecStart"])
    assert Path(words[0]).is_absolute() and Path(words[0]).name == "kvstore"
    assert words[1] == "gc"
    used = {w for w in words if w.startswith("--")}
    assert {"--watch", "--metrics", "--max-bytes"} <= used
    assert used <= gc_help_flags(capsys), used - gc_help_flags(capsys)
    # Every ${VAR} is set by the example environment file, none in StoreConfig's namespace.
    names = set(VAR.findall(" ".join(words)))
    assert names and names <= set(env), names - set(env)
    assert not any(n.startswith("KVSTORE_") for n in env)
    args = build_parser().parse_args(exec_argv(env)[1:])
    assert args.watch and args.metrics is not None and args.max_bytes is not None


def test_writable_paths_cover_root_and_metrics() -> None:
    """ProtectSystem=strict makes everything read-only but ReadWritePaths: the example root
    and the metrics file's directory must be in it (systemd does not expand ${VAR} there)."""
    env = load_env()
    service, unit = load_unit()["Service"], load_unit()["Unit"]
    writable = [Path(p) for p in service["ReadWritePaths"].split()]
    assert "$" not in service["ReadWritePaths"] and "$" not in unit["RequiresMountsFor"]
    args = build_parser().parse_args(exec_argv(env)[1:])

    def covered(path: Path) -> bool:
        return any(path == w or w in path.parents for w in writable)

    assert covered(args.root), (args.root, writable)
    assert covered(args.metrics.parent), (args.metrics, writable)
    assert str(args.root) in unit["RequiresMountsFor"].split()


def test_exec_start_runs_a_pass(
    root: Path,
    make_store: StoreFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The unit's command line, with the example settings but a temporary store and textfile
    directory, and one pass only: exit 0 and a metrics file that parses."""
    make_store().namespace(make_small_identity())
    env = load_env()
    metrics = tmp_path / "textfile" / Path(env["GC_METRICS"]).name
    metrics.parent.mkdir()
    env.update(GC_ROOT=str(root), GC_METRICS=str(metrics), GC_INTERVAL="0.01")
    rc, _out, err = cli(capsys, *exec_argv(env)[1:], "--max-passes", "1")
    assert rc == 0, err
    names = {f.name for f in text_string_to_metric_families(metrics.read_text(encoding="utf-8"))}
    assert {"kvstore_gc_passes", "kvstore_gc_usage_bytes", "kvstore_gc_evicted_blocks"} <= names


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd's own parser accepts the unit (the executable pointed at one that exists)."""
    kvstore = shutil.which("kvstore") or str(
        Path(__file__).resolve().parents[2] / ".venv/bin/kvstore"
    )
    if not Path(kvstore).exists():
        pytest.skip("no kvstore executable to point ExecStart at")
    text = UNIT.read_text(encoding="utf-8").replace("/opt/kvstore/venv/bin/kvstore", kvstore)
    unit = tmp_path / UNIT.name
    unit.write_text(text, encoding="utf-8")
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_container_example_command_parses() -> None:
    """docs/operating.md's compose service: its ENTRYPOINT (kvstore gc) plus its command is a
    command line `kvstore gc` accepts, with the same service flags as the unit."""
    doc = (REPO / "docs" / "operating.md").read_text(encoding="utf-8")
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", doc, re.M)
    command = re.search(r"^    command: (\[[^\]]*\])", doc, re.M)
    assert entry and command
    argv = [*json.loads(entry.group(1)), *json.loads(command.group(1))]
    assert argv[0] == "kvstore"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "gc" and args.watch and args.max_bytes and args.metrics is not None
