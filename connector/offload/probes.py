"""The scheduler's existence probes: which keys the shared store holds, asked in the background.

:class:`connector.offload.manager.KVStoreManager` answers a lookup it cannot answer from memory
with RETRY and hands the key to :class:`ExistenceProbes`: keys are batched (``probe_batch`` per
task) and flushed at the end of the step onto the manager's probe threads; vLLM asks again at
its next step, when the answer may be in. A key probed absent is a miss for ``miss_ttl_s``.

A probe not answered within ``lookup_deadline_s`` (a frozen NFS server, a wedged FUSE daemon)
answers its keys MISS at once (vLLM recomputes them) and becomes *late*: the manager starts an
unresponsive episode, and the late probe's return is what tells it the store answers again.
Everything here runs on the scheduler thread except :meth:`ExistenceProbes.probe`.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

from connector.config import ConnectorConfig
from connector.identity import KeyMap
from connector.offload import metrics as m
from connector.offload.executor import PriorityExecutor
from connector.offload.metrics import StoreMetrics
from kvstore import Namespace

log = logging.getLogger("kvstore.connector")

# What a probe returns: each key, and whether the store holds its block.
Probed = list[tuple[bytes, bool]]


class ExistenceProbes:
    """Batched background existence probes, their deadline, and the misses they leave."""

    def __init__(  # noqa: PLR0913 - keyword-only: the manager's collaborators a probe needs
        self,
        *,
        pool: PriorityExecutor,
        namespace: Namespace,
        key_map: KeyMap,
        options: ConnectorConfig,
        metrics: StoreMetrics,
        now: Callable[[], float],
        remember: Callable[[bytes], None],
    ) -> None:
        self._pool = pool
        self._namespace = namespace
        self._key_map = key_map
        self._options = options
        self._metrics = metrics
        self._now = now
        self._remember = remember  # a key the store holds: the manager's present view
        self.absent: dict[bytes, float] = {}  # key -> time its miss answer expires
        self.probing: set[bytes] = set()  # queued or in flight
        self.queue: list[bytes] = []  # asked this step, not yet submitted
        # (keys, future, when submitted); past lookup_deadline_s a probe moves to ``late``
        self.in_flight: list[tuple[list[bytes], Future[Probed], float]] = []
        self.late: list[tuple[list[bytes], Future[Probed]]] = []

    def known_absent(self, key: bytes) -> bool:
        """Whether ``key`` was probed absent less than ``miss_ttl_s`` ago."""
        expires = self.absent.get(key)
        if expires is None:
            return False
        if expires > self._now():
            return True
        del self.absent[key]
        return False

    def ask(self, key: bytes) -> None:
        """Queue ``key`` for a probe (once while one is queued or in flight)."""
        if key not in self.probing:
            self.probing.add(key)
            self.queue.append(key)
            if len(self.queue) >= self._options.probe_batch:
                self.flush(unresponsive=False)

    def flush(self, *, unresponsive: bool) -> None:
        """Submit the queued keys, ``probe_batch`` per task; while the store is unresponsive
        they are answered missing instead (nothing joins the threads stuck in it)."""
        batch, self.queue = self.queue, []
        if unresponsive:
            self.answer_missing(batch)
            return
        now = self._now()
        for start in range(0, len(batch), self._options.probe_batch):
            chunk = batch[start : start + self._options.probe_batch]
            future = self._pool.submit(0, functools.partial(self.probe, chunk))
            self.in_flight.append((chunk, future, now))

    def answer_missing(self, keys: Sequence[bytes]) -> None:
        """Keys whose probe the store did not answer in time: misses for ``miss_ttl_s``."""
        expires = self._now() + self._options.miss_ttl_s
        for key in keys:
            self.probing.discard(key)
            self.absent[key] = expires
        self._metrics.count(m.LOOKUP_TIMEOUTS, len(keys))

    def probe(self, keys: Sequence[bytes]) -> Probed:
        """(background) Which keys have a published block."""
        by_array: dict[int, list[bytes]] = defaultdict(list)
        for key in keys:
            by_array[self._key_map.split(key)[0]].append(key)
        out: Probed = []
        for array, group_keys in by_array.items():
            hashes = [self._key_map.split(k)[1] for k in group_keys]
            contains = self._namespace.group(array).contains(hashes)
            out.extend(zip(group_keys, contains, strict=True))
        return out

    def collect(self) -> float | None:
        """Apply the probes that returned; answer missing those past ``lookup_deadline_s``
        and keep them as late. The longest wait of a probe that just went late, or None."""
        if not self.in_flight:
            return None
        waiting = []
        went_late: float | None = None
        now = self._now()
        for keys, future, started in self.in_flight:
            if not future.done():
                if now - started > self._options.lookup_deadline_s:
                    self.answer_missing(keys)
                    self.late.append((keys, future))
                    went_late = max(went_late or 0.0, now - started)
                else:
                    waiting.append((keys, future, started))
                continue
            try:
                results = future.result()
            except Exception:
                log.exception("kvstore: an existence probe failed; keys will be probed again")
                self.probing.difference_update(keys)
                continue
            self.apply(results)
        self.in_flight = waiting
        return went_late

    def collect_late(self) -> bool:
        """Apply the late probes that returned: whether any did (the store answered)."""
        if not any(f.done() for _, f in self.late):
            return False
        returned = [(keys, f) for keys, f in self.late if f.done()]
        self.late = [(keys, f) for keys, f in self.late if not f.done()]
        for _keys, future in returned:
            if future.exception() is None:
                self.apply(future.result())
        return True

    def apply(self, results: Iterable[tuple[bytes, bool]]) -> None:
        """A probe's answers: present keys to the manager's view, absent ones as misses."""
        expires = self._now() + self._options.miss_ttl_s
        for key, present in results:
            self.probing.discard(key)
            if present:
                self._remember(key)
            else:
                self.absent[key] = expires
        if len(self.absent) > self._options.index_capacity:
            now = self._now()
            self.absent = {k: t for k, t in self.absent.items() if t > now}

    @property
    def pending(self) -> bool:
        """Probes queued or running within their deadline (work the engine steps for)."""
        return bool(self.queue or self.in_flight)

    def futures(self) -> list[Future[Probed]]:
        """Every probe submitted and not yet applied, late ones included."""
        return [f for _, f, _ in self.in_flight] + [f for _, f in self.late]
