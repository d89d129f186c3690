"""Real model KV geometries (``models.json``, from the models' published configs).

Used by the demo, the benchmarks and the tests to size realistic workloads. Each model becomes
an :class:`~kvstore.identity.Identity` with vLLM-style layer names
(``model.layers.<i>.self_attn.attn``) and the global layer ids of every group, which the
parallel mapping needs to split layers over pipeline stages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from kvstore.errors import ConfigError
from kvstore.identity import GroupKind, GroupSpec, Identity


@dataclass(frozen=True)
class ModelGroup:
    """One KV-cache group of a model, with the global ids of its layers."""

    kind: GroupKind
    layer_ids: tuple[int, ...]  # global decoder-layer indices, ascending
    num_kv_heads: int
    head_dim: int
    latent_dim: int
    sliding_window: int


@dataclass(frozen=True)
class ModelGeometry:
    """KV geometry of one model."""

    name: str  # key in models.json, e.g. "llama-3.1-8b"
    hf_id: str
    kv_dtype: str
    num_hidden_layers: int
    groups: tuple[ModelGroup, ...]

    def identity(
        self, tokens_per_block: int, hash_algo: str = "sha256", hash_seed: str = ""
    ) -> Identity:
        """The namespace identity of this model at ``tokens_per_block``."""
        return Identity(
            model=self.hf_id,
            kv_dtype=self.kv_dtype,
            tokens_per_block=tokens_per_block,
            hash_algo=hash_algo,
            hash_seed=hash_seed,
            groups=tuple(
                GroupSpec(
                    kind=g.kind,
                    layer_names=tuple(layer_name(i) for i in g.layer_ids),
                    num_kv_heads=1 if g.kind == "mla" else g.num_kv_heads,
                    head_dim=0 if g.kind == "mla" else g.head_dim,
                    latent_dim=g.latent_dim,
                    sliding_window=g.sliding_window,
                )
                for g in self.groups
            ),
        )


def layer_name(layer_id: int) -> str:
    """vLLM's attention layer name for decoder layer ``layer_id``."""
    return f"model.layers.{layer_id}.self_attn.attn"


@cache
def _catalog() -> dict[str, Any]:
    text = resources.files("kvstore").joinpath("models.json").read_text()
    doc: dict[str, Any] = json.loads(text)
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def model_names() -> list[str]:
    """Names accepted by :func:`load_model`."""
    return sorted(_catalog())


def load_model(name: str) -> ModelGeometry:
    """The geometry of model ``name`` (a key of models.json)."""
    catalog = _catalog()
    if name not in catalog:
        raise ConfigError(f"model: expected one of {sorted(catalog)}, got {name!r}")
    entry = catalog[name]
    raw_groups = entry["groups"]
    total = sum(int(g["layers"]) for g in raw_groups)
    layer_ids = _assign_layer_ids(raw_groups, total)
    groups = tuple(
        ModelGroup(
            kind=g["kind"],
            layer_ids=ids,
            num_kv_heads=int(g.get("kv_heads", 1)),
            head_dim=int(g.get("head_dim", 0)),
            latent_dim=int(g.get("latent_dim", 0)),
            sliding_window=int(g.get("sliding_window", 0)),
        )
        for g, ids in zip(raw_groups, layer_ids, strict=True)
    )
    return ModelGeometry(
        name=name,
        hf_id=entry["hf_id"],
        kv_dtype=entry["dtype"],
        num_hidden_layers=total,
        groups=groups,
    )


def _assign_layer_ids(raw_groups: list[dict[str, Any]], total: int) -> list[tuple[int, ...]]:
    """Global layer ids per group, from the interleaving the catalog describes.

    ``layer_ids: even|odd`` (gpt-oss), ``pattern: "5 sliding : 1 full"`` (gemma-3: every sixth
    layer is full attention), or, for a single group, all layers in order.
    """
    if len(raw_groups) == 1:
        return [tuple(range(total))]
    if all("layer_ids" in g for g in raw_groups):
        parity = {"even": 0, "odd": 1}
        return [
            tuple(i for i in range(total) if i % 2 == parity[g["layer_ids"]]) for g in raw_groups
        ]
    pattern_group = next((g for g in raw_groups if "pattern" in g), None)
    if pattern_group is not None:
        sliding, full = (int(part.split()[0]) for part in pattern_group["pattern"].split(":"))
        period = sliding + full
        is_full = [i % period >= sliding for i in range(total)]
        return [
            tuple(i for i in range(total) if is_full[i] == (g["kind"] == "full"))
            for g in raw_groups
        ]
    raise ConfigError("models.json: multi-group model without layer_ids or pattern")
