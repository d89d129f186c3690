"""One SGLang rank in its own process, for tests/sglang/test_sglang_ranks.py.

Run as ``python -m tests.sglang.sglang_rank SPEC.json`` in the SGLang venv. The rank joins a gloo
group (``world_size`` ranks = TP size), builds SGLang 0.5.23's own device pool, host pool and
``HiCacheController`` with the kvstore backend loaded by SGLang's ``dynamic`` factory, then:

* ``write``: fills its host pool with random pages (seeded by rank), backs them up through the
  controller's backup thread, waits for the acknowledgement, and saves the pages it wrote;
* ``read``: asks the controller's prefetch thread for the prompt (hit query, all-reduced over
  the group), loads the hit pages through the controller's transfer, and saves them.

Pages are saved as raw ``kv_buffer`` slices (``.npy`` of uint8) in the layout's own order, so
the test compares them by indexing SGLang's buffers, independently of kvstore's mapping.

Exit: status 0 only after the results are saved and the whole group has reached the end; the
process then leaves through ``os._exit`` (see :func:`_leave`). A crash (SIGABRT, SIGSEGV) prints
every thread's Python stack to the log first (``faulthandler``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tests.sglang.real_pools import fill, mha_pools

T, L, D, SIZE = 4, 3, 16, 256
PAGE_AXIS = {"layer_first": 2, "page_first": 1, "page_first_direct": 1, "page_head": 1}


def token_slots_to_pages(layout: str, buffer: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The pages ``indices`` (token slots) cover, cut out of ``buffer`` along its page axis."""
    pages = indices.reshape(-1, T)[:, 0] // T
    if layout in ("layer_first", "page_first"):
        axis = PAGE_AXIS[layout]
        shape = list(buffer.shape)
        split = [*shape[:axis], shape[axis] // T, T, *shape[axis + 1 :]]
        return buffer.view(split).index_select(axis, pages)
    return buffer.index_select(1, pages)


def _leave() -> None:
    """End the process with status 0, skipping the interpreter's finalization.

    At finalization Python 3.11 ends each thread that still asks for the GIL with
    ``pthread_exit``; a thread inside C++ (a gloo worker releasing a tensor, a torch call
    returning on one of SGLang's daemon threads) can then be unwound through a ``noexcept``
    frame, and the process aborts ("terminate called without an active exception", SIGABRT)
    after its work is done. The results are on disk and the group is torn down: nothing is left for
    finalization to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(spec_path: str) -> None:
    faulthandler.enable()
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    rank, world = spec["rank"], spec["world"]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(spec["port"])
    dist.init_process_group("gloo", rank=rank, world_size=world)

    from sglang.srt.managers.cache_controller import HiCacheController  # noqa: PLC0415
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: PLC0415
    from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: PLC0415
    from sglang.srt.runtime_context import get_parallel  # noqa: PLC0415

    # The override must stay referenced while entered (SGLang's own test kit does the same).
    override = get_parallel().override(
        tp_rank=rank, tp_size=world, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )
    override.__enter__()
    tokens = list(range(100, 100 + spec["pages"] * T))
    # The first hash JIT-loads SGLang's native hash extension (a ninja run under file locks):
    # here, on the main thread before any controller thread exists, not on the prefetch thread.
    hashes = get_storage_hash_str(tokens, None, page_size=T)
    heads = spec["heads"] // world
    layout = spec["layout"]
    device_pool, host = mha_pools(layout, SIZE, T, heads, D, L)
    allocator = PagedTokenToKVPoolAllocator(SIZE, T, torch.bfloat16, "cpu", device_pool, False)
    controller = HiCacheController(
        allocator,
        host,
        T,
        dist.group.WORLD,
        threading.Event(),
        io_backend="direct",
        storage_backend="dynamic",
        model_name="test/sglang-model",
        storage_backend_extra_config=dict(spec["extra_config"]),
    )
    out = Path(spec["out"])
    result: dict[str, Any] = {"rank": rank}
    if spec["role"] == "write":
        fill(host.kv_buffer, 1000 + rank)
        indices = host.alloc(len(tokens))
        controller.write_storage(indices, tokens, hash_value=hashes)
        done = controller.ack_backup_queue.get(timeout=120)
        result["completed_tokens"] = done.completed_tokens
        pages = token_slots_to_pages(layout, host.kv_buffer, indices)
    else:
        operation = controller.prefetch("request-1", tokens)
        answered = controller.prefetch_hit_queue.get(timeout=120)
        assert answered is operation
        result["hit_tokens"] = operation.storage_hit_count
        hit = operation.storage_hit_count
        indices = host.alloc(max(hit, T))[:hit]
        operation.host_indices = indices
        result["loaded_pages"] = controller._page_transfer(operation) if hit else 0
        pages = token_slots_to_pages(layout, host.kv_buffer, indices)
    np.save(out.with_suffix(".npy"), pages.contiguous().view(torch.uint8).numpy())
    backend = controller.storage_backend
    result["stats"] = backend.stats.snapshot() if backend is not None else None
    out.write_text(json.dumps(result))
    # Stop the controller's threads (joined) and destroy its sync groups before the world
    # group goes: no thread is left in a collective or a store call.
    controller.detach_storage_backend()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    _leave()
