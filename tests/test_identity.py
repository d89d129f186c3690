"""Namespace identity: canonical JSON, digest, namespace name, differences, validation."""

from __future__ import annotations

import dataclasses
import hashlib
import re

import pytest

from kvstore.errors import ConfigError
from kvstore.identity import (
    DTYPES,
    GroupSpec,
    Identity,
    attention_group,
    dtype_by_name,
    model_slug,
)
from tests.helpers import layer_names, make_mla_identity, make_small_identity

# The canonical JSON of make_small_identity(), written out by hand: sorted keys, no spaces.
SMALL_CANONICAL = (
    b'{"format_version":1,"groups":[{"head_dim":64,"kind":"full","layer_names":'
    b'["model.layers.0.self_attn.attn","model.layers.1.self_attn.attn",'
    b'"model.layers.2.self_attn.attn"],"num_kv_heads":2}],"hash_algo":"sha256","hash_seed":"",'
    b'"kv_dtype":"bfloat16","model":"test/tiny-llama","revision":"","tokens_per_block":16}'
)
SMALL_DIGEST = "a8466c86b91be28c1bfce68caa4da8c9a1bc2aae1913c83b9b2b7a6d4c301e31"
SMALL_NAMESPACE = "test-tiny-llama-a8466c86b91b"


def test_canonical_json_and_digest_are_pinned() -> None:
    identity = make_small_identity()
    assert identity.canonical_json() == SMALL_CANONICAL
    assert hashlib.sha256(SMALL_CANONICAL).hexdigest() == SMALL_DIGEST
    assert identity.digest.hex() == SMALL_DIGEST
    assert len(identity.digest) == 32
    assert identity.namespace == SMALL_NAMESPACE


def test_digest_is_stable_across_instances() -> None:
    assert make_small_identity().digest == make_small_identity().digest
    assert make_small_identity() == make_small_identity()


def test_namespace_name_format() -> None:
    for identity in (make_small_identity(), make_mla_identity()):
        name = identity.namespace
        assert re.fullmatch(r"[a-z0-9._-]+-[0-9a-f]{12}", name), name
        slug, digest12 = name.rsplit("-", 1)
        assert slug == model_slug(identity.model)
        assert digest12 == identity.digest.hex()[:12]


@pytest.mark.parametrize(
    ("model", "slug"),
    [
        ("meta-llama/Llama-3.1-8B", "meta-llama-llama-3.1-8b"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-ai-deepseek-v3"),
        ("  Weird Name!!  ", "weird-name"),
        ("///", "model"),
        ("a" * 60, "a" * 48),
    ],
)
def test_model_slug(model: str, slug: str) -> None:
    assert model_slug(model) == slug


CHANGES: list[tuple[str, object]] = [
    ("model", "test/other"),
    ("revision", "abc123"),
    ("kv_dtype", "float16"),
    ("tokens_per_block", 32),
    ("hash_algo", "xxhash"),
    ("hash_seed", "42"),
    ("format_version", 2),
    ("groups", (attention_group("full", layer_names(3), num_kv_heads=4, head_dim=64),)),
    ("groups", (attention_group("full", layer_names(3), num_kv_heads=2, head_dim=128),)),
    ("groups", (attention_group("sliding", layer_names(3), 2, 64, sliding_window=64),)),
    ("groups", (attention_group("full", ["a", "b", "c"], num_kv_heads=2, head_dim=64),)),
]


@pytest.mark.parametrize(("field", "value"), CHANGES)
def test_every_field_changes_digest_and_is_named(field: str, value: object) -> None:
    base = make_small_identity()
    other = dataclasses.replace(base, **{field: value})  # type: ignore[arg-type]
    assert other.digest != base.digest
    assert other.namespace != base.namespace
    difference = base.describe_difference(other)
    prefix = "groups[0]." if field == "groups" else f"{field}: expected "
    assert difference.startswith(prefix), difference
    if field != "groups":
        assert ";" not in difference  # exactly one field differs


def test_describe_difference_lists_every_field() -> None:
    base = make_small_identity()
    other = dataclasses.replace(base, revision="r2", tokens_per_block=32)
    assert base.describe_difference(other) == (
        "revision: expected '', got 'r2'; tokens_per_block: expected 16, got 32"
    )
    assert base.describe_difference(make_small_identity()) == "identical"


def test_json_round_trip() -> None:
    for identity in (make_small_identity(revision="r1"), make_mla_identity()):
        assert Identity.from_json(identity.to_json()) == identity
    spec = attention_group("sliding", ["x"], 1, 8, sliding_window=16)
    assert GroupSpec.from_json(spec.to_json()) == spec
    assert spec.to_json() == {
        "kind": "sliding",
        "layer_names": ["x"],
        "num_kv_heads": 1,
        "head_dim": 8,
        "sliding_window": 16,
    }
    assert make_mla_identity().groups[0].to_json() == {
        "kind": "mla",
        "layer_names": layer_names(4),
        "latent_dim": 576,
    }


def test_dtypes() -> None:
    assert dtype_by_name("bfloat16").zarr_dtype == "uint16"
    assert dtype_by_name("bfloat16").itemsize == 2
    assert dtype_by_name("float8_e4m3fn").zarr_dtype == "uint8"
    assert dtype_by_name("float32").itemsize == 4
    assert "float16" in DTYPES
    with pytest.raises(ConfigError, match=r"kv dtype: expected one of .* got 'bf16'"):
        dtype_by_name("bf16")


ATTN: dict[str, object] = {"kind": "full", "layer_names": ("a",), "num_kv_heads": 1, "head_dim": 8}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({**ATTN, "kind": "dense"}, "group kind"),
        ({**ATTN, "layer_names": ()}, "at least one layer"),
        ({**ATTN, "layer_names": ("a", "a")}, "unique"),
        ({**ATTN, "num_kv_heads": 0}, "num_kv_heads > 0"),
        ({**ATTN, "head_dim": 0}, "head_dim > 0"),
        ({**ATTN, "latent_dim": 4}, "no latent_dim"),
        ({"kind": "mla", "layer_names": ("a",), "latent_dim": 0}, "latent_dim > 0"),
        ({"kind": "mla", "layer_names": ("a",), "latent_dim": 8, "num_kv_heads": 2}, "mla group"),
    ],
)
def test_group_spec_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GroupSpec(**kwargs)  # type: ignore[arg-type]


def test_identity_validation() -> None:
    base = make_small_identity()
    with pytest.raises(ConfigError, match="kv dtype"):
        dataclasses.replace(base, kv_dtype="int4")
    with pytest.raises(ConfigError, match="tokens_per_block: expected > 0, got 0"):
        dataclasses.replace(base, tokens_per_block=0)
    with pytest.raises(ConfigError, match="at least one KV-cache group"):
        dataclasses.replace(base, groups=())
    with pytest.raises(ConfigError, match="model name"):
        dataclasses.replace(base, model="")
