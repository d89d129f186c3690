"""SGLang 0.5.23's own KV pools on CPU for the tests that drive real SGLang objects
(test_sglang_backend.py, and the rank processes of sglang_rank.py): a device pool and the host
pool SGLang builds over it, inside SGLang's host-memory budget scope (it refuses a host pool
when the machine's free memory minus its reserve is short). Imports SGLang when called."""

from __future__ import annotations

from typing import Any

import torch

HOST_BUDGET = 4 << 30


def mha_pools(
    layout: str, size: int, page: int, heads: int, head_dim: int, layers: int
) -> tuple[Any, Any]:
    """An MHA device pool of ``size`` token slots and its host pool in ``layout``."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: PLC0415

    device = MHATokenToKVPool(
        size, page, torch.bfloat16, heads, head_dim, layers, "cpu", False,
        start_layer=0, end_layer=layers,
    )  # fmt: skip
    with host_memory_budget_scope(HOST_BUDGET):
        host = MHATokenToKVPoolHost(
            device._mha_buffer_info(), 2, 0, page, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=size, start_layer=0, end_layer=layers,
        )  # fmt: skip
    return device, host


def mla_pools(
    layout: str, size: int, page: int, kv_lora_rank: int, rope_dim: int, layers: int
) -> tuple[Any, Any]:
    """An MLA device pool of ``size`` token slots and its host pool in ``layout``."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: PLC0415

    device = MLATokenToKVPool(
        size, page, torch.bfloat16, kv_lora_rank, rope_dim, layers, "cpu", False,
        start_layer=0, end_layer=layers,
    )  # fmt: skip
    with host_memory_budget_scope(HOST_BUDGET):
        host = MLATokenToKVPoolHost(
            device._mla_buffer_info(), 2, 0, page, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=size, start_layer=0, end_layer=layers, target_layer_num=layers,
        )  # fmt: skip
    return device, host


def fill(buffer: torch.Tensor, seed: int) -> None:
    """Random values of the buffer's dtype, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    buffer.copy_(torch.randn(buffer.shape, generator=g).to(buffer.dtype))
