"""Stopping a served engine leaves nothing in /dev/shm (the e2e servers' ``stop``).

A stand-in for ``vllm serve`` (no vLLM needed, ~2 s): a process-group leader that spawns a
child, as vLLM's server spawns its engine core; the child creates shared memory and a
semaphore registered with Python's resource tracker, as vLLM's message queues and locks do,
and exits on SIGINT, after its leader, without releasing them, as vLLM's engine core does when
its shutdown is cut short. ``stop`` must let
the tracker (a member of the group, deaf to SIGINT) unlink them before it SIGKILLs the group.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .servers import stop

SERVER = """
import multiprocessing as mp, os, signal, time
from multiprocessing import shared_memory

def engine_core():
    memory = shared_memory.SharedMemory(create=True, size=1 << 16)
    lock = mp.get_context("spawn").Lock()
    def shut_down(*_):
        time.sleep(0.5)  # the engine core finishes after the server process has exited
        os._exit(0)  # no __del__, no finalizers
    signal.signal(signal.SIGINT, shut_down)
    print(memory.name, lock._semlock.name, flush=True)
    while True:
        time.sleep(0.05)

if __name__ == "__main__":
    mp.get_context("spawn").Process(target=engine_core).start()
    try:
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        os._exit(0)  # the server is gone; its engine core is still shutting down
"""


def test_stop_lets_the_resource_tracker_unlink_shared_memory(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    memory, semaphore = line.split()
    files = [Path("/dev/shm") / memory.lstrip("/"), Path(f"/dev/shm/sem.{semaphore.lstrip('/')}")]
    try:
        assert all(f.exists() for f in files), files  # what a running server holds
        stop(proc)
        assert [f for f in files if f.exists()] == []
    finally:
        for f in files:  # only this test's own names, whatever happened
            f.unlink(missing_ok=True)
        proc.stdout.close()
