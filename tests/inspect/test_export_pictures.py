"""``export`` is byte-exact; ``heatmap`` writes a valid PNG of the expected size and numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvstore.inspect.stats import magnitude
from tests.inspect.conftest import Reference, Run, Space, run_json, to_bytes
from tests.inspect.png import png_size


@pytest.mark.parametrize("which", ["bf16", "f16", "fp8", "mla"])
def test_npy_export_is_byte_equal_to_what_was_written(
    reference: Reference, run: Run, tmp_path: Path, which: str
) -> None:
    space: Space = getattr(reference, which)
    h, tensor = next(iter(space.tensors.items()))
    out = tmp_path / "block.npy"
    doc: dict[str, Any] = run_json(run, "export", reference.root, space.ns, h.hex(), "--out", out)
    array = np.load(out)
    assert array.shape == tuple(tensor.shape)
    assert array.tobytes() == to_bytes(tensor).tobytes()
    assert doc["export"]["shape"] == list(tensor.shape)


@pytest.mark.parametrize("which", ["bf16", "f16", "fp8", "mla"])
def test_safetensors_export_keeps_the_real_dtype(
    reference: Reference, run: Run, tmp_path: Path, which: str
) -> None:
    space: Space = getattr(reference, which)
    h, tensor = next(iter(space.tensors.items()))
    out = tmp_path / "block.safetensors"
    run_json(run, "export", reference.root, space.ns, h.hex(), "--out", out)
    loaded = load_file(str(out))["kv"]
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
    assert to_bytes(loaded).tobytes() == to_bytes(tensor).tobytes()
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["block_hash"] == h.hex() and meta["kv_dtype"] == space.identity.kv_dtype
    assert meta["namespace"] == space.ns


def test_partial_export_is_the_selected_slice(
    reference: Reference, run: Run, tmp_path: Path
) -> None:
    space = reference.f16
    h, tensor = next(iter(space.tensors.items()))
    out = tmp_path / "part.safetensors"
    run_json(
        run,
        "export",
        reference.root,
        space.ns,
        h.hex(),
        "--out",
        out,
        "--heads",
        "1",
        "--layers",
        "0:2",
    )
    loaded = load_file(str(out))["kv"]
    assert torch.equal(loaded, tensor[1:2, 0:2])
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert (meta["heads"], meta["layers"]) == ("[1, 2]", "[0, 2]")
    npy = tmp_path / "part.npy"
    run_json(
        run, "export", reference.root, space.ns, h.hex(), "--out", npy, "--layers", "2", "--decoded"
    )
    decoded = np.load(npy)
    assert decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded, tensor[:, 2:3].float().numpy())


def test_export_refuses_an_unknown_suffix(reference: Reference, run: Run, tmp_path: Path) -> None:
    space = reference.bf16
    code, _, err = run(
        "export", reference.root, space.ns, space.names["s0"].hex(), "--out", tmp_path / "x.pt"
    )
    assert code == 2 and "expected a .npy or .safetensors name" in err


@pytest.mark.parametrize("which", ["bf16", "mla"])
def test_heatmap_png_and_grid_values(
    reference: Reference, run: Run, tmp_path: Path, which: str
) -> None:
    space: Space = getattr(reference, which)
    h = next(iter(space.tensors)) if which == "mla" else space.names["a1"]
    png = tmp_path / "heat.png"
    doc: dict[str, Any] = run_json(
        run,
        "heatmap",
        reference.root,
        space.ns,
        h.hex(),
        "--png",
        png,
        "--size",
        "800x400",
        "--metric",
        "absmax",
    )
    assert png_size(png) == (800, 400)
    values = space.floats(h)
    g = space.identity.groups[0]
    if which == "mla":
        assert list(doc["grids"]) == ["latent"]
        want = [[magnitude(values[layer], "absmax")] for layer in range(g.num_layers)]
        assert doc["grids"]["latent"] == want
        return
    for k, part in enumerate(("K", "V")):
        want = [
            [
                float(np.abs(values[hd, ly, :, k][np.isfinite(values[hd, ly, :, k])]).max())
                for hd in range(2)
            ]
            for ly in range(3)
        ]
        assert doc["grids"][part] == want


def test_heatmap_rms_default(reference: Reference, run: Run, tmp_path: Path) -> None:
    space = reference.fp8
    h = next(iter(space.tensors))
    png = tmp_path / "heat.png"
    doc: dict[str, Any] = run_json(run, "heatmap", reference.root, space.ns, h.hex(), "--png", png)
    assert png_size(png) == (1200, 600) and doc["metric"] == "rms"
    v = space.floats(h).astype(np.float64)
    assert doc["grids"]["V"][1][0] == pytest.approx(
        float(np.sqrt(np.mean(v[0, 1, :, 1] ** 2))), rel=1e-12
    )
