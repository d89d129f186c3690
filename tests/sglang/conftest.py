"""The SGLang tier's guard: with ``KVTEST_SGLANG_REQUIRED=1`` (``.ci/run``'s SGLang tier) a venv
without SGLang fails at collection instead of skipping the tests that need it."""

from __future__ import annotations

import os

if os.environ.get("KVTEST_SGLANG_REQUIRED") == "1":
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401 - missing: the tier fails here
