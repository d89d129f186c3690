"""Export a block selection to ``.npy`` or ``.safetensors`` (chosen by the file suffix).

* ``.npy``: the stored elements, byte for byte (bfloat16 as its uint16 bits, float8 as uint8
  bits; numpy has no such dtypes). ``decoded=True`` writes float32 values instead.
* ``.safetensors``: one tensor ``"kv"`` in the real dtype (BF16, F16, F8_E4M3, ...), again byte
  for byte, and string metadata: namespace, group, block hash, KV dtype, axis names and the
  selected head / layer ranges.

Axes: ``(kv_head, layer, token, kv, head_dim)``, or MLA ``(layer, token, latent)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvstore.errors import InspectError
from kvstore.inspect.decode import typed_tensor
from kvstore.inspect.values import BlockValues

ATTENTION_AXES = ("kv_head", "layer", "token", "kv", "head_dim")
MLA_AXES = ("layer", "token", "latent")


def export_block(values: BlockValues, out: Path, decoded: bool = False) -> dict[str, object]:
    """Write ``values`` to ``out``; returns a description of what was written."""
    suffix = out.suffix.lower()
    group = values.group
    axes = MLA_AXES if group.is_mla else ATTENTION_AXES
    meta = {
        "namespace": group.namespace,
        "group": str(group.index),
        "block_hash": values.ref.label,
        "kv_dtype": group.dtype.name,
        "axes": json.dumps(list(axes)),
        "heads": json.dumps(values.selection.to_json()["heads"]),
        "layers": json.dumps(values.selection.to_json()["layers"]),
        "layer_names": json.dumps([group.spec.layer_names[i] for i in values.selection.layers]),
    }
    if suffix == ".npy":
        array = values.floats if decoded else values.raw
        np.save(out, array, allow_pickle=False)
        stored = str(array.dtype)
    elif suffix == ".safetensors":
        if decoded:
            tensor = typed_tensor(values.floats, "float32")
        else:
            tensor = typed_tensor(values.raw, group.dtype.name)
        from safetensors.torch import save_file  # noqa: PLC0415 - lazy: it imports torch

        save_file({"kv": tensor.contiguous()}, str(out), metadata=meta)
        stored = str(tensor.dtype).removeprefix("torch.")
    else:
        raise InspectError(f"export file: expected a .npy or .safetensors name, got {out.name!r}")
    return {
        "path": str(out),
        "format": suffix.lstrip("."),
        "dtype": stored,
        "shape": list(values.raw.shape),
        "axes": list(axes),
        "nbytes": int(values.raw.size) * (4 if decoded else values.raw.dtype.itemsize),
        **{k: v for k, v in meta.items() if k in ("namespace", "block_hash", "kv_dtype")},
        **values.selection.to_json(),
    }
