"""The ``tier`` suite: kvstore as vLLM's secondary tier vs vLLM's own ``fs`` tier.

Both tiers run behind the same vLLM 0.33 ``TieringOffloadingManager`` and CPU primary tier
(built by vLLM's ``TieringOffloadingSpec`` from an ``OffloadingConfig``, as a server's scheduler
builds them), driven through the manager's scheduler-side API the way vLLM's offloading
scheduler drives it: ``prepare_store`` / ``complete_store`` (which cascades to the tier),
``lookup`` (RETRY until the tier's async probe answers, then a promotion), ``on_schedule_end``
once per simulated step. The worker's GPU <-> CPU copies are not part of it: the CPU rows are
filled directly. Measured, per system, on the same data in the same run:

* store: blocks cascaded from the CPU tier into the tier, first submit to last job reported;
  also the process CPU seconds per stored GB over that time (every thread: the tier's, the
  manager's, and the bench filling the CPU rows, which costs every system the same). On a
  machine whose storage outruns a core, CPU per GB decides the throughput; on a shared
  machine it is also the steadier figure;
* promotion: after a restart (new manager, page cache of the tier's files dropped), lookups
  of every stored key until all are loaded into the CPU tier (probe + read);
* time from restart to first hit: from building the manager to the first ``lookup`` HIT;
* lookup: one request's lookups of 256 stored (and 256 absent) keys in a tier holding
  ``sizes`` blocks of 4 KiB, until every one is resolved (ms; a hit then promotes, which is not
  waited for in the hits' time, but before the misses are timed), and the scheduler-thread
  time per ``lookup`` call (us).

kvstore runs with ``durability`` full and none; vLLM's tier never fsyncs. Every row carries the
ratio to the fs tier measured next to it. Backpressure is off for both (nothing is dropped).
Imports vLLM (the only bench module besides ``systems`` / ``lookup`` that does; see the
import-linter exception in pyproject.toml).
"""

from __future__ import annotations

import gc
import hashlib
import os
import resource
import shutil
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.common import drop_cache, gbs, kv_like_block
from kvstore.models import layer_name, load_model

SHM = Path("/dev/shm")  # noqa: S108 - where vLLM puts its shared CPU-tier region
STEP_S = 0.001  # simulated scheduler step: the pause between two rounds of lookups
BATCH = 32  # keys per prepare_store / complete_store (one step's stores)
LOOKUP_KEYS = 256
SYSTEMS = ("kvstore full", "kvstore none", "vllm fs")
ROUNDS = 3  # throughput rounds (rotated order), medians reported
# Lookups do not depend on durability: the lookup stores are filled with durability none.
LOOKUP_SYSTEMS = ("kvstore none", "vllm fs")


@contextmanager
def _tiering(  # noqa: PLR0913 - geometry, where, which tier and how big the CPU tier is
    name: str, heads: int, layers: int, head_dim: int, root: Path, system: str, chunks: int
) -> Iterator[Any]:
    """A vLLM TieringOffloadingManager with ``system`` behind its CPU tier (closed on exit)."""
    from vllm.v1.kv_offload.config import (  # noqa: PLC0415 - optional dependency
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: PLC0415

    from connector.facts import EngineFacts, GroupFacts, provide  # noqa: PLC0415
    from connector.tier import tier_entry  # noqa: PLC0415

    tokens = 16
    engine_id = f"kvstore-bench-{os.getpid()}-{time.monotonic_ns()}"
    names = tuple(layer_name(i) for i in range(layers))
    page = heads * tokens * 2 * head_dim * 2
    row = -(-layers * page // 4096) * 4096
    if system == "vllm fs":
        tier: dict[str, Any] = {"type": "fs", "root_dir": str(root)}
    else:
        durability = system.split()[1]
        tier = tier_entry(str(root), durability=durability, default_backpressure=False)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens, names, 0, None),),
        worker_kv_bytes_per_block=layers * page,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": (chunks + 8) * row, "secondary_tiers": [tier]},
        engine_id=engine_id,
        model=OffloadingModelConfig(name, "bfloat16", 0),
        cache=OffloadingCacheConfig(tokens, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        kv_cache_layout="LBHNC",
    )
    group = GroupFacts(
        0, names, "full", num_kv_heads=heads, head_size=head_dim, block_size=tokens,
        itemsize=2, page_bytes=page,
    )  # fmt: skip
    facts = EngineFacts(
        "sha256", "", "bfloat16", "", "recompute", "LBHNC", heads, 1, 1, 1, 1, 1, (group,)
    )
    try:
        with provide(facts):
            manager = TieringOffloadingSpec(config).get_manager()
    finally:
        # The manager has mapped its shared region (there are no workers to join it): its
        # name goes now, as vLLM's own barrier does, so the memory returns when the process
        # ends however it ends (a bench killed by a timeout left its file in /dev/shm).
        unlink_region(engine_id)
    # As vLLM's engine core does once it has started (freeze_gc_heap): the objects of start-up
    # (vLLM's modules, the manager) leave the collector's generations, so that a full
    # collection in the middle of a timed phase does not walk them. Without it one full
    # collection landed inside a measured phase in some runs and halved that system's figure.
    gc.collect()
    gc.freeze()
    try:
        yield manager
    finally:
        manager.shutdown()


def region_files(engine_id: str) -> list[Path]:
    """The ``/dev/shm`` files of vLLM's shared CPU-tier region of ``engine_id``
    (``SharedOffloadRegion``: ``vllm_offload_<engine id>.mmap`` and its segment files)."""
    return sorted(SHM.glob(f"vllm_offload_{engine_id}.mmap*"))


def unlink_region(engine_id: str) -> None:
    """Remove the names of ``engine_id``'s region (its mappings stay valid)."""
    for path in region_files(engine_id):
        path.unlink(missing_ok=True)


def _keys(n: int, tag: int) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key  # noqa: PLC0415

    # sha256 digests, as vLLM's block hashes: spread over every fan-out directory
    return [make_offload_key(hashlib.sha256(b"%d-%d" % (tag, i)).digest(), 0) for i in range(n)]


def _step(manager: Any) -> None:
    from vllm.v1.kv_offload.base import ScheduleEndContext  # noqa: PLC0415

    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def _settle(manager: Any) -> None:
    """Step until the manager's jobs (cascades, promotions) are all reported."""
    while manager.has_pending_work():
        _step(manager)
        time.sleep(STEP_S / 10)


def _cpu_seconds() -> float:
    """CPU seconds of this process so far (user + system, every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _store(
    manager: Any, keys: Sequence[bytes], blocks: Sequence[np.ndarray]
) -> tuple[float, float]:
    """Cascade ``keys`` into the tier; (seconds, process CPU seconds) from the first submit
    to the last report."""
    from vllm.v1.kv_offload.base import ReqContext  # noqa: PLC0415

    rows = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
    context = ReqContext(req_id=f"store-{time.monotonic_ns()}")
    manager.on_new_request(context)
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    for first in range(0, len(keys), BATCH):
        batch = keys[first : first + BATCH]
        out = manager.prepare_store(batch, context)
        assert out is not None and len(out.keys_to_store) == len(batch), "CPU tier is full"
        for j, chunk in enumerate(out.store_spec.chunk_ids):
            data = blocks[(first + j) % len(blocks)]
            rows[int(chunk), : data.size] = data
        manager.complete_store(batch, context)
    _settle(manager)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    manager.on_request_finished(context)
    return seconds, cpu


def _resolve(manager: Any, keys: Sequence[bytes], until: set[Any]) -> tuple[float, float]:
    """Look ``keys`` up step after step until each answers a result in ``until``.

    Returns (seconds, scheduler-thread seconds per lookup call)."""
    from vllm.v1.kv_offload.base import ReqContext  # noqa: PLC0415

    context = ReqContext(req_id=f"lookup-{time.monotonic_ns()}")
    manager.on_new_request(context)
    pending = list(keys)
    calls, in_calls = 0, 0.0
    start = time.perf_counter()
    while pending:
        waiting = []
        for key in pending:
            t0 = time.perf_counter()
            result = manager.lookup(key, context)
            in_calls += time.perf_counter() - t0
            calls += 1
            if result not in until:
                waiting.append(key)
        pending = waiting
        _step(manager)
        if pending:
            time.sleep(STEP_S)
    seconds = time.perf_counter() - start
    manager.on_request_finished(context)
    return seconds, in_calls / max(calls, 1)


def _throughput(  # noqa: PLR0913 - model and size, then where
    model: str, n_blocks: int, base: Path, system: str, blocks: Sequence[np.ndarray], geo: Any
) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import LookupResult  # noqa: PLC0415

    root = base / system.replace(" ", "-")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    heads, layers, head_dim = geo
    keys = _keys(n_blocks, 1)
    nbytes = n_blocks * blocks[0].size
    with _tiering(model, heads, layers, head_dim, root, system, n_blocks) as manager:
        store_s, store_cpu = _store(manager, keys, blocks)
    drop_cache(root)
    start = time.perf_counter()  # a restart: a new manager and tier over the same files
    with _tiering(model, heads, layers, head_dim, root, system, n_blocks) as manager:
        _resolve(manager, keys[:1], {LookupResult.HIT})
        first_hit_s = time.perf_counter() - start
        drop_cache(root)
        promote_s, _ = _resolve(manager, keys[1:], {LookupResult.HIT})
    shutil.rmtree(root, ignore_errors=True)
    return {
        "system": system,
        "store_gbs": gbs(nbytes, store_s),
        "store_cpu_s_gb": store_cpu / (nbytes / 1e9),
        "promote_gbs": gbs(nbytes - blocks[0].size, promote_s),
        "first_hit_ms": first_hit_s * 1e3,
    }


def _rotated(systems: Sequence[str], k: int) -> list[str]:
    return [*systems[k % len(systems) :], *systems[: k % len(systems)]]


def _taking_turns(  # noqa: PLR0913 - model and size, then where, then how
    model: str,
    n_blocks: int,
    base: Path,
    order: Sequence[str],
    blocks: Sequence[np.ndarray],
    geo: Any,
    slice_blocks: int,
) -> dict[str, dict[str, Any]]:
    """One round of ``run(slice_blocks=...)``: every system in ``order`` stores the same keys,
    then (after a restart) promotes them, the systems taking turns every ``slice_blocks``
    blocks (who goes first rotates from turn to turn), so that they meet the disk at the
    same times. A system's time is the sum of its turns (each drained before the next)."""
    from vllm.v1.kv_offload.base import LookupResult  # noqa: PLC0415

    roots = {s: base / s.replace(" ", "-") for s in order}
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    heads, layers, head_dim = geo
    keys = _keys(n_blocks, 1)
    slices = [keys[i : i + slice_blocks] for i in range(0, n_blocks, slice_blocks)]
    store_s = dict.fromkeys(order, 0.0)
    store_cpu = dict.fromkeys(order, 0.0)
    with ExitStack() as stack:
        managers = {
            s: stack.enter_context(_tiering(model, heads, layers, head_dim, roots[s], s, n_blocks))
            for s in order
        }
        for k, keys_k in enumerate(slices):
            for s in _rotated(order, k):
                seconds, cpu = _store(managers[s], keys_k, blocks)
                store_s[s] += seconds
                store_cpu[s] += cpu
    first_hit_ms: dict[str, float] = {}
    promote_s = dict.fromkeys(order, 0.0)
    with ExitStack() as stack:  # a restart: new managers and tiers over the same files
        managers = {}
        for s in order:
            drop_cache(roots[s])
            start = time.perf_counter()
            managers[s] = stack.enter_context(
                _tiering(model, heads, layers, head_dim, roots[s], s, n_blocks)
            )
            _resolve(managers[s], keys[:1], {LookupResult.HIT})
            first_hit_ms[s] = (time.perf_counter() - start) * 1e3
        for root in roots.values():
            drop_cache(root)
        rest = keys[1:]
        for k, first in enumerate(range(0, len(rest), slice_blocks)):
            for s in _rotated(order, k):
                part = rest[first : first + slice_blocks]
                seconds, _ = _resolve(managers[s], part, {LookupResult.HIT})
                promote_s[s] += seconds
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    nbytes = n_blocks * blocks[0].size
    return {
        s: {
            "system": s,
            "store_gbs": gbs(nbytes, store_s[s]),
            "store_cpu_s_gb": store_cpu[s] / (nbytes / 1e9),
            "promote_gbs": gbs(nbytes - blocks[0].size, promote_s[s]),
            "first_hit_ms": first_hit_ms[s],
        }
        for s in order
    }


def _lookups(base: Path, system: str, size: int) -> dict[str, Any]:
    """Lookup latency in a tier holding ``size`` small blocks (1 layer, 1 head, 4 KiB)."""
    from vllm.v1.kv_offload.base import LookupResult  # noqa: PLC0415

    root = base / f"lookup-{system.replace(' ', '-')}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    block = np.arange(4096, dtype=np.uint8)
    keys = _keys(size, 2)
    with _tiering("bench-lookup", 1, 1, 64, root, system, 4096) as manager:
        for first in range(0, size, 4096):
            _store(manager, keys[first : first + 4096], [block])
    rng = np.random.default_rng(0)
    present = [keys[i] for i in rng.choice(size, min(size, LOOKUP_KEYS), replace=False)]
    absent = _keys(LOOKUP_KEYS, 3)
    resolved = {LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS}
    with _tiering("bench-lookup", 1, 1, 64, root, system, 2 * LOOKUP_KEYS) as manager:
        hit_s, hit_call = _resolve(manager, present, resolved)
        _settle(manager)  # the hits' promotions end before the misses are timed
        miss_s, miss_call = _resolve(manager, absent, resolved)
    shutil.rmtree(root, ignore_errors=True)
    return {
        "system": system,
        "stored": size,
        "hit_ms": hit_s * 1e3,
        "miss_ms": miss_s * 1e3,
        "call_us": (hit_call + miss_call) / 2 * 1e6,
    }


def run(  # noqa: PLR0913 - where, what, how much, then how to measure
    base: Path,
    model: str,
    gib: float,
    sizes: Sequence[int] = (1000, 64000),
    rounds: int = ROUNDS,
    slice_blocks: int | None = None,
) -> dict[str, Any]:
    """Every measurement for every system; ratios to the fs tier measured in the same round.

    Throughput runs ``rounds`` rounds, each measuring every system in an order rotated from
    round to round; a system's figures are the medians over the rounds, its ratios the medians
    of its per-round ratios (each round's ``rounds`` entry keeps them). One round on this
    2-core VM moved by 30-50 %, and the system measured first (or after another's writeback
    on the VM disk) was handicapped in every run of a fixed order. ``slice_blocks``: instead
    of one system after the other, the systems take turns every that many blocks
    (:func:`_taking_turns`; docs/performance.md, tier "Sixth round", for what it showed)."""
    if rounds < 1:
        raise ValueError(f"tier rounds: expected at least 1, got {rounds}")
    if slice_blocks is not None and slice_blocks < 1:
        raise ValueError(f"tier slice_blocks: expected at least 1 block, got {slice_blocks}")
    geometry = load_model(model)
    group = geometry.groups[0]
    geo = (group.num_kv_heads, len(group.layer_ids), group.head_dim)
    blocks = [kv_like_block(geo[0], geo[1], 16, geo[2], seed) for seed in range(8)]
    n_blocks = max(8, int(gib * (1 << 30)) // blocks[0].size)
    base.mkdir(parents=True, exist_ok=True)
    per_round: list[dict[str, dict[str, Any]]] = []
    for k in range(rounds):
        order = _rotated(SYSTEMS, k)
        if slice_blocks is None:
            measured = {s: _throughput(model, n_blocks, base, s, blocks, geo) for s in order}
        else:
            measured = _taking_turns(model, n_blocks, base, order, blocks, geo, slice_blocks)
        fs_round = measured["vllm fs"]
        for row in measured.values():
            row["store_x"] = row["store_gbs"] / fs_round["store_gbs"]
            row["promote_x"] = row["promote_gbs"] / fs_round["promote_gbs"]
            row["first_hit_x"] = fs_round["first_hit_ms"] / row["first_hit_ms"]  # > 1: sooner
        per_round.append(measured)
    rows = [_median_row(s, [m[s] for m in per_round]) for s in SYSTEMS]
    lookups = [_lookups(base, s, size) for size in sizes for s in LOOKUP_SYSTEMS]
    for r in lookups:
        ref = next(x for x in lookups if x["system"] == "vllm fs" and x["stored"] == r["stored"])
        r["hit_x"] = ref["hit_ms"] / r["hit_ms"]  # > 1: faster than fs
        r["miss_x"] = ref["miss_ms"] / r["miss_ms"]
    return {
        "model": model,
        "blocks": n_blocks,
        "block_bytes": blocks[0].size,
        "rows": rows,
        "lookups": lookups,
    }


def _median_row(system: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A system's figures and ratios as medians over its rounds (the rounds kept)."""
    figures = [k for k, v in rounds[0].items() if isinstance(v, float)]
    row: dict[str, Any] = {k: statistics.median(r[k] for r in rounds) for k in figures}
    row["system"] = system
    row["rounds"] = rounds
    return row


def table(result: dict[str, Any]) -> str:
    """The suite's results as text (the same rows go into docs/performance.md by hand)."""
    lines = [
        f"{result['model']}: {result['blocks']} blocks of {result['block_bytes'] >> 10} KiB",
        f"{'system':<14}{'store GB/s':>11}{'x fs':>7}{'CPU s/GB':>10}{'promote GB/s':>14}"
        f"{'x fs':>7}{'first hit ms':>14}{'x fs':>7}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['system']:<14}{r['store_gbs']:>11.2f}{r['store_x']:>7.2f}"
            f"{r['store_cpu_s_gb']:>10.2f}{r['promote_gbs']:>14.2f}{r['promote_x']:>7.2f}"
            f"{r['first_hit_ms']:>14.1f}{r['first_hit_x']:>7.2f}"
        )
    for r in result["rows"]:
        if r["system"] != "vllm fs" and len(r["rounds"]) > 1:
            store = " ".join(f"{x['store_x']:.2f}" for x in r["rounds"])
            promote = " ".join(f"{x['promote_x']:.2f}" for x in r["rounds"])
            lines.append(f"  {r['system']} per round x fs: store {store}; promote {promote}")
    lines.append(
        f"{'system':<14}{'stored':>8}{'256 hits ms':>13}{'x fs':>7}{'256 misses ms':>15}"
        f"{'x fs':>7}{'us/call':>9}"
    )
    for r in result["lookups"]:
        lines.append(
            f"{r['system']:<14}{r['stored']:>8}{r['hit_ms']:>13.1f}{r['hit_x']:>7.2f}"
            f"{r['miss_ms']:>15.1f}{r['miss_x']:>7.2f}{r['call_us']:>9.1f}"
        )
    return "\n".join(lines)
