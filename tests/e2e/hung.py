"""Helpers of the hung-store e2e tests (issue 35: test_hung_gluster.py, test_hung_faultfs.py):
an engine job that runs on a thread while the test freezes and thaws its file system, and the
signal files through which the two take turns (driver.py's ``touch`` / ``wait_for`` entries).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .engine import EngineHost, block_files


class Job:
    """The engine job on a thread of its own: the test acts while it runs."""

    def __init__(self, host: EngineHost, job: dict[str, Any], workdir: Path) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.log = workdir / "hung.log"
        self._thread = threading.Thread(
            target=self._run, args=(host, job, workdir), name="engine job", daemon=True
        )
        self._thread.start()

    def _run(self, host: EngineHost, job: dict[str, Any], workdir: Path) -> None:
        try:
            self.result = host.run(job, workdir, "hung")
        except BaseException as exc:  # re-raised by finish()
            self.error = exc

    def alive(self) -> bool:
        return self._thread.is_alive()

    def finish(self, timeout_s: float) -> Any:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"the engine job did not end within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
        return self.result


def wait_for(path: Path, job: Job, timeout_s: float) -> float:
    """Wait until the job creates ``path``; the seconds it took. Fails early if the job ended."""
    started = time.monotonic()
    while not path.exists():
        if not job.alive():
            job.finish(0)  # raises the job's error
            raise AssertionError(f"the engine job ended without creating {path.name}")
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"the engine job did not create {path.name} in {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - started


def published(root: Path, expected: int, timeout_s: float) -> list[Path]:
    """The block files under ``root`` once ``expected`` of them are there (the first
    batch's), or those there at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(block_files(root)) if root.exists() else []
        if len(files) >= expected or time.monotonic() > deadline:
            return files
        time.sleep(0.5)


@contextlib.contextmanager
def released(signals: Iterable[Path]) -> Iterator[None]:
    """On a failure of the test, create every signal file the job may wait for, so that it
    runs to its end rather than to its wait's timeout."""
    try:
        yield
    except BaseException:
        for path in signals:
            path.touch()
        raise
