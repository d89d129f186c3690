"""Progress bars of the admin commands: tqdm on stderr, shown only when stderr is a terminal.

Machines reading ``--json`` from stdout, pipes and CI logs never see a bar; ``--watch`` passes
run without one.
"""

from __future__ import annotations

import sys
from types import TracebackType

from tqdm import tqdm

from kvstore.io import stall


class Progress:
    """A progress bar (or nothing); ``update(n)`` advances it. Use as a context manager.

    ``total=None``: a count with a rate and no end (a streaming command that cannot know how
    many items there are before it has seen them all)."""

    def __init__(
        self, total: int | None, desc: str, unit: str = "dir", *, enabled: bool = True
    ) -> None:
        show = enabled and _stderr_is_tty()
        self._bar: tqdm | None = (
            tqdm(
                total=total,
                desc=desc,
                unit=unit,
                unit_scale=unit == "B",
                unit_divisor=1024 if unit == "B" else 1000,
                file=sys.stderr,
                leave=False,
                dynamic_ncols=True,
            )
            if show
            else None
        )

    def update(self, n: int = 1) -> None:
        stall.beat()  # progress is the mount answering
        if self._bar is not None:
            self._bar.update(n)

    def note(self, text: str) -> None:
        """Show ``text`` after the bar (what has been done besides the unit counted), redrawn
        with the bar's next update: cheap enough to call per item."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
