"""MLA (a DeepSeek-V2-style latent cache) through vLLM's CPU build with kvstore.

vLLM's CPU build runs an MLA model (``CPU_MLA`` backend, latent 512 + 64, block size 16) but
logs "MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be
disabled": its own prefix cache never reuses MLA pages on CPU, while the offloading connector
still loads stored prefixes. Steps (engine processes, tests/e2e/driver.py):

* ``store``: P twice; the first run computes and stores it, the second loads it from the store
  (the engine's own prefix cache is off);
* ``perturbed``: a new process loads P with the test-only ``KVSTORE_TEST_PERTURB_LOADS=1``.

What it showed: the pages round-trip (every full block loaded, ``kvstore verify`` clean) and
they drive the output (zeroed pages change the first token), but the greedy tokens of the
loaded run agree with the computed run only for their first three tokens: a prefill over a
loaded MLA context is a path vLLM's CPU build does not use itself, so whether the difference is
its bf16 arithmetic or the pages is not settled here (xfail below, strict: a fix shows up).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .chain import Chain, Step, make_prompt
from .engine import kvstore_verify, per_batch, quarantined, temp_files, tokens

pytestmark = pytest.mark.e2e

MLA_BLOCK = 16  # vLLM's CPU MLA kernel supports only block size 16
PROMPT_TOKENS = 12 * MLA_BLOCK + 8
P = make_prompt(21, PROMPT_TOKENS)
FULL = PROMPT_TOKENS // MLA_BLOCK
HITS = "external_prefix_cache_hits"


@pytest.fixture(scope="session")
def mla(e2e_python: str, e2e_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Chain:
    work = tmp_path_factory.mktemp("mla")
    root = work / "store"
    c = Chain(e2e_python, work, "mla", e2e_models / "mla")
    job = {"store_root": str(root), "block_size": MLA_BLOCK}
    c.add("store", Step({**job, "batches": [[P], [P]]}))
    perturb = {"KVSTORE_TEST_PERTURB_LOADS": "1"}
    c.add("perturbed", Step({**job, "env": perturb, "batches": [[P]]}, ("store",)))
    return c


def test_mla_pages_round_trip_and_drive_the_output(mla: Chain) -> None:
    store, perturbed = mla.result("store"), mla.result("perturbed")
    root = Path(mla.steps["store"].job["store_root"])
    computed, loaded = tokens(store)
    assert per_batch(store, HITS) == [0, FULL * MLA_BLOCK]
    assert per_batch(store, "kv_offload_load_bytes")[1] > 0
    assert per_batch(perturbed, HITS) == [FULL * MLA_BLOCK]  # a new process finds them too
    assert loaded[0] == computed[0]
    assert tokens(perturbed)[0][0] != loaded[0]  # zeroed latents change the very first token
    assert not temp_files(root)
    assert not quarantined(root)
    verify = kvstore_verify(root)
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.xfail(
    strict=True,
    reason="vLLM's CPU build disables prefix caching for MLA; its prefill over a loaded MLA "
    "context gives other greedy tokens from the 4th on (see the module docstring)",
)
def test_mla_loaded_prefix_gives_the_computed_tokens(mla: Chain) -> None:
    computed, loaded = tokens(mla.result("store"))
    assert loaded == computed
