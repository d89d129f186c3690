"""Host-pool layouts <-> canonical share rows (connector.sglang.pages), against an element-wise
reference of each layout. Runs without SGLang (fake pools with SGLang's buffer shapes)."""

from __future__ import annotations

import itertools

import pytest
import torch

from connector.sglang.pages import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PoolPages,
    flat_page_buffers,
    pool_buffers,
    pool_geometry,
)
from kvstore import ConfigError
from tests.sglang.fakes import FakeMHAPool, FakeMLAPool, mha_element, mla_element

T, L, H, D = 4, 3, 2, 8


def _mha(layout: str, seed: int = 0) -> FakeMHAPool:
    pool = FakeMHAPool(layout, page_size=T, layer_num=L, head_num=H, head_dim=D)
    pool.fill_random(seed)
    return pool


def _mla(layout: str, seed: int = 0) -> FakeMLAPool:
    pool = FakeMLAPool(layout, page_size=T, layer_num=L, kv_lora_rank=8, qk_rope_head_dim=4)
    pool.fill_random(seed)
    return pool


def _mha_reference(pool: FakeMHAPool, page: int) -> torch.Tensor:
    """The canonical share of one page, element by element: [H][L][T][K|V][D]."""
    out = torch.empty((H, L, T, 2, D), dtype=pool.dtype)
    for h, layer, tok, kv, d in itertools.product(range(H), range(L), range(T), range(2), range(D)):
        out[h, layer, tok, kv, d] = mha_element(
            pool.layout, pool.kv_buffer, T, page, (kv, h, layer, tok, d)
        )
    return out


def _mla_reference(pool: FakeMLAPool, page: int) -> torch.Tensor:
    c = pool.kv_cache_dim
    out = torch.empty((L, T, c), dtype=pool.dtype)
    for layer, tok, i in itertools.product(range(L), range(T), range(c)):
        out[layer, tok, i] = mla_element(pool.layout, pool.buffers(), T, page, (layer, tok, i))
    return out


def _pages(pool: object) -> PoolPages:
    geometry = pool_geometry(pool)
    return PoolPages(geometry, pool_buffers(pool, geometry))


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_mha_gather_is_the_canonical_share(layout: str) -> None:
    pool = _mha(layout)
    pages = _pages(pool)
    rows = pages.gather(torch.tensor([3, 1]))
    assert rows.dtype == torch.uint8 and rows.shape == (2, H * L * T * 2 * D * 2)
    for row, page in zip(rows, (3, 1), strict=True):
        got = row.view(torch.bfloat16).reshape(H, L, T, 2, D)
        assert torch.equal(got, _mha_reference(pool, page))


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_gather_is_the_canonical_share(layout: str) -> None:
    pool = _mla(layout)
    pages = _pages(pool)
    rows = pages.gather(torch.tensor([2, 5]))
    for row, page in zip(rows, (2, 5), strict=True):
        got = row.view(torch.bfloat16).reshape(L, T, pool.kv_cache_dim)
        assert torch.equal(got, _mla_reference(pool, page))


POOLS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


def _pool(kind: str, layout: str, seed: int = 0) -> FakeMHAPool | FakeMLAPool:
    return _mha(layout, seed) if kind == "mha" else _mla(layout, seed)


@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_scatter_writes_exactly_the_pages_named(kind: str, layout: str) -> None:
    rows = _pages(_pool(kind, layout)).gather(torch.tensor([0, 4]))
    target = _pool(kind, layout, seed=99)
    before = [b.clone() for b in _buffers(target)]
    dest = _pages(target)
    dest.scatter(torch.tensor([5, 2]), rows)
    assert torch.equal(dest.gather(torch.tensor([5, 2])), rows)
    # Every other page is untouched.
    untouched = torch.tensor([0, 1, 3, 4])
    assert torch.equal(dest.gather(untouched), PoolPages(dest.geometry, before).gather(untouched))


def _buffers(pool: FakeMHAPool | FakeMLAPool) -> list[torch.Tensor]:
    return pool.buffers() if isinstance(pool, FakeMLAPool) else [pool.kv_buffer]


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_flat_page_is_one_page_of_its_layout(layout: str) -> None:
    """The generic interface's flat pages (SGLang's get_data_page slicing) map like pool pages."""
    pool = _mha(layout)
    pages = _pages(pool)
    page = 4
    if layout == "layer_first":
        flat = pool.kv_buffer[:, :, page * T : (page + 1) * T].flatten()
    elif layout == "page_first":
        flat = pool.kv_buffer[:, page * T : (page + 1) * T].flatten()
    else:
        flat = pool.kv_buffer[:, page : page + 1].flatten()
    one = PoolPages(pages.geometry, flat_page_buffers(pages.geometry, flat))
    first = torch.zeros(1, dtype=torch.int64)
    assert torch.equal(one.gather(first), pages.gather(torch.tensor([page])))
    blank = torch.zeros_like(flat)
    PoolPages(pages.geometry, flat_page_buffers(pages.geometry, blank)).scatter(
        first, pages.gather(torch.tensor([page]))
    )
    assert torch.equal(blank, flat)


def test_page_ids_accept_whole_pages_only() -> None:
    pages = _pages(_mha("page_first"))
    ids = pages.page_ids(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 2)
    assert ids.tolist() == [2, 0]
    with pytest.raises(ConfigError, match="expected 2 keys x 4 token slots = 8, got 7"):
        pages.page_ids(torch.arange(7), 2)
    with pytest.raises(ConfigError, match="whole pages"):
        pages.page_ids(torch.tensor([1, 2, 3, 4]), 1)
    with pytest.raises(ConfigError, match="whole pages"):
        pages.page_ids(torch.tensor([0, 1, 3, 2]), 1)
    with pytest.raises(ConfigError, match="outside the pool's 6 pages"):
        pages.page_ids(torch.arange(24, 28), 1)


def test_unsupported_pools_are_refused_clearly() -> None:
    pool = _mha("page_first")
    pool.layout = "page_unified"
    with pytest.raises(ConfigError, match="layout 'page_unified' is not supported"):
        pool_geometry(pool)
    pool = _mha("page_first")
    pool.v_head_dim = 4
    with pytest.raises(ConfigError, match="K and V of one width"):
        pool_geometry(pool)
    pool = _mha("page_first")
    geometry = pool_geometry(pool)
    with pytest.raises(ConfigError, match="expected shape"):
        PoolPages(geometry, [pool.kv_buffer[:, :, :2]])
    with pytest.raises(ConfigError, match="contiguous"):
        PoolPages(geometry, [torch.zeros((2, L, 8, H, D), dtype=torch.bfloat16).transpose(1, 2)])
