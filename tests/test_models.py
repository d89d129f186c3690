"""The model catalog: group structure and global layer ids of real models."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.models import layer_name, load_model, model_names


def test_catalog_names() -> None:
    assert model_names() == [
        "deepseek-v3",
        "gemma-3-1b",
        "gpt-oss-20b",
        "llama-3.1-70b",
        "llama-3.1-8b",
        "qwen2.5-7b",
        "qwen3-32b",
    ]


def test_unknown_model() -> None:
    with pytest.raises(ConfigError, match=r"model: expected one of .*got 'llama-9'"):
        load_model("llama-9")


def test_single_group_model() -> None:
    model = load_model("llama-3.1-8b")
    assert model.hf_id == "meta-llama/Llama-3.1-8B"
    assert model.kv_dtype == "bfloat16"
    assert model.num_hidden_layers == 32
    (group,) = model.groups
    assert (group.kind, group.num_kv_heads, group.head_dim) == ("full", 8, 128)
    assert group.layer_ids == tuple(range(32))


def test_gpt_oss_even_odd_layers() -> None:
    model = load_model("gpt-oss-20b")
    assert model.num_hidden_layers == 24
    sliding, full = model.groups
    assert sliding.kind == "sliding"
    assert sliding.sliding_window == 128
    assert sliding.layer_ids == (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22)
    assert full.kind == "full"
    assert full.layer_ids == (1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23)


def test_gemma_five_to_one_pattern() -> None:
    model = load_model("gemma-3-1b")
    assert model.num_hidden_layers == 26
    sliding, full = model.groups
    assert len(sliding.layer_ids) == 22
    assert len(full.layer_ids) == 4
    assert full.layer_ids == (5, 11, 17, 23)  # every sixth layer
    assert sliding.layer_ids == tuple(i for i in range(26) if i not in (5, 11, 17, 23))
    assert (sliding.sliding_window, full.sliding_window) == (512, 0)


def test_identity_of_model() -> None:
    identity = load_model("gpt-oss-20b").identity(tokens_per_block=16, hash_seed="7")
    assert identity.model == "openai/gpt-oss-20b"
    assert identity.tokens_per_block == 16
    assert identity.hash_seed == "7"
    sliding, full = identity.groups
    assert sliding.layer_names[:2] == (layer_name(0), layer_name(2))
    assert full.layer_names[-1] == "model.layers.23.self_attn.attn"
    assert (full.num_kv_heads, full.head_dim, sliding.sliding_window) == (8, 64, 128)


def test_mla_model_identity() -> None:
    identity = load_model("deepseek-v3").identity(tokens_per_block=64)
    (group,) = identity.groups
    assert (group.kind, group.num_layers, group.latent_dim) == ("mla", 61, 576)
    assert (group.num_kv_heads, group.head_dim) == (1, 0)
