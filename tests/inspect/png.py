"""PNG checks without trusting the writer: signature, IHDR size, and a full decode."""

from __future__ import annotations

import struct
from pathlib import Path

import matplotlib.image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, after checking its signature and that it decodes fully."""
    raw = path.read_bytes()
    assert raw[:8] == PNG_SIGNATURE, "not a PNG file"
    length, kind = struct.unpack(">I4s", raw[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", raw[16:24])
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (height, width)
    return width, height
