"""A vLLM 0.33 engine on CPU around kvstore's connector, for the connector tests.

:class:`Engine` builds what ``vllm serve`` would, minus the model and the processes: a real
``VllmConfig`` from a tiny local model config (no network, no tokenizer), a real KV-cache plan
(vLLM's ``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups``) and real KV tensors
(``allocate_kv_cache``), vLLM's real ``Scheduler`` with :class:`KVStoreConnector` in the
scheduler role, and one :class:`KVStoreConnector` in the worker role **per simulated TP rank**,
each with its own ``VllmConfig`` (``parallel_config.rank``) and its own KV tensors holding that
rank's heads. A step runs the scheduler, hands every rank its own unpickled copy of the
connector metadata (as the RPC does), fakes the forward pass by writing deterministic KV for the
scheduled tokens (each rank writes its heads), collects each rank's connector output, aggregates
them with vLLM's ``KVOutputAggregator`` and feeds the result to ``update_from_output``.

The ranks run in one process, so this exercises the per-rank mappings, the writer election, the
per-worker completion counting and the aggregation of failure reports, but not vLLM's worker
processes, NCCL or CUDA streams.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload import base as offload_base
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

import connector
from connector.offload.manager import KVStoreManager
from connector.offload.vllm_connector import KVStoreConnector
from connector.offload.worker import KVStoreWorker

# vLLM 0.34 hands the offloading worker resolved device pointers, not GPU block ids.
VLLM_PASSES_POINTERS = hasattr(offload_base, "DevicePointers")
# vLLM 0.34 dropped ModelRunnerOutput.req_id_to_index, which 0.33 requires.
_HAS_REQ_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def _req_index(ids: list[str]) -> dict[str, Any]:
    return {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if _HAS_REQ_INDEX else {}


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODELS = Path(__file__).parent / "models"
BLOCK = 16  # tokens per GPU block (per rank; a block spans BLOCK x dcp tokens)
HEAD = 8  # tiny models: head_dim 8, 4 KV heads (tiny_mqa: 1)
LATENT = 24  # MLA engines: one latent vector of 24 elements per token, on every TP rank
SLIDING_WINDOW = 32

init_none_hash(sha256)  # what EngineCore does at startup (no PYTHONHASHSEED: vLLM's seed)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def kv_value(layer: int, pos: int, token: int, heads: int, width: int) -> torch.Tensor:
    """The KV the fake model writes for one token: (heads, width) fp16 (K then V per head,
    or the MLA latent)."""
    g = torch.Generator().manual_seed(layer * 1_000_003 + pos * 7919 + token)
    return torch.randn(heads, width, generator=g).to(torch.float16)


@dataclass
class EngineOptions:
    root: Path
    model: str = "tiny_llama"  # directory under models/
    tp: int = 1
    dcp: int = 1  # decode context parallel: a block's tokens are interleaved over dcp ranks
    block_size: int = BLOCK  # --block-size: tokens per GPU block on one rank
    layout: str = "LBHNC"  # resolved KV-cache layout (per-layer or packed)
    hybrid: bool = False  # layers alternate full / sliding-window attention (HMA groups)
    mla: bool = False  # MLA layers: one latent per token, replicated on every TP rank
    num_blocks: int = 64
    extra: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config keys
    policy: str = "recompute"
    connector_name: str = "KVStoreConnector"
    module_path: str | None = "connector"  # None: vLLM's registry (its own connectors)
    hash_algo: str = "sha256"


@dataclass
class Rank:
    connector: KVStoreConnector
    kv: dict[str, torch.Tensor]
    heads: slice  # the model's KV heads this rank holds
    token_shard: int  # DCP rank: which interleaved tokens of a block this rank holds

    @property
    def worker(self) -> KVStoreWorker:
        worker = self.connector.kvstore_worker
        assert worker is not None
        return worker


def vllm_config(options: EngineOptions, rank: int) -> VllmConfig:
    model = ModelConfig(
        model=str(MODELS / options.model),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=4096,
    )
    cache = CacheConfig(
        block_size=options.block_size,
        cache_dtype="auto",
        enable_prefix_caching=True,
        prefix_caching_hash_algo=options.hash_algo,  # type: ignore[arg-type, unused-ignore]
    )
    cache.kv_cache_layout = options.layout  # normally resolved by the engine core
    extra: dict[str, Any] = connector.kv_transfer_config(str(options.root))[
        "kv_connector_extra_config"
    ]
    extra.update(durability="none", io_threads=2, **options.extra)
    transfer = KVTransferConfig(
        kv_connector=options.connector_name,
        kv_connector_module_path=options.module_path,
        kv_role="kv_both",
        kv_load_failure_policy=options.policy,  # type: ignore[arg-type, unused-ignore]
        kv_connector_extra_config=extra,
        engine_id="test-engine",
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=512,
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        cache_config=cache,
        kv_transfer_config=transfer,
        parallel_config=ParallelConfig(
            tensor_parallel_size=options.tp, decode_context_parallel_size=options.dcp
        ),
        device_config=DeviceConfig("cpu"),
        attention_config=AttentionConfig(),
    )
    config.parallel_config.rank = rank
    if options.hybrid:
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def layer_specs(
    options: EngineOptions, num_layers: int, total_heads: int
) -> dict[str, KVCacheSpec]:
    heads = max(1, total_heads // options.tp)
    specs: dict[str, KVCacheSpec] = {}
    for i in range(num_layers):
        if options.mla:
            specs[layer_name(i)] = MLAAttentionSpec(
                block_size=options.block_size, num_kv_heads=1, head_size=LATENT, dtype=torch.float16
            )
        elif options.hybrid and i % 2:
            specs[layer_name(i)] = SlidingWindowSpec(
                block_size=options.block_size,
                num_kv_heads=heads,
                head_size=HEAD,
                dtype=torch.float16,
                sliding_window=SLIDING_WINDOW,
            )
        else:
            specs[layer_name(i)] = FullAttentionSpec(
                block_size=options.block_size,
                num_kv_heads=heads,
                head_size=HEAD,
                dtype=torch.float16,
            )
    return specs


class Engine:
    """Scheduler + connectors of one engine (see the module docstring)."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        configs = [vllm_config(options, r) for r in range(options.tp)]
        self.config = configs[0]
        num_layers = self.config.model_config.get_total_num_hidden_layers()
        self.heads = 1 if options.mla else self.config.model_config.get_total_num_kv_heads()
        self.width = LATENT if options.mla else 2 * HEAD  # elements per (head, token)
        self.span = options.block_size * options.dcp  # tokens of a block, all DCP ranks
        specs = layer_specs(options, num_layers, self.heads)
        with set_current_vllm_config(self.config):
            groups = get_kv_cache_groups(self.config, specs)
            page = sum(specs[g.layer_names[0]].page_size_bytes for g in groups)
            per_rank = []
            for r in range(options.tp):
                kcc = get_kv_cache_config_from_groups(
                    configs[r], groups, options.num_blocks * page * 2
                )
                kcc.kv_cache_layout = options.layout
                per_rank.append(kcc)
        self.kv_cache_config: KVCacheConfig = per_rank[0]
        block_size, hash_block_size = resolve_kv_cache_block_sizes(per_rank[0], self.config)
        assert block_size == hash_block_size == self.span
        for config, kcc in zip(configs, per_rank, strict=True):
            config.cache_config.num_gpu_blocks = kcc.num_blocks
            kcc.hash_block_size = hash_block_size  # as EngineCore sets it
        self.hasher = get_request_block_hasher(hash_block_size, sha256)
        self.groups = [list(g.layer_names) for g in self.kv_cache_config.kv_cache_groups]
        self.ranks: list[Rank] = []
        per_head = max(1, self.heads // options.tp)
        replication = max(1, options.tp // self.heads)
        for r in range(options.tp):
            with set_current_vllm_config(configs[r]):
                kv = allocate_kv_cache(
                    per_rank[r], torch.device("cpu"), KVCacheLayout[options.layout]
                )
                conn = KVConnectorFactory.create_connector(
                    configs[r], KVConnectorRole.WORKER, per_rank[r]
                )
                assert isinstance(conn, KVStoreConnector)
                conn.register_kv_caches(kv)
            first = (r // replication) * per_head
            heads = slice(first, first + per_head)
            self.ranks.append(Rank(conn, kv, heads, token_shard=r % options.dcp))
        with set_current_vllm_config(self.config):
            self.scheduler = Scheduler(
                vllm_config=self.config,
                kv_cache_config=generate_scheduler_kv_cache_config(per_rank),
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=block_size,
                hash_block_size=hash_block_size,
            )
        self.aggregator = KVOutputAggregator(expected_finished_count=options.tp)
        self.forward_ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        # req_id -> token positions the fake forward computed (not loaded)
        self.computed: dict[str, set[int]] = {}
        self.requests: dict[str, Request] = {}
        # when a request is first scheduled: tokens it started with, whether their KV was
        # exact, and how many positions per group were checked
        self.first_start: dict[str, int] = {}
        self.prefix_ok: dict[str, bool] = {}
        self.prefix_checked: dict[str, list[int]] = {}

    # -- accessors -----------------------------------------------------------------------------

    @property
    def manager(self) -> KVStoreManager:
        conn = self.scheduler.connector
        assert isinstance(conn, KVStoreConnector)
        manager = conn.kvstore_manager
        assert manager is not None
        return manager

    def layer_index(self, name: str) -> int:
        return int(name.split(".")[2])

    # -- requests and steps --------------------------------------------------------------------

    def add(
        self, req_id: str, prompt: list[int], max_tokens: int = 2, cache_salt: str | None = None
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, 2)
        request = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.hasher,
            cache_salt=cache_salt,
        )
        self.scheduler.add_request(request)
        self.requests[req_id] = request
        self.computed[req_id] = set()
        return request

    def step(self) -> None:
        out = self.scheduler.schedule()
        raw_meta = pickle.dumps(out.kv_connector_metadata)  # what the RPC carries
        for req_id, n in out.num_scheduled_tokens.items():
            if req_id not in self.first_start:
                start = self.scheduler.requests[req_id].num_computed_tokens - n
                self._check_prefix(req_id, start)
        outputs: list[ModelRunnerOutput | None] = []
        ids = list(out.num_scheduled_tokens)
        for rank in self.ranks:
            meta = pickle.loads(raw_meta)
            conn = rank.connector
            conn.handle_preemptions(meta)
            conn.bind_connector_metadata(meta)
            # vLLM 0.34 starts async loads (and the stores deferred from the last step) after
            # the forward, sync loads before it; 0.32/0.33 start everything before it.
            loads_first = getattr(out, "has_sync_kv_loads", True)
            if loads_first:
                conn.start_load_kv(self.forward_ctx)
            self._forward(rank, out.num_scheduled_tokens)
            conn.finish_forward()
            if not loads_first:
                conn.start_load_kv(self.forward_ctx)
            conn.wait_for_save()  # type: ignore[no-untyped-call, unused-ignore]
            results = conn.get_transfer_results(out.finished_req_ids)
            invalid = conn.get_block_ids_with_load_errors()
            worker_meta = conn.build_connector_worker_meta()
            conn.clear_connector_metadata()
            kv_output = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=pickle.loads(pickle.dumps(worker_meta)),
            )
            outputs.append(
                ModelRunnerOutput(
                    req_ids=ids,
                    sampled_token_ids=[[5] for _ in ids],
                    kv_connector_output=kv_output,
                    **_req_index(ids),
                )
            )
        merged = self.aggregator.aggregate(outputs, 0)
        assert merged is not None
        self.scheduler.update_from_output(out, merged)

    def _slot(self, rank: Rank, pos: int) -> int | None:
        """Slot of token ``pos`` in its block on ``rank``, None if another DCP rank holds it
        (vLLM interleaves a block's tokens over the DCP ranks, interleave size 1)."""
        if pos % self.options.dcp != rank.token_shard:
            return None
        return (pos % self.span) // self.options.dcp

    def _forward(self, rank: Rank, scheduled: dict[str, int]) -> None:
        """Write deterministic KV of the scheduled tokens (this rank's share) into its cache."""
        for req_id, n in scheduled.items():
            request = self.scheduler.requests[req_id]
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            start = request.num_computed_tokens - n  # schedule() already advanced it
            tokens = request.all_token_ids
            for pos in range(start, start + n):
                self.computed[req_id].add(pos)
                slot = self._slot(rank, pos)
                if slot is None:
                    continue
                token = tokens[pos] if pos < len(tokens) else 0
                for group, names in enumerate(self.groups):
                    block = block_ids[group][pos // self.span]
                    if block == 0:  # null block (outside a sliding window)
                        continue
                    for name in names:
                        value = kv_value(self.layer_index(name), pos, token, self.heads, self.width)
                        rank.kv[name][block, :, slot, :] = value[rank.heads]

    def busy(self) -> bool:
        if self.scheduler.has_unfinished_requests() or self.manager.has_pending_work():
            return True
        return any(rank.worker.jobs_in_flight for rank in self.ranks)

    def settle(self) -> None:
        """(:meth:`run`, once idle) Finish what the scheduler side still holds back."""
        self.manager.drain()

    def run(self, max_steps: int = 400) -> None:
        """Step until every request finished and every transfer was reported and published."""
        idle = 0
        for _ in range(max_steps):
            self.step()
            if self.busy():
                idle = 0
                time.sleep(0.002)
                continue
            idle += 1
            if idle >= 3:  # deferred stores are submitted one step late
                self.settle()
                if not self.busy():
                    return
        raise AssertionError(f"engine still busy after {max_steps} steps")

    def serve(self, req_id: str, prompt: list[int], **kwargs: Any) -> Request:
        request = self.add(req_id, prompt, **kwargs)
        self.run()
        return request

    # -- checks --------------------------------------------------------------------------------

    def _check_prefix(self, req_id: str, start: int) -> None:
        """When a request is first scheduled, the KV of its first ``start`` tokens (loaded or
        prefix-cached, never computed here) must already be exact on every rank."""
        request = self.scheduler.requests[req_id]
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        tokens = request.all_token_ids
        ok = True
        checked = [0] * len(self.groups)
        for group, names in enumerate(self.groups):
            for pos in range(start):
                block = block_ids[group][pos // self.span]
                if block == 0:  # outside a sliding window: never loaded
                    continue
                checked[group] += 1
                for name in names:
                    expected = kv_value(
                        self.layer_index(name), pos, tokens[pos], self.heads, self.width
                    )
                    for rank in self.ranks:
                        slot = self._slot(rank, pos)
                        if slot is not None:
                            got = rank.kv[name][block, :, slot, :]
                            ok &= torch.equal(got, expected[rank.heads])
        self.first_start[req_id] = start
        self.prefix_ok[req_id] = ok
        self.prefix_checked[req_id] = checked

    def wipe_kv(self) -> None:
        for rank in self.ranks:
            for tensor in rank.kv.values():
                tensor.zero_()

    def shutdown(self) -> None:
        self.scheduler.connector.shutdown()  # type: ignore[union-attr, unused-ignore]
        for rank in self.ranks:
            rank.connector.shutdown()


def prompt(n_tokens: int, start: int = 100) -> list[int]:
    return list(range(start, start + n_tokens))


def gpu_side(rank: Rank, block_ids: list[int], group_sizes: list[int]) -> Any:
    """A job's GPU side as this vLLM hands it to the worker: a ``GPULoadStoreSpec`` (0.33),
    or the ``DevicePointers`` vLLM 0.34 resolves from it against the rank's KV caches."""
    spec = GPULoadStoreSpec(
        block_ids, group_sizes=group_sizes, block_indices=[0] * len(group_sizes)
    )
    if not VLLM_PASSES_POINTERS:
        return spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # noqa: PLC0415

    worker = rank.connector.connector_worker
    assert worker is not None
    return resolve_device_pointers(spec, worker._kv_caches)  # type: ignore[attr-defined, unused-ignore]  # 0.34
