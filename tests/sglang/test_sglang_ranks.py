"""Real SGLang ranks in separate processes (SGLang 0.5.23's pools and HiCacheController on a
gloo group, the kvstore backend loaded by its dynamic factory): pages written at TP=2 are read
at TP=1 and the reverse, each reader a new process (a restart), and a damaged page is a miss.

Runs in the SGLang venv (scripts/sglang_venv.sh); skipped where SGLang is not installed.
Pages are compared by indexing SGLang's own buffers (tests/sglang/sglang_rank.py), never
through kvstore's mapping.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from connector.sglang import extra_config
from kvstore import KVStore, StoreConfig

REPO = Path(__file__).resolve().parents[2]
PAGES = 3
HEADS = 2
# Axis of the KV heads in the saved pages (uint8 view of kv_buffer slices; see sglang_rank.py).
HEAD_AXIS = {"layer_first": 4, "page_first": 4, "page_first_direct": 4, "page_head": 2}
RANK_TIMEOUT_S = 300


@pytest.fixture(autouse=True, scope="module")
def _native_hash_built() -> None:
    """SGLang's native hash extension is built before any rank process starts.

    Every rank JIT-loads it (torch's ``cpp_extension.load``: a ninja run under SGLang's and
    torch's file locks); built here once, serially, the ranks only find it up to date."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: PLC0415

    get_storage_hash_str([1, 2, 3, 4], None, page_size=4)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
    """Wait for every rank; once one fails (or the deadline passes) the others are killed:
    they would wait for it in a collective until gloo's own timeout."""
    while any(proc.poll() is None for proc in procs):
        failed = any(proc.returncode not in (None, 0) for proc in procs)
        if failed or time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()
            return
        time.sleep(0.1)


def _run(
    tmp: Path, root: Path, role: str, world: int, layout: str, tag: str
) -> list[tuple[dict[str, Any], np.ndarray]]:
    """Start ``world`` rank processes of one server; their results, by rank. A rank that
    fails fails the test with every rank's exit status and log."""
    port = _port()
    procs, outs, logs = [], [], []
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for rank in range(world):
        out = tmp / f"{tag}-{rank}.json"
        spec = {
            "rank": rank,
            "world": world,
            "port": port,
            "heads": HEADS,
            "layout": layout,
            "pages": PAGES,
            "role": role,
            "out": str(out),
            "extra_config": extra_config(str(root)),
        }
        path = tmp / f"{tag}-{rank}.spec.json"
        path.write_text(json.dumps(spec))
        log = tmp / f"{tag}-{rank}.log"
        # A file, not a pipe: nothing blocks on a full pipe, and the log outlives a kill.
        with log.open("wb") as sink:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.sglang.sglang_rank", str(path)],
                    cwd=REPO,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )
        outs.append(out)
        logs.append(log)
    _wait(procs, time.monotonic() + RANK_TIMEOUT_S)
    if any(proc.returncode != 0 for proc in procs):
        report = [
            f"--- {role} rank {rank}/{world}: exit status {proc.returncode}\n"
            + log.read_text(errors="replace")[-4000:]
            for rank, (proc, log) in enumerate(zip(procs, logs, strict=True))
        ]
        pytest.fail(
            "a rank process failed (a killed one was stopped after it):\n" + "\n".join(report)
        )
    return [(json.loads(out.read_text()), np.load(out.with_suffix(".npy"))) for out in outs]


def _head(pages: np.ndarray, layout: str, head: int) -> np.ndarray:
    return np.take(pages, [head], axis=HEAD_AXIS[layout])


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_written_at_tp2_read_at_tp1(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "store"
    writers = _run(tmp_path, root, "write", 2, layout, "w")
    assert [r["completed_tokens"] for r, _ in writers] == [PAGES * 4] * 2
    ((reader, pages),) = _run(tmp_path, root, "read", 1, layout, "r")
    assert reader["hit_tokens"] == PAGES * 4 and reader["loaded_pages"] == PAGES
    for rank, (_, written) in enumerate(writers):
        assert np.array_equal(_head(pages, layout, rank), written), f"head {rank}"


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_written_at_tp1_read_at_tp2(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "store"
    ((_, written),) = _run(tmp_path, root, "write", 1, layout, "w")
    readers = _run(tmp_path, root, "read", 2, layout, "r")
    for rank, (result, pages) in enumerate(readers):
        assert result["hit_tokens"] == PAGES * 4 and result["loaded_pages"] == PAGES
        assert np.array_equal(pages, _head(written, layout, rank)), f"rank {rank}"


def test_a_damaged_page_is_a_miss_for_a_new_process(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: PLC0415

    root = tmp_path / "store"
    ((_, written),) = _run(tmp_path, root, "write", 1, "page_first", "w")
    keys = get_storage_hash_str(list(range(100, 100 + PAGES * 4)), None, page_size=4)
    store = KVStore(StoreConfig(root=root))
    (name,) = store.namespace_names()
    group = store.open_namespace(name).group(0)
    path = Path(group.path_of(bytes.fromhex(keys[1])))
    data = bytearray(path.read_bytes())
    data[group.layout.chunk_offset(0) + 3] ^= 0x01
    path.write_bytes(bytes(data))
    ((reader, pages),) = _run(tmp_path, root, "read", 1, "page_first", "r1")
    # The hit query saw three files; the load verified them and stopped at the damaged one.
    assert reader["hit_tokens"] == PAGES * 4
    assert reader["loaded_pages"] == 1 and reader["stats"]["corrupt"] == 1
    assert reader["stats"]["errors"] == 0
    assert np.array_equal(pages[:, :1], written[:, :1])  # axis 1: pages
    # Quarantined: the next server's hit query stops before it.
    ((again, _),) = _run(tmp_path, root, "read", 1, "page_first", "r2")
    assert again["hit_tokens"] == 4 and again["loaded_pages"] == 1
