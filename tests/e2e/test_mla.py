"""MLA (a DeepSeek-V2-style latent cache) through vLLM's CPU build with kvstore.

vLLM's CPU build runs an MLA model (``CPU_MLA`` backend, latent 512 + 64, block size 16) but
logs "MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be
disabled": its own prefix cache never reuses MLA pages on CPU, while the offloading connector
still loads stored prefixes, so its prefill over a loaded context is a path only the connector
takes there. Steps (engine processes, tests/e2e/driver.py):

* ``store``: computes and stores P (an empty store: a run that loads nothing);
* ``load``: a new process loads P: the same greedy tokens;
* ``perturbed``: a new process loads P with the test-only ``KVTEST_PERTURB_LOADS=1``
  (pages zeroed after verification): the first token changes.

float32: in bf16 the CPU MLA kernels' full prefill and their prefill over a loaded context
round differently (seen: the same first three tokens, then others; the loaded run agreed with
the float32 tokens), which says nothing about the pages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .chain import Chain, Step, make_prompt
from .engine import EngineHost, kvstore_verify, per_batch, quarantined, temp_files, tokens

pytestmark = pytest.mark.e2e

MLA_BLOCK = 16  # vLLM's CPU MLA kernel supports only block size 16
PROMPT_TOKENS = 12 * MLA_BLOCK + 8
P = make_prompt(21, PROMPT_TOKENS)
FULL = PROMPT_TOKENS // MLA_BLOCK
HITS = "external_prefix_cache_hits"


@pytest.fixture(scope="session")
def mla(e2e_host: EngineHost, e2e_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Chain:
    work = tmp_path_factory.mktemp("mla")
    root = work / "store"
    c = Chain(e2e_host, work, "mla", e2e_models / "mla")
    job = {"store_root": str(root), "block_size": MLA_BLOCK, "batches": [[P]]}
    c.add("store", Step(job))
    c.add("load", Step(job, ("store",)))
    perturb = {"KVTEST_PERTURB_LOADS": "1"}
    c.add("perturbed", Step({**job, "env": perturb}, ("load",)))
    return c


def test_mla_pages_round_trip(mla: Chain) -> None:
    store, load = mla.result("store"), mla.result("load")
    root = Path(mla.steps["store"].job["store_root"])
    assert tokens(load) == tokens(store)  # the store computed P (the store was empty)
    assert per_batch(store, HITS) == [0]
    assert per_batch(load, HITS) == [FULL * MLA_BLOCK]
    assert per_batch(load, "kv_offload_load_bytes")[0] > 0
    assert not temp_files(root)
    verify = kvstore_verify(root)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_mla_loaded_latents_drive_the_output(mla: Chain) -> None:
    load, perturbed = mla.result("load"), mla.result("perturbed")
    assert per_batch(perturbed, HITS) == [FULL * MLA_BLOCK]
    assert tokens(perturbed)[0][0] != tokens(load)[0][0]  # zeroed latents: another first token
    assert not quarantined(Path(mla.steps["store"].job["store_root"]))
