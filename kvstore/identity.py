"""Namespace identity: everything that changes the bytes or the meaning of a page.

Two servers share cached pages exactly when their :class:`Identity` is equal. It holds the
model (name, revision), the KV dtype, tokens per block, the block-hash algorithm and seed id,
the canonical format version, and per KV-cache group its kind, layer names and geometry. It
holds nothing about parallelism (TP, PP, DCP, PCP): canonical pages are layout-free.

The namespace directory is ``<slug>-<12 hex digits of sha256(identity)>``; the full digest is
also written into every block header, so a block copied into the wrong namespace is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvstore.errors import ConfigError

GroupKind = Literal["full", "sliding", "mla"]
CANONICAL_FORMAT_VERSION = 1


@dataclass(frozen=True)
class DType:
    """A KV element type: its name, byte size and how zarr stores it."""

    name: str  # e.g. "bfloat16"; also the torch dtype name
    itemsize: int  # bytes per element
    zarr_dtype: str  # native zarr dtype, or the raw-bits stand-in (uint16 / uint8)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float16", 2, "float16"),
        DType("float32", 4, "float32"),
        DType("bfloat16", 2, "uint16"),
        DType("float8_e4m3fn", 1, "uint8"),
        DType("float8_e5m2", 1, "uint8"),
        DType("int8", 1, "int8"),
        DType("uint8", 1, "uint8"),
    )
}


def dtype_by_name(name: str) -> DType:
    """The :class:`DType` called ``name``; a clear error for an unsupported one."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"kv dtype: expected one of {sorted(DTYPES)}, got {name!r}") from None


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group: layers sharing a block table and a page geometry."""

    kind: GroupKind  # "full" / "sliding" attention, or "mla" (one latent vector per token)
    layer_names: tuple[str, ...]  # in canonical layer order; position = layer index in the array
    num_kv_heads: int = 1  # all KV heads of the model (never a TP shard); 1 for MLA
    head_dim: int = 0  # attention: elements per head for K (and for V)
    latent_dim: int = 0  # MLA: elements of the latent per token
    sliding_window: int = 0  # tokens, for "sliding" groups (changes page meaning), else 0

    def __post_init__(self) -> None:
        if self.kind not in ("full", "sliding", "mla"):
            raise ConfigError(f"group kind: expected full, sliding or mla, got {self.kind!r}")
        if not self.layer_names:
            raise ConfigError("group: expected at least one layer name, got none")
        if not all(isinstance(name, str) for name in self.layer_names):
            raise ConfigError(
                f"group: expected layer names as strings, got {list(self.layer_names)}"
            )
        if len(set(self.layer_names)) != len(self.layer_names):
            raise ConfigError(f"group: layer names must be unique, got {list(self.layer_names)}")
        if self.kind == "mla":
            if self.latent_dim <= 0 or self.num_kv_heads != 1 or self.head_dim != 0:
                raise ConfigError(
                    "mla group: expected latent_dim > 0, num_kv_heads == 1 and head_dim == 0, got "
                    f"latent_dim={self.latent_dim}, num_kv_heads={self.num_kv_heads}, "
                    f"head_dim={self.head_dim}"
                )
        elif self.num_kv_heads <= 0 or self.head_dim <= 0 or self.latent_dim != 0:
            raise ConfigError(
                f"{self.kind} group: expected num_kv_heads > 0, head_dim > 0 and no latent_dim, "
                "got "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"latent_dim={self.latent_dim}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind, "layer_names": list(self.layer_names)}
        if self.kind == "mla":
            doc["latent_dim"] = self.latent_dim
        else:
            doc["num_kv_heads"] = self.num_kv_heads
            doc["head_dim"] = self.head_dim
        if self.sliding_window:
            doc["sliding_window"] = self.sliding_window
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> GroupSpec:
        return cls(
            kind=doc["kind"],
            layer_names=tuple(doc["layer_names"]),
            num_kv_heads=int(doc.get("num_kv_heads", 1)),
            head_dim=int(doc.get("head_dim", 0)),
            latent_dim=int(doc.get("latent_dim", 0)),
            sliding_window=int(doc.get("sliding_window", 0)),
        )


@dataclass(frozen=True)
class Identity:
    """What a namespace's pages mean. Equal identities share pages; nothing else does."""

    model: str  # model name, e.g. the HF id "meta-llama/Llama-3.1-8B"
    kv_dtype: str  # element type of the KV cache, a key of DTYPES
    tokens_per_block: int  # tokens in one stored block (engine block size x dcp x pcp)
    groups: tuple[GroupSpec, ...]  # KV-cache groups; array g<k> holds groups[k]
    revision: str = ""  # model revision / commit; "" when unknown
    hash_algo: str = (
        "sha256"  # engine's prefix-hash function (vLLM: sha256, sha256_cbor, xxhash, ...)
    )
    hash_seed: str = ""  # seed id of the hash chain (vLLM: PYTHONHASHSEED or its default)
    format_version: int = CANONICAL_FORMAT_VERSION  # canonical page format
    # Tokens past each block that the engine hashes into its hash (vLLM 0.34 with speculative
    # decoding): such keys match only engines with the same lookahead. 0 (the usual) is left
    # out of the document, so identities without it keep their digest.
    hash_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("model", "revision", "kv_dtype", "hash_algo", "hash_seed"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(
                    f"identity {name}: expected a string, got {getattr(self, name)!r}"
                )
        dtype_by_name(self.kv_dtype)
        if self.tokens_per_block <= 0:
            raise ConfigError(f"tokens_per_block: expected > 0, got {self.tokens_per_block}")
        if not isinstance(self.hash_lookahead_tokens, int) or self.hash_lookahead_tokens < 0:
            raise ConfigError(
                "hash_lookahead_tokens: expected an integer >= 0, got "
                f"{self.hash_lookahead_tokens!r}"
            )
        if not self.groups:
            raise ConfigError("identity: expected at least one KV-cache group, got none")
        if not self.model:
            raise ConfigError("identity: expected a model name, got an empty string")

    @property
    def dtype(self) -> DType:
        return dtype_by_name(self.kv_dtype)

    @property
    def engine(self) -> str:
        """The engine whose keys the namespace holds, read off its hash chain: ``sglang``
        (``sglang_*``, its page-hash chain) or ``vllm`` (vLLM's block-hash algorithms)."""
        return "sglang" if self.hash_algo.startswith("sglang") else "vllm"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "model": self.model,
            "revision": self.revision,
            "kv_dtype": self.kv_dtype,
            "tokens_per_block": self.tokens_per_block,
            "hash_algo": self.hash_algo,
            "hash_seed": self.hash_seed,
            "format_version": self.format_version,
            "groups": [g.to_json() for g in self.groups],
        }
        if self.hash_lookahead_tokens:
            doc["hash_lookahead_tokens"] = self.hash_lookahead_tokens
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Identity:
        """The identity a stored document describes; :class:`ConfigError` for anything that
        is not one (a damaged or hostile zarr.json fails with this one error type)."""
        try:
            return cls(
                model=doc["model"],
                revision=doc.get("revision", ""),
                kv_dtype=doc["kv_dtype"],
                tokens_per_block=int(doc["tokens_per_block"]),
                hash_algo=doc.get("hash_algo", "sha256"),
                hash_seed=doc.get("hash_seed", ""),
                format_version=int(doc.get("format_version", CANONICAL_FORMAT_VERSION)),
                hash_lookahead_tokens=int(doc.get("hash_lookahead_tokens", 0)),
                groups=tuple(GroupSpec.from_json(g) for g in doc["groups"]),
            )
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ConfigError(
                f"identity: expected a kvstore identity document, got {type(exc).__name__}: {exc}"
            ) from exc

    def canonical_json(self) -> bytes:
        """The bytes the digest is taken over: sorted keys, no whitespace, UTF-8."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> bytes:
        """SHA-256 of :meth:`canonical_json` (32 bytes); written into every block header."""
        return hashlib.sha256(self.canonical_json()).digest()

    @property
    def namespace(self) -> str:
        """Directory name: readable model slug, ``-``, 12 hex digits of the digest."""
        return f"{model_slug(self.model)}-{self.digest.hex()[:12]}"

    def describe_difference(self, other: Identity) -> str:
        """The fields where ``other`` differs from ``self``, named down to the group field."""
        mine, theirs = self.to_json(), other.to_json()
        diffs = [
            f"{key}: expected {mine.get(key)!r}, got {theirs.get(key)!r}"
            for key in sorted(set(mine) | set(theirs))
            if key != "groups" and mine.get(key) != theirs.get(key)
        ]
        if len(mine["groups"]) != len(theirs["groups"]):
            n_mine, n_theirs = len(mine["groups"]), len(theirs["groups"])
            diffs.append(f"groups: expected {n_mine} KV-cache groups, got {n_theirs}")
        else:
            for k, (g_mine, g_theirs) in enumerate(
                zip(mine["groups"], theirs["groups"], strict=True)
            ):
                diffs.extend(
                    f"groups[{k}].{field}: expected {g_mine.get(field)!r}, "
                    f"got {g_theirs.get(field)!r}"
                    for field in sorted(set(g_mine) | set(g_theirs))
                    if g_mine.get(field) != g_theirs.get(field)
                )
        return "; ".join(diffs) or "identical"


def model_slug(model: str) -> str:
    """A filesystem-safe, readable slug of a model name (lower case, [a-z0-9._-])."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", model.lower()).strip("-.")
    return slug[:48] or "model"


def attention_group(
    kind: GroupKind,
    layer_names: Sequence[str],
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int = 0,
) -> GroupSpec:
    """Shorthand for an attention (full / sliding) :class:`GroupSpec`."""
    return GroupSpec(
        kind=kind,
        layer_names=tuple(layer_names),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        sliding_window=sliding_window,
    )
