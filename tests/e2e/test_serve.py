"""`vllm serve` with the kvstore connector, as a user runs it: OpenAI API, restart, same request.

A tiny random-weight Llama (built locally, nothing downloaded) is served on 127.0.0.1 with
``--skip-tokenizer-init`` (prompts are token ids through the completions API) and
``--kv-transfer-config`` pointing at a fresh store. One greedy request, wait until the store
holds its prompt blocks, stop the server (SIGINT, as Ctrl-C), start a new one on the same store,
same request: the tokens are identical and vLLM's own ``/metrics`` show the prompt came from the
store (external prefix-cache hits, offload load bytes), while the first server had none.

The servers and the request are tests/e2e/servers.py's ``restart_scenario``, run once per
session for this test and test_metrics.py (the ``served_restart`` fixture): its servers also
publish vLLM's KV events, which test_metrics.py reads. Every wait has a deadline; each server's
whole process group is killed at the end whatever happens; its log is shown on failure.
"""

from __future__ import annotations

import pytest

from .engine import kvstore_verify, temp_files
from .servers import (
    BLOCK,
    EXTERNAL_HITS,
    EXTERNAL_QUERIES,
    LOAD_BYTES,
    MAX_TOKENS,
    PROMPT_TOKENS,
    STORE_BYTES,
    Restart,
    store_blocks,
)

pytestmark = pytest.mark.e2e


def test_serve_restart_same_output_from_store(served_restart: Restart) -> None:
    run = served_restart
    root, before, after, full_blocks = run.root, run.before, run.after, run.full_blocks

    assert len(run.tokens_first) == MAX_TOKENS
    assert run.tokens_second == run.tokens_first
    # The first server found nothing in the empty store and stored the prompt.
    assert before.get(EXTERNAL_HITS, 0.0) == 0
    assert before.get(STORE_BYTES, 0.0) > 0
    # The restarted server took every full prompt block from the store (vLLM's own counters).
    assert after[EXTERNAL_QUERIES] >= PROMPT_TOKENS - 1
    assert after[EXTERNAL_HITS] == full_blocks * BLOCK
    assert after[LOAD_BYTES] > 0
    # Both servers stopped: the prompt's blocks, each once, nothing half-written, all verified.
    assert store_blocks(root) == full_blocks
    assert temp_files(root) == []
    verify = kvstore_verify(root)
    assert verify.returncode == 0, verify.stdout + verify.stderr
