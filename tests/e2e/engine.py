"""The pytest side of the e2e tier: find the e2e venv, run engine processes, look into stores.

pytest runs in the project's main venv, where no vLLM model can run on CPU; every engine runs
under the e2e venv's python (``scripts/e2e_venv.sh``) in ``tests/e2e/driver.py``, with the
repository under test first on ``PYTHONPATH`` (so the connector and kvstore of this checkout
are used, not the editable install the venv was built with): in a process of its own
(:func:`run_engine`), or as one job of an :class:`EngineHost`, the driver's ``--host`` mode,
where one front-end process runs the jobs one after another and each job's ``vllm.LLM`` still
starts its own engine core and workers and stops them before its result is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

from kvstore.keys import hash_coords

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
VENV_SCRIPT = REPO / "scripts" / "e2e_venv.sh"
REQUIRED_ENV = "KVTEST_E2E_REQUIRED"  # "1": a missing e2e venv fails the tier (CI)
ENGINE_TIMEOUT_S = 600
HOST_EXIT_TIMEOUT_S = 60.0


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


def group_running(pgid: int) -> bool:
    """Does process group ``pgid`` still have a live (not zombie) process? (/proc: a
    zombie whose parent is gone may never be reaped here, and signals do not tell.)"""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _failure(name: str, why: str, log_path: Path) -> AssertionError:
    tail = log_path.read_text(errors="replace")[-8000:] if log_path.exists() else ""
    return AssertionError(f"engine {name!r} {why}; log tail:\n{tail}")


class EngineHost:
    """Driver jobs run one after another by one ``driver.py --host`` process (see driver.py).

    Started on the first job; a job that fails (or runs past ``ENGINE_TIMEOUT_S``) ends it,
    raising as :func:`run_engine` does, and the next job starts a new one. The host's own
    output between jobs goes to ``workdir/host-<n>.log``; each job's to ``workdir/<name>.log``.
    """

    def __init__(self, python: str | Path, workdir: Path) -> None:
        self.python = str(python)
        self.workdir = workdir
        self.started = 0  # hosts started so far
        self.jobs = 0  # jobs run by all of them
        self._proc: subprocess.Popen[bytes] | None = None
        self._replies: IO[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.started += 1
        with (self.workdir / f"host-{self.started}.log").open("wb") as log:
            proc = subprocess.Popen(
                [self.python, str(DRIVER), "--host"],
                env=engine_env(),
                cwd=self.workdir,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # its own process group, killed whole by close()
            )
        self._proc, self._replies = proc, proc.stdout
        return proc

    def run(self, job: dict[str, Any], workdir: Path, name: str) -> Any:
        """Run ``job`` (see driver.py) and return its JSON result, as :func:`run_engine`."""
        workdir.mkdir(parents=True, exist_ok=True)
        job_path, out_path, log_path = (workdir / f"{name}.{e}" for e in ("job", "out", "log"))
        job_path.write_text(json.dumps(job))
        out_path.unlink(missing_ok=True)
        log_path.unlink(missing_ok=True)
        proc = self._proc if self._proc is not None and self._proc.poll() is None else None
        proc = proc or self._start()
        assert proc.stdin is not None and self._replies is not None
        request = {"job": str(job_path), "out": str(out_path), "log": str(log_path)}
        self.jobs += 1
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
        except BrokenPipeError:
            self.close()
            raise _failure(name, "could not be sent: its host had exited", log_path) from None
        ready, _, _ = select.select([self._replies], [], [], ENGINE_TIMEOUT_S)
        line = self._replies.readline() if ready else b""
        reply = json.loads(line) if line.strip() else {}
        if reply.get("ok") is not True or not out_path.exists():
            why = "timed out" if not ready else f"failed (host reply {line!r})"
            self.close()
            raise _failure(name, why, log_path)
        return json.loads(out_path.read_text())

    def close(self) -> None:
        """EOF to the host, wait for its exit and its group's; then SIGKILL to what is left."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                with suppress(BrokenPipeError):
                    proc.stdin.close()
            proc.wait(timeout=HOST_EXIT_TIMEOUT_S)
            # Python's resource tracker, of the host's group, unlinks the shared memory its
            # engines left registered once the host is gone: let it (see servers.stop).
            deadline = time.monotonic() + HOST_EXIT_TIMEOUT_S
            while group_running(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        except subprocess.TimeoutExpired:
            pass
        finally:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            if proc.stdout is not None:
                proc.stdout.close()


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
