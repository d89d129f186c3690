"""The pytest side of the e2e tier: find the e2e venv, run engine processes, look into stores.

pytest runs in the project's main venv, where no vLLM model can run on CPU; every engine is a
subprocess of the e2e venv's python (``scripts/e2e_venv.sh``) running ``tests/e2e/driver.py``,
with the repository under test first on ``PYTHONPATH`` (so the connector and kvstore of this
checkout are used, not the editable install the venv was built with).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvstore.keys import hash_coords

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
VENV_SCRIPT = REPO / "scripts" / "e2e_venv.sh"
REQUIRED_ENV = "KVTEST_E2E_REQUIRED"  # "1": a missing e2e venv fails the tier (CI)
ENGINE_TIMEOUT_S = 600


def e2e_venv_python() -> Path | None:
    """The python of the built e2e venv, found where ``scripts/e2e_venv.sh`` puts it (same
    location and stamp rule), or None when it is not built."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes() + VENV_SCRIPT.read_bytes()).hexdigest()
    digest = digest[:12]
    default = Path.home() / ".cache" / "kvstore-e2e" / f"venv-{digest}"
    venv = Path(os.environ.get("KVTEST_E2E_VENV") or default)
    stamp = venv / ".kvstore-e2e-built"
    python = venv / "bin" / "python"
    try:
        built = stamp.read_text().strip() == digest
    except OSError:
        built = False
    return python if built and python.exists() else None


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of an engine process: this checkout first on the path, nothing online."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("VLLM_KV_CACHE_LAYOUT", None)
    env.pop("KVTEST_PERTURB_LOADS", None)
    env.pop("KVTEST_E2E_WIDEN_CPU_LAYOUTS", None)
    env.update(extra or {})
    return env


def run_engine(python: str | Path, job: dict[str, Any], workdir: Path, name: str) -> Any:
    """Run one engine process on ``job`` (see driver.py) and return its JSON result.

    The process's output goes to ``workdir/<name>.log``; a failure raises with its tail.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("job", "out", "log"))
    job_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.run(
            [str(python), str(DRIVER), str(job_path), str(out_path)],
            env=engine_env(),
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=ENGINE_TIMEOUT_S,
            check=False,
        )
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-8000:]
        raise AssertionError(f"engine {name!r} exited with {proc.returncode}; log tail:\n{tail}")
    return json.loads(out_path.read_text())


def namespaces(root: Path) -> list[Path]:
    """Namespace directories of a store (each holds g<k>/ arrays)."""
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "g0").is_dir())


def block_files(root: Path, array: int = 0) -> set[Path]:
    """Published block files of array ``g<array>`` in every namespace (no temporaries)."""
    out = set()
    for ns in namespaces(root):
        for path in (ns / f"g{array}" / "c").rglob("*"):
            if path.is_file() and path.name.isdigit():
                out.add(path)
    return out


def block_file(root: Path, block_hash_hex: str, array: int = 0) -> Path | None:
    """The published file of one block (by vLLM's block hash), None when absent."""
    hi, lo = hash_coords(bytes.fromhex(block_hash_hex))
    for path in block_files(root, array):
        if path.name == str(lo) and path.parent.name == str(hi):
            return path
    return None


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


def quarantined(root: Path) -> list[Path]:
    return [p for ns in namespaces(root) for p in (ns / "quarantine").glob("*")]


def kvstore_verify(root: Path) -> subprocess.CompletedProcess[str]:
    """``kvstore verify ROOT`` (the admin CLI of this checkout, in the main venv)."""
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "verify", str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def tokens(result: dict[str, Any]) -> list[list[int]]:
    """Greedy tokens of every prompt of a driver result, in order (resets skipped)."""
    return [
        out["tokens"] for batch in result["batches"] if isinstance(batch, list) for out in batch
    ]


def per_batch(result: dict[str, Any], counter: str) -> list[float]:
    """How much vLLM's cumulative ``counter`` grew during each batch."""
    values = [m.get(counter, 0.0) for m in result["metrics"]]
    return [b - a for a, b in zip([0.0, *values], values, strict=False)]
