"""What the connector needs to know about the engine, read once from vLLM's configs.

vLLM hands an ``OffloadingSpec`` only an ``OffloadingConfig``, which lacks facts the store
identity and the parallel mapping need: the prefix-hash algorithm, the model revision, the
KV head count of the whole model, each group's attention kind and head geometry, the
DCP/PCP interleave, the load-failure policy. :class:`connector.KVStoreConnector`
reads them from ``VllmConfig`` / ``KVCacheConfig`` here (:func:`engine_facts`) and hands them
to the spec it is about to build through :func:`provide` (a context variable scoped to the
connector's constructor). A spec built any other way finds no facts and refuses to start.

This module and the rest of :mod:`connector` are the only code that imports vLLM.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from connector import compat
from kvstore.identity import DTYPES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

GroupKind = Literal["full", "sliding", "mla"]


@dataclass(frozen=True)
class GroupFacts:
    """One KV-cache group as this process's ``KVCacheConfig`` describes it."""

    group_id: int  # vLLM's KVCacheConfig group index (the group id inside OffloadKey)
    layer_names: tuple[str, ...]  # vLLM's order (the order of CanonicalKVCaches refs)
    kind: GroupKind | None  # None: a spec kvstore cannot store (see ``unsupported``)
    unsupported: str = ""  # why, when kind is None
    num_kv_heads: int = 1  # heads held by one rank (vLLM spec), 1 for MLA
    head_size: int = 0  # attention: elements of K (and of V) per head and token
    latent_dim: int = 0  # MLA: elements of the latent per token
    sliding_window: int = 0  # tokens, sliding groups only
    block_size: int = 0  # tokens per GPU block on one rank
    itemsize: int = 0  # bytes per stored element
    page_bytes: int = 0  # unpadded bytes of one layer's page of one block on one rank


@dataclass(frozen=True)
class EngineFacts:
    """Engine facts beyond ``OffloadingConfig``; identical in every process of an engine."""

    hash_algo: str  # cache_config.prefix_caching_hash_algo
    model_revision: str  # model_config.revision, "" when unset
    kv_dtype: str  # element type of the KV cache, a kvstore dtype name ("" if unsupported)
    kv_dtype_problem: str  # why kv_dtype is unsupported, else ""
    kv_load_failure_policy: str  # "recompute" or "fail"
    kv_cache_layout: str  # resolved KVCacheLayout name, e.g. "LBHNC"
    total_kv_heads: int  # KV heads of the whole model
    tp: int
    pp: int
    dcp: int
    pcp: int
    interleave: int  # cp_kv_cache_interleave_size
    groups: tuple[GroupFacts, ...]  # every group of the KVCacheConfig, by group id
    hash_lookahead_tokens: int = 0  # vLLM 0.34: tokens past each block in its hash (spec decode)

    def group(self, group_id: int) -> GroupFacts:
        for facts in self.groups:
            if facts.group_id == group_id:
                return facts
        raise KeyError(group_id)


_FACTS: contextvars.ContextVar[EngineFacts | None] = contextvars.ContextVar(
    "kvstore_engine_facts", default=None
)


@contextmanager
def provide(facts: EngineFacts) -> Iterator[None]:
    """Make ``facts`` visible to specs constructed inside the ``with`` block."""
    token = _FACTS.set(facts)
    try:
        yield
    finally:
        _FACTS.reset(token)


def current() -> EngineFacts | None:
    """The facts provided by the enclosing :func:`provide`, if any."""
    return _FACTS.get()


def engine_facts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineFacts:
    """Read the facts from vLLM's configs (no I/O, no side effects)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    transfer = vllm_config.kv_transfer_config
    kv_dtype, problem = _kv_dtype(cache.cache_dtype, model.dtype)
    layout = cache.kv_cache_layout or kv_cache_config.kv_cache_layout or ""
    return EngineFacts(
        hash_algo=str(cache.prefix_caching_hash_algo),
        model_revision=str(model.revision or ""),
        kv_dtype=kv_dtype,
        kv_dtype_problem=problem,
        kv_load_failure_policy=str(transfer.kv_load_failure_policy) if transfer else "fail",
        kv_cache_layout=str(getattr(layout, "name", layout)),
        total_kv_heads=int(model.get_total_num_kv_heads()),
        tp=int(parallel.tensor_parallel_size),
        pp=int(parallel.pipeline_parallel_size),
        dcp=int(parallel.decode_context_parallel_size),
        pcp=int(parallel.prefill_context_parallel_size),
        interleave=int(parallel.cp_kv_cache_interleave_size),
        groups=tuple(
            _group_facts(group_id, tuple(group.layer_names), group.kv_cache_spec)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        ),
        hash_lookahead_tokens=compat.hash_lookahead_tokens(vllm_config),
    )


def _kv_dtype(cache_dtype: str, model_dtype: object) -> tuple[str, str]:
    """The kvstore dtype name of the cache elements, or ``("", reason)``."""
    if cache_dtype == "auto":
        name = str(model_dtype).removeprefix("torch.")
    elif cache_dtype in ("fp8", "fp8_e4m3"):
        name = str(current_platform.fp8_dtype()).removeprefix("torch.")
    else:
        name = {
            "half": "float16",
            "float16": "float16",
            "bfloat16": "bfloat16",
            "float": "float32",
            "float32": "float32",
            "fp8_e5m2": "float8_e5m2",
        }.get(cache_dtype, "")
    if name not in DTYPES:
        return "", (
            f"kv cache dtype {cache_dtype!r} (elements {name or 'with scales or packing'}) "
            f"has no canonical byte form in kvstore; supported: auto with a model dtype in "
            f"{sorted(DTYPES)}, float16, bfloat16, float32, fp8, fp8_e4m3, fp8_e5m2"
        )
    return name, ""


def _group_facts(group_id: int, layer_names: tuple[str, ...], spec: KVCacheSpec) -> GroupFacts:
    """Classify one group's spec; what kvstore cannot store gets ``kind=None`` and a reason."""

    def refuse(reason: str) -> GroupFacts:
        return GroupFacts(group_id, layer_names, None, f"{type(spec).__name__}: {reason}")

    reason = _unsupported_spec(spec)
    if reason is not None:
        return refuse(reason)
    assert isinstance(spec, FullAttentionSpec | SlidingWindowSpec)  # MLA subclasses Full
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    reason = _page_mismatch(spec, itemsize)
    if reason is not None:
        return refuse(reason)
    page = spec.unpadded_page_size_bytes
    if isinstance(spec, MLAAttentionSpec):
        return GroupFacts(
            group_id,
            layer_names,
            "mla",
            latent_dim=spec.head_size,
            block_size=spec.block_size,
            itemsize=itemsize,
            page_bytes=page,
        )
    sliding = isinstance(spec, SlidingWindowSpec)
    return GroupFacts(
        group_id,
        layer_names,
        "sliding" if sliding else "full",
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        sliding_window=spec.sliding_window if isinstance(spec, SlidingWindowSpec) else 0,
        block_size=spec.block_size,
        itemsize=itemsize,
        page_bytes=page,
    )


def _unsupported_spec(spec: KVCacheSpec) -> str | None:
    """Why pages of ``spec``'s kind have no canonical form kvstore can store, or None."""
    if type(spec) not in (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec):
        return (
            "only full attention, sliding-window attention and MLA groups have a canonical "
            "page form"
        )
    assert isinstance(spec, FullAttentionSpec | SlidingWindowSpec)  # MLA subclasses Full
    if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        return f"quantization {spec.kv_quant_mode.name} keeps scales or packing in pages"
    if spec.num_head_slots is not None or spec.state_content_bytes is not None:
        return "packed head slots / state content are backend-specific page forms"
    if spec.tokens_per_state != 1:
        return f"tokens_per_state={spec.tokens_per_state} (expected 1 state per token)"
    return None


def _page_mismatch(spec: FullAttentionSpec | SlidingWindowSpec, itemsize: int) -> str | None:
    """Why ``spec``'s page is not the dense geometry its fields describe, or None."""
    page = spec.unpadded_page_size_bytes
    if isinstance(spec, MLAAttentionSpec):
        if page != spec.block_size * spec.head_size * itemsize:
            return f"MLA page of {page} bytes is not block_size x latent x itemsize"
        return None
    if spec.head_size_v != spec.head_size:
        return f"head_size_v={spec.head_size_v} differs from head_size={spec.head_size}"
    if page != spec.num_kv_heads * spec.block_size * 2 * spec.head_size * itemsize:
        return f"page of {page} bytes is not heads x block_size x 2 x head_size x itemsize"
    return None
