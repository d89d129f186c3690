"""Raw inner-chunk bytes to typed arrays: the stored element type, the real dtype, float32.

Shapes (format v1, docs/format.md): an attention selection of heads x layers is
``(heads, layers, tokens, 2, head_dim)`` (axis 3: 0 = K, 1 = V); an MLA selection is
``(layers, tokens, latent)``. Three views of the same bytes:

* :func:`raw_array` - numpy array of the *stored* element type (bfloat16 -> uint16 bits,
  float8 -> uint8 bits, float16 / float32 / int8 / uint8 as themselves): byte-identical to the
  file, what ``.npy`` export writes;
* :func:`typed_tensor` - a torch tensor of the real dtype (bfloat16, float8_e4m3fn, ...), a
  zero-copy view of the raw bits; what safetensors export writes;
* :func:`to_float` - float32 numpy values (exact for every supported dtype), for statistics,
  pictures and printing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.errors import InspectError
from kvstore.store.view import GroupView

if TYPE_CHECKING:
    import torch

_RAW_NUMPY: dict[str, str] = {
    "bfloat16": "<u2",
    "float16": "<f2",
    "float32": "<f4",
    "float8_e4m3fn": "u1",
    "float8_e5m2": "u1",
    "int8": "i1",
    "uint8": "u1",
}
# torch's name of each KV dtype (torch is imported only to decode bfloat16 / float8 values:
# the commands that only list or check a store never need it).
_TORCH_NAMES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


@dataclass(frozen=True)
class Selection:
    """Which (head, layer) inner chunks of a block; heads is range(1) for MLA."""

    heads: range
    layers: range

    @classmethod
    def all_of(cls, group: GroupView) -> Selection:
        return cls(range(group.num_heads), range(group.num_layers))

    def chunks(self, group: GroupView) -> list[int]:
        """Inner chunk numbers in C order of (head, layer) - the order of the array axes."""
        return group.layout.chunks_of(self.heads, self.layers)

    def shape(self, group: GroupView) -> tuple[int, ...]:
        """Array shape of the selection (see the module docstring)."""
        if group.is_mla:
            return (len(self.layers), group.tokens, group.spec.latent_dim)
        return (len(self.heads), len(self.layers), group.tokens, 2, group.spec.head_dim)

    def to_json(self) -> dict[str, list[int]]:
        return {
            "heads": [self.heads.start, self.heads.stop],
            "layers": [self.layers.start, self.layers.stop],
        }


def raw_numpy_dtype(dtype_name: str) -> np.dtype[np.generic]:
    """The numpy dtype of the stored elements of KV dtype ``dtype_name``."""
    try:
        return np.dtype(_RAW_NUMPY[dtype_name])
    except KeyError:
        raise InspectError(
            f"kv dtype: expected one of {sorted(_RAW_NUMPY)}, got {dtype_name!r}"
        ) from None


def raw_array(data: np.ndarray, group: GroupView, selection: Selection) -> np.ndarray:
    """Chunk bytes (uint8, back to back in ``selection.chunks`` order) as stored elements."""
    dtype = raw_numpy_dtype(group.dtype.name)
    shape = selection.shape(group)
    expected = int(np.prod(shape)) * dtype.itemsize
    if data.nbytes != expected:
        raise InspectError(f"selection bytes: expected {expected}, got {data.nbytes}")
    return np.ascontiguousarray(data).view(dtype).reshape(shape)


def typed_tensor(raw: np.ndarray, dtype_name: str) -> torch.Tensor:
    """A torch tensor of the real dtype viewing the bits of ``raw`` (no copy, no rounding)."""
    import torch  # noqa: PLC0415 - lazy (see _TORCH_NAMES)

    if dtype_name not in _TORCH_NAMES:
        raise InspectError(f"dtype: expected one of {list(_TORCH_NAMES)}, got {dtype_name!r}")
    target = getattr(torch, dtype_name)
    if raw.dtype == np.uint16:  # torch has no uint16 view path everywhere; int16 is the same bits
        bits = torch.from_numpy(np.ascontiguousarray(raw).view(np.int16))
    else:
        bits = torch.from_numpy(np.ascontiguousarray(raw))
    if bits.dtype == target:
        return bits
    if bits.element_size() != torch.empty((), dtype=target).element_size():
        raise InspectError(f"dtype {dtype_name}: element size differs from the stored bits")
    return bits.view(target)


def to_float(raw: np.ndarray, dtype_name: str) -> np.ndarray:
    """float32 values of the stored elements ``raw`` of KV dtype ``dtype_name``."""
    if dtype_name in ("float16", "float32", "int8", "uint8"):
        return raw.astype(np.float32)
    values: np.ndarray = typed_tensor(raw, dtype_name).float().numpy()
    return values
