"""A hybrid model (full + sliding-window attention layers) through real vLLM engines on CPU.

A tiny random Gemma-3 text model (4 layers: sliding window of 64 tokens, full, sliding, full;
untied embeddings: tied random ones degenerate) gives vLLM two KV-cache groups, stored as two
arrays of one namespace. Steps, each an engine process (tests/e2e/driver.py):

* ``base1`` / ``base2``: TP=1 / TP=2 without the connector (the references);
* ``store``: TP=1 stores P;
* ``tp2``: TP=2 loads P (stored by TP=1) and stores Q;
* ``load``: a new TP=1 process loads P (stored by TP=1) and Q (stored by TP=2);
* ``damaged``: a copy of the store with a corrupt block of P[0]: with several KV-cache groups
  vLLM takes no block-level load errors, so the connector fails the request's whole load and
  vLLM recomputes it; then Q[0] is served from the store.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .chain import BLOCK, Chain, Step, make_prompt
from .engine import (
    EngineHost,
    block_file,
    block_files,
    kvstore_verify,
    per_batch,
    quarantined,
    temp_files,
    tokens,
)

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = 6 * BLOCK + 8
P = [make_prompt(11, PROMPT_TOKENS), make_prompt(12, PROMPT_TOKENS)]
Q = [make_prompt(13, PROMPT_TOKENS)]
FULL = PROMPT_TOKENS // BLOCK
CORRUPT_BLOCK = FULL - 1  # of P[0], array g0: inside the sliding window too
HITS = "external_prefix_cache_hits"


def each(*prompts: list[int]) -> list[list[list[int]]]:
    return [[p] for p in prompts]


@pytest.fixture(scope="session")
def hybrid(
    e2e_host: EngineHost, e2e_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Chain:
    work = tmp_path_factory.mktemp("gemma3")
    root, damaged = work / "store", work / "damaged"
    c = Chain(e2e_host, work, "gemma3", e2e_models / "gemma3")
    c.add("base1", Step({"store_root": None, "batches": each(*P, *Q)}))
    c.add("base2", Step({"store_root": None, "tp": 2, "batches": each(*P, *Q)}))
    c.add("store", Step({"store_root": str(root), "batches": each(*P)}))
    c.add("tp2", Step({"store_root": str(root), "tp": 2, "batches": each(*P, *Q)}, ("store",)))
    c.add("load", Step({"store_root": str(root), "batches": each(*P, *Q)}, ("tp2",)))

    def damage() -> None:
        shutil.copytree(root, damaged)
        corrupt = block_file(damaged, c.result("base1")["block_hashes"][0][CORRUPT_BLOCK])
        assert corrupt is not None
        data = bytearray(corrupt.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        corrupt.write_bytes(bytes(data))

    damaged_job = {"store_root": str(damaged), "batches": each(P[0], *Q)}
    c.add("damaged", Step(damaged_job, ("load",), damage))
    return c


def test_hybrid_model_round_trips(hybrid: Chain) -> None:
    base, store, load = hybrid.result("base1"), hybrid.result("store"), hybrid.result("load")
    root = Path(hybrid.steps["store"].job["store_root"])
    assert tokens(store) == tokens(base)[:2]
    assert tokens(load)[:2] == tokens(base)[:2]
    assert per_batch(load, HITS)[:2] == [FULL * BLOCK] * 2
    # both KV-cache groups (full attention, sliding window) have their arrays in the store
    assert block_files(root, 0)
    assert block_files(root, 1)
    assert not temp_files(root)
    verify = kvstore_verify(root)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_hybrid_model_across_tensor_parallel_sizes(hybrid: Chain) -> None:
    base1, base2 = hybrid.result("base1"), hybrid.result("base2")
    tp2, load = hybrid.result("tp2"), hybrid.result("load")
    assert tokens(tp2) == tokens(base2)
    assert per_batch(tp2, HITS) == [FULL * BLOCK, FULL * BLOCK, 0]  # P from TP=1, Q new
    assert tokens(load)[2] == tokens(base1)[2]  # Q, stored by TP=2
    assert per_batch(load, HITS)[2] == FULL * BLOCK


def test_hybrid_model_corrupt_block_recomputes_the_request(hybrid: Chain) -> None:
    base, damaged = hybrid.result("base1"), hybrid.result("damaged")
    root = Path(hybrid.steps["damaged"].job["store_root"])
    assert tokens(damaged) == [tokens(base)[0], tokens(base)[2]]
    log = hybrid.log("damaged")
    assert "1 corrupt, quarantined" in log
    assert "the engine recomputes them" in log  # vLLM 0.32 logs nothing for failed_recving
    assert per_batch(damaged, HITS)[1] == FULL * BLOCK  # the engine keeps loading
    assert len(quarantined(root)) == 1
    assert not temp_files(root)
