"""Stand-ins for SGLang's host pools and storage config, for the tests that run without SGLang.

They carry exactly the attributes :mod:`connector.sglang` reads, with buffers of the shapes
SGLang 0.5.23 allocates (``pool_host/mha.py`` / ``mla.py`` ``init_kv_buffer``); the tests with
SGLang's own objects (test_sglang_*.py, in SGLang's venv) check the same code against them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

MHA_SHAPES: dict[str, Callable[[int, int, int, int, int], tuple[int, ...]]] = {
    "layer_first": lambda p, t, layers, h, d: (2, layers, p * t, h, d),
    "page_first": lambda p, t, layers, h, d: (2, p * t, layers, h, d),
    "page_first_direct": lambda p, t, layers, h, d: (2, p, layers, t, h, d),
    "page_head": lambda p, t, layers, h, d: (2, p, h, t, layers, d),
}
MLA_SHAPES: dict[str, Callable[[int, int, int, int], tuple[int, ...]]] = {
    "layer_first": lambda p, t, layers, c: (layers, p * t, 1, c),
    "page_first": lambda p, t, layers, c: (p * t, layers, 1, c),
    "page_first_direct": lambda p, t, layers, c: (p, layers, t, 1, c),
}


def mha_element(
    layout: str, buf: torch.Tensor, t: int, page: int, spec: tuple[int, int, int, int, int]
) -> torch.Tensor:
    """Element (kv, head, layer, token, dim) of ``page`` (``t`` tokens per page), indexed as
    SGLang's flat-page code slices each layout (an independent statement of each)."""
    kv, h, layer, tok, d = spec
    if layout == "layer_first":
        return buf[kv, layer, page * t + tok, h, d]
    if layout == "page_first":
        return buf[kv, page * t + tok, layer, h, d]
    if layout == "page_first_direct":
        return buf[kv, page, layer, tok, h, d]
    return buf[kv, page, h, tok, layer, d]  # page_head


def mla_element(
    layout: str, bufs: list[torch.Tensor], t: int, page: int, spec: tuple[int, int, int]
) -> torch.Tensor:
    """Element (layer, token, latent index) of ``page`` of an MLA pool."""
    layer, tok, c = spec
    if layout == "page_first_kv_split":
        k, v = bufs
        width = k.shape[-1]
        return k[page, layer, tok, 0, c] if c < width else v[page, layer, tok, 0, c - width]
    (buf,) = bufs
    if layout == "layer_first":
        return buf[layer, page * t + tok, 0, c]
    if layout == "page_first":
        return buf[page * t + tok, layer, 0, c]
    return buf[page, layer, tok, 0, c]  # page_first_direct


@dataclass
class FakeMHAPool:
    layout: str
    page_size: int
    layer_num: int
    head_num: int
    head_dim: int
    pages: int = 6
    dtype: torch.dtype = torch.bfloat16
    start_layer: int = 0
    kv_buffer: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        shape = MHA_SHAPES[self.layout](
            self.pages, self.page_size, self.layer_num, self.head_num, self.head_dim
        )
        self.kv_buffer = torch.zeros(shape, dtype=self.dtype)
        self.v_head_dim = self.head_dim

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.dtype))


@dataclass
class FakeMLAPool:
    layout: str
    page_size: int
    layer_num: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    pages: int = 6
    dtype: torch.dtype = torch.bfloat16
    start_layer: int = 0

    def __post_init__(self) -> None:
        self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
        t, layers = self.page_size, self.layer_num
        if self.layout == "page_first_kv_split":
            self.k_buffer = torch.zeros(
                (self.pages, layers, t, 1, self.kv_lora_rank), dtype=self.dtype
            )
            self.v_buffer = torch.zeros(
                (self.pages, layers, t, 1, self.qk_rope_head_dim), dtype=self.dtype
            )
        else:
            shape = MLA_SHAPES[self.layout](self.pages, t, layers, self.kv_cache_dim)
            self.kv_buffer = torch.zeros(shape, dtype=self.dtype)

    def buffers(self) -> list[torch.Tensor]:
        if self.layout == "page_first_kv_split":
            return [self.k_buffer, self.v_buffer]
        return [self.kv_buffer]

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for b in self.buffers():
            b.copy_(torch.randn(b.shape, generator=g).to(self.dtype))


@dataclass
class FakeStorageConfig:
    """SGLang's HiCacheStorageConfig fields the backend reads."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_size: int = 1
    dcp_rank: int = 0
    is_mla_model: bool = False
    model_name: str | None = "test/model"
    extra_config: dict[str, Any] | None = None
