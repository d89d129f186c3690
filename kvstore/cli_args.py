"""Argument types shared by the command-line front-ends (kvstore, kvstore-inspect)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer > 0, with an error naming what arrived."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
