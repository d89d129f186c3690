"""Shared pieces of the reliability suite: tiers, figures, child processes."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
from multiprocessing.context import BaseContext

FULL = os.environ.get("KVSTORE_RELIABILITY_FULL", "") not in ("", "0")
TIER = "full" if FULL else "pr"


def tier(pr: int, full: int) -> int:
    """The PR-tier or the full-tier value of a size."""
    return full if FULL else pr


def figure(threat: str, **counts: object) -> str:
    """Print (and return) the one-line figure of a test: ``[reliability/<tier>] threat: k=v``."""
    line = f"[reliability/{TIER}] {threat}: " + ", ".join(f"{k}={v}" for k, v in counts.items())
    print(line)
    return line


@functools.cache
def fork_context() -> BaseContext:
    """A forkserver context whose server has kvstore and the workers imported: children start
    in milliseconds, from a single-threaded parent (never a fork of the threaded test process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.reliability.workers"])
    return ctx
