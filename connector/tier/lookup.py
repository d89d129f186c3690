"""Existence probes of the tier: vLLM's async lookup path in front of the store.

vLLM's :class:`AsyncLookupManager` keeps per-request lookup state, answers RETRY while a probe
runs, posts one batch per step to its thread and serves the verdicts next step;
:class:`StoreProbe` only supplies ``batch_lookup``: which keys have a published block
(:meth:`kvstore.GroupStore.contains`, one batched probe per group array). A key of a group the
namespace does not store is absent.

A probe has a deadline (``lookup_deadline_s``): vLLM's lookup thread hands it to a thread of
its own (:data:`PROBE_THREADS`) and waits at most that long; past it the keys are absent (vLLM
recomputes them) and the store is unresponsive (:class:`connector.tier.health.TierHealth`: one
warning). While it is, the keys are absent at once and no probe is started, so threads stuck in
the hung mount are not joined by more; the stuck probe's return, or any other call's, ends the
episode.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from connector.identity import GROUP_ID_BYTES, KeyMap
from connector.tier.health import DEADLINE, UNRESPONSIVE, TierHealth
from kvstore import Namespace
from kvstore.io.deadline import DaemonWorkers

# Threads running the probes. vLLM's lookup thread waits for one probe at a time, and no
# probe starts while the store is unresponsive: one thread stuck in a hung mount, one more for
# the probes after another call (a store) ended the episode while the first is still stuck.
PROBE_THREADS = 2


class StoreProbe(AsyncLookupManager):  # type: ignore[misc, unused-ignore]  # Any w/o vLLM
    """vLLM's async lookup manager probing a kvstore namespace, within the lookup deadline."""

    def __init__(
        self, namespace: Namespace, key_map: KeyMap, tier_type: str, health: TierHealth
    ) -> None:
        self._namespace = namespace
        # a key's last GROUP_ID_BYTES -> its array (KeyMap.split without the exceptions)
        self._arrays = {
            g.to_bytes(GROUP_ID_BYTES, "big"): a for a, g in enumerate(key_map.group_ids)
        }
        self._health = health
        self._deadline_s = health.deadlines["lookup"].seconds()
        self._workers = DaemonWorkers(PROBE_THREADS, "kvstore-tier-probe")
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """(vLLM's lookup thread) Which keys the store holds; all absent while it is
        unresponsive or past the deadline. A probe that raised raises here (vLLM logs it and
        answers absent)."""
        absent = [False] * len(keys)
        if self._health.hung:  # no probe joins the ones stuck in the mount
            self._health.count("lookup", UNRESPONSIVE, len(keys))
            return absent
        future: Future[list[bool]] = Future()
        self._workers.submit(functools.partial(self._probe, keys, future))
        try:
            return future.result(timeout=self._deadline_s)
        except FutureTimeout:
            self._health.timed_out("lookup", self._deadline_s)
            self._health.count("lookup", DEADLINE, len(keys))
            return absent

    def _probe(self, keys: Sequence[bytes], future: Future[list[bool]]) -> None:
        """(a probe thread) Probe the store; its return, in time or late, tells it answers."""
        try:
            found = self._contains(keys)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(found)
        finally:
            self._health.responsiveness.answered()

    def _contains(self, keys: Sequence[bytes]) -> list[bool]:
        arrays = self._arrays
        by_array: dict[int, list[int]] = defaultdict(list)  # array -> positions in keys
        for i, key in enumerate(keys):
            array = arrays.get(key[-GROUP_ID_BYTES:])
            if array is not None:
                by_array[array].append(i)
        found = [False] * len(keys)
        for array, positions in by_array.items():
            hashes = [keys[i][:-GROUP_ID_BYTES] for i in positions]
            present = self._namespace.group(array).contains(hashes)
            for i, hit in zip(positions, present, strict=True):
                found[i] = hit
        return found

    def shutdown(self) -> None:
        """Stop vLLM's lookup thread (it waits a probe's deadline at most), then the probe
        threads (a stuck one once its call returns)."""
        super().shutdown()
        self._workers.close()


def split_key(key_map: KeyMap, key: bytes) -> tuple[int, bytes] | None:
    """``(array, block hash)`` of a key, None for a group the namespace does not store."""
    try:
        return key_map.split(key)
    except ValueError:
        return None
