"""Starting node processes (:mod:`tests.scaleout.node`) inside the nodes' network namespaces."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.scaleout.gluster import GlusterEnv, Node

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60


class NodeProcess:
    """One ``python -m tests.scaleout.node`` process on a node (see that module's protocol)."""

    def __init__(self, node: Node, spec: dict[str, Any], log_dir: Path, label: str) -> None:
        self.node = node
        self.label = label
        self.log = log_dir / f"{label}.stderr"
        argv = node.command([sys.executable, "-m", "tests.scaleout.node", json.dumps(spec)])
        env = dict(os.environ, PYTHONPATH=str(REPO))
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._result: dict[str, Any] | None = None

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _next(self, deadline: float) -> str | None:
        try:
            return self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"{self.label}: no output in time{self.stderr_tail()}") from None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            line = self._next(deadline)
            if line is None:
                raise RuntimeError(f"{self.label}: exited before READY{self.stderr_tail()}")
            if line == "READY":
                return

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("GO\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 120) -> dict[str, Any]:
        if self._result is not None:
            return self._result
        deadline = time.monotonic() + timeout
        while True:
            line = self._next(deadline)
            if line is None:
                raise RuntimeError(
                    f"{self.label}: exited {self.proc.wait()} without a result{self.stderr_tail()}"
                )
            if line.startswith("RESULT "):
                self._result = json.loads(line[len("RESULT ") :])
                self.proc.wait(timeout=30)
                return self._result

    def kill9(self) -> None:
        """SIGKILL the node process (nsenter execs it: the pid is the Python process)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text().splitlines()[-lines:]
        except OSError:
            return ""
        return ("\n" + "\n".join(text)) if text else ""


class SharedRoot:
    """One store directory on the shared volume and the node processes working on it."""

    def __init__(self, env: GlusterEnv, name: str, local: Path) -> None:
        self.env = env
        self.name = name
        self.local = local  # a local directory for ack files, stop files and logs
        self.procs: list[NodeProcess] = []

    def on(self, node: Node) -> Path:
        """The store root as ``node`` sees it."""
        return node.mount / self.name

    @property
    def a(self) -> Path:
        return self.on(self.env.a)

    @property
    def b(self) -> Path:
        return self.on(self.env.b)

    def start(self, node: Node, label: str, **spec: Any) -> NodeProcess:
        spec.setdefault("root", str(self.on(node)))
        proc = NodeProcess(node, spec, self.local, label)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()
