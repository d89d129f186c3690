"""Argument parsing shared by the command-line front-ends (kvstore, kvstore-inspect)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit status 2.

    The message names the argument, what was expected and what arrived; the usage block
    argparse would print first is left to ``--help`` (subcommand parsers inherit the class).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer > 0, with an error naming what arrived."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def store_root(text: str) -> Path:
    """argparse type: a store directory. Not empty: ``Path("")`` is the current directory, and
    an empty argument (an unset shell variable) must not silently mean that."""
    if not text:
        raise argparse.ArgumentTypeError("expected a store directory, got '' (an empty path)")
    return Path(text)
