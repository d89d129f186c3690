"""Opening the store, for both modes: the direct connector (:mod:`connector.offload.spec`) and
the secondary tier (:mod:`connector.tier.manager`).

One place, so tests can inject faults (they patch :func:`open_store` here).
"""

from __future__ import annotations

import time
from pathlib import Path

from kvstore import KVStore, StoreConfig, StoreFormatError


def open_store(config: StoreConfig, wait_s: float = 10.0) -> KVStore:
    """Open (or create) the store at ``config.root``.

    The workers of an engine open the store concurrently at startup. While one of them
    creates a new store, its temporary ``zarr.json`` makes the root look like a foreign,
    non-empty directory to the others for a moment: they wait for the document (up to
    ``wait_s``) instead of failing.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return KVStore(config)
        except StoreFormatError:
            if time.monotonic() > deadline or not _being_created(config.root):
                raise
            time.sleep(0.02)


def _being_created(root: Path) -> bool:
    try:
        names = [p.name for p in Path(root).iterdir()]
    except OSError:
        return False
    return bool(names) and all(n.startswith(".zarr.json.tmp-") for n in names)
