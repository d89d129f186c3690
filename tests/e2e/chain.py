"""A chain of real engines sharing one store, run lazily and once per session.

Each engine costs ~20-60 s on 2 cores (imports, engine start and stop), so the e2e tests of
one model share one chain: a step names the engines that must have run before it (``after``),
e.g. "load" after "store"; the first test that needs a step runs it and its predecessors;
later tests reuse the results. Each step is a driver job (see driver.py) with an engine of its
own: a new engine core and workers, stopped (its stores published, its processes exited)
before the next step starts. The session's :class:`~.engine.EngineHost` runs the jobs of every
chain in one front-end process, which only saves that process's start and imports.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .driver import VOCAB
from .engine import EngineHost

BLOCK = 32  # tokens per block: vLLM's CPU attention wants a multiple of 32


def make_prompt(seed: int, n_tokens: int) -> list[int]:
    """A deterministic random token-id prompt."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n_tokens)]


@dataclass
class Step:
    """One engine process: its job (driver keys) and what must run before it."""

    job: dict[str, Any]
    after: tuple[str, ...] = ()
    before_run: Callable[[], None] | None = None  # e.g. damage the store it will read


@dataclass
class Chain:
    host: EngineHost
    workdir: Path
    model: str  # driver model kind
    model_dir: Path
    # float32, not the checkpoint's bf16: KV computed by TP=1 and by TP=2 differs in its bf16
    # rounding, enough to flip a greedy token of an engine that loads the other's pages.
    dtype: str = "float32"
    steps: dict[str, Step] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, step: Step) -> None:
        self.steps[name] = step

    def result(self, name: str) -> Any:
        """The driver result of step ``name``, running it (and what it needs) first."""
        if name not in self.results:
            step = self.steps[name]
            for dependency in step.after:
                self.result(dependency)
            if step.before_run is not None:
                step.before_run()
            job = {
                "model": self.model,
                "model_dir": str(self.model_dir),
                "dtype": self.dtype,
                **step.job,
            }
            self.results[name] = self.host.run(job, self.workdir, name)
        return self.results[name]

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")
