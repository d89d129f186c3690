"""The tier's job threads: loads and stores on separate pools, outcomes polled without blocking,
and each job's deadline.

vLLM calls ``submit_store`` / ``submit_load`` on its scheduler thread and polls
``get_finished_jobs`` once per step; neither may block. :class:`JobRunner` runs each job's
parts on a pool of its kind (promotions never wait behind a backlog of writes), and queues the
job's outcome for :meth:`JobRunner.finished` once all parts are done. A part never raises into
vLLM: an exception is logged once with the job and fails that part's keys.

**Gates.** A part touches vLLM's CPU-tier rows only under its own
:class:`kvstore.io.deadline.DeliveryGate`: it claims the gate before the first byte it copies
into or out of the rows and releases it after the last. A job may be reported before all of
its parts ended (below); its parts not ended are then *cut short*: their gates are abandoned,
so a part that had not claimed its gate never touches the rows (one still queued does no I/O
at all), and their keys fail without having been found bad. A part that holds its claim is
still copying: the job is reported once it released (a copy in memory, short), except a
promotion with ``defers_release`` (vLLM 0.34's ``JobResult.deferred_release``), which is
reported at once with :attr:`Finished.release`: vLLM fails its keys but keeps their CPU chunks
out of its free pool until the event is set, once no part cut short holds its claim.

**Deadlines.** Each job has one from its submission, ``Deadline.seconds(its bytes)``, so a job
queued behind threads stuck in a hung mount fails in time too: past it the job is reported
failed, cut short (``timed_out``). Separately, a part that has been in its call longer than the
deadline of its own bytes is *overdue* (:meth:`JobRunner.overdue_calls`, once per part): the
store did not answer it, which starts an unresponsive episode. A job that failed only because
it waited in the queue does not: the store answers, it is busy, and vLLM's backpressure sees
the failure.

**Early failures** (with ``defers_release``): a promotion that failed is reported as soon as
every part before its first failed one has ended, its other parts cut short as above.

The pools are a fixed few daemon threads (:class:`~kvstore.io.deadline.DaemonWorkers`): while
the mount hangs the threads stuck in it stay stuck, none is added, and none holds up the
interpreter's exit.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvstore.io.deadline import DaemonWorkers, Deadline, DeliveryGate

log = logging.getLogger("kvstore.connector")

Kind = Literal["load", "store"]
LOAD: Kind = "load"
STORE: Kind = "store"

# How often wait_idle looks at the deadlines while no part ends.
IDLE_POLL_S = 0.01


@dataclass(frozen=True)
class Outcome:
    """What a job function reports: which of its keys succeeded, and the bytes moved."""

    ok_keys: frozenset[bytes]
    nbytes: int


NOTHING = Outcome(frozenset(), 0)


@dataclass(frozen=True)
class Part:
    """One part of a job: its function (given the part's gate), its keys and its bytes."""

    run: Callable[[DeliveryGate], Outcome]
    keys: frozenset[bytes]
    nbytes: int


@dataclass(frozen=True)
class Finished:
    """A finished job: its id, its merged outcome and the seconds from submission to report.

    A job reported before all of its parts ended (past its deadline, ``timed_out``; or an
    early failure) names the keys of the parts cut short (``cut_short``: failed, not found
    bad) and, where a part cut short still held its claim, the event set once none does
    (``release``)."""

    job_id: int
    outcome: Outcome
    seconds: float
    cut_short: frozenset[bytes] = frozenset()
    release: threading.Event | None = None
    timed_out: bool = False


class JobRunner:
    """Runs the parts of load and store jobs on their pools; reports their merged outcomes,
    by their deadlines at the latest.

    A job comes in parts (batches of its blocks) that run concurrently on the job kind's pool,
    so one large job (vLLM submits a request's promotions as one) keeps every thread busy; the
    job finishes when its last part does, with the union of the parts' outcomes (a part that
    raised contributes nothing: its keys failed). Thread-safe; ``submit``, ``refuse``,
    ``finished``, ``overdue_calls`` and ``late`` never block."""

    def __init__(
        self,
        load_threads: int,
        store_threads: int,
        defers_release: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._defers_release = defers_release
        self._clock = clock
        self._pools = {
            LOAD: DaemonWorkers(load_threads, "kvstore-tier-load"),
            STORE: DaemonWorkers(store_threads, "kvstore-tier-store"),
        }
        self._lock = threading.Condition()
        self._jobs: dict[int, _Job] = {}  # submitted, until reported with every part ended
        self._unreported = 0
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, job id)
        self._giving_up: set[_Job] = set()  # cut short, waiting for a claimed copy to end
        self._late: set[_Job] = set()  # reported, some part not ended
        self._running: dict[_Part, _Job] = {}  # parts in their call
        self._next_overdue = math.inf  # no part in its call is overdue before this time
        self._done: list[Finished] = []

    def submit(self, job_id: int, kind: Kind, parts: Sequence[Part], deadline: Deadline) -> None:
        """Run ``parts`` on the pool of ``kind`` (non-blocking), within ``deadline`` of their
        bytes; an empty job finishes now.

        The caller (vLLM's scheduler thread) hands the pool one task: that task submits the
        job's other parts and runs the first. Submitting every part from here cost the
        scheduler ~3 ms per 256-block promotion (8 parts: each woken pool thread takes the
        GIL from it), against 0.5 ms for vLLM's fs tier (tier suite, 1 ms steps)."""
        now = self._clock()
        job = _Job(
            job_id,
            kind,
            [_Part(p, i, deadline.seconds(p.nbytes)) for i, p in enumerate(parts)],
            now,
            now + deadline.seconds(sum(p.nbytes for p in parts)),
        )
        with self._lock:
            self._jobs[job_id] = job
            self._unreported += 1
            if not parts:
                self._report(job, now)
                return
            heapq.heappush(self._deadlines, (job.deadline, job_id))
        self._pools[kind].submit(functools.partial(self._fan_out, job))

    def refuse(self, job_id: int, keys: Iterable[bytes]) -> None:
        """Report a job failed without running it (the store is unresponsive): its keys are
        cut short, not found bad."""
        with self._lock:
            self._done.append(Finished(job_id, NOTHING, 0.0, cut_short=frozenset(keys)))

    def _fan_out(self, job: _Job) -> None:
        pool = self._pools[job.kind]
        for part in job.parts[1:]:
            pool.submit(functools.partial(self._run, job, part))
        self._run(job, job.parts[0])

    def _run(self, job: _Job, part: _Part) -> None:
        with self._lock:
            if part.gate.abandoned:  # cut short while queued: no I/O at all
                self._ended(job, part, None)
                return
            part.started = self._clock()
            self._running[part] = job
            self._next_overdue = min(self._next_overdue, part.started + part.limit_s)
        outcome: Outcome | None
        try:
            outcome = part.spec.run(part.gate)
        except Exception:
            log.exception("kvstore tier: a part of job %d failed", job.job_id)
            outcome = None
        finally:
            part.gate.release()  # a part that raised while copying copies no more
        with self._lock:
            del self._running[part]
            self._ended(job, part, outcome)

    def _ended(self, job: _Job, part: _Part, outcome: Outcome | None) -> None:
        """(lock held) Part ``part`` of ``job`` ended with ``outcome`` (None: none)."""
        part.ended = True
        if not job.reported:
            if outcome is not None:
                job.ok_keys |= outcome.ok_keys
                job.nbytes += outcome.nbytes
            if outcome is None or not part.spec.keys <= outcome.ok_keys:
                job.failed.add(part.index)
            if job.giving_up is not None:  # it waited for this part's copy
                self._try_report(job)
            elif all(p.ended for p in job.parts):
                self._report(job, self._clock())
            elif self._defers_release and job.kind == LOAD and job.settled_failure():
                self._give_up(job, timed_out=False)
        self._settle(job)
        self._lock.notify_all()

    def _give_up(self, job: _Job, timed_out: bool) -> None:
        """(lock held) Report ``job`` before its parts ended: abandon every part's gate, then
        report as soon as no part cut short holds its claim (see the module docstring)."""
        job.giving_up = timed_out
        for part in job.parts:
            if not part.ended:
                part.gate.abandon()
        self._giving_up.add(job)
        self._try_report(job)

    def _try_report(self, job: _Job) -> None:
        """(lock held) Report a job being given up on, unless a part cut short is copying
        and vLLM cannot hold its chunks meanwhile (then a later poll or part end does)."""
        unended = [p for p in job.parts if not p.ended]
        claimed = any(p.gate.delivering for p in unended)
        if claimed and not (self._defers_release and job.kind == LOAD):
            return
        cut_short = frozenset[bytes]().union(*(p.spec.keys for p in unended))
        release = threading.Event() if claimed else None
        self._report(job, self._clock(), cut_short, release, bool(job.giving_up))

    def _report(
        self,
        job: _Job,
        now: float,
        cut_short: frozenset[bytes] = frozenset(),
        release: threading.Event | None = None,
        timed_out: bool = False,
    ) -> None:
        """(lock held) Queue the job's outcome for :meth:`finished`."""
        job.reported = True
        job.release = release
        self._unreported -= 1
        self._giving_up.discard(job)
        outcome = Outcome(frozenset(job.ok_keys), job.nbytes)
        seconds = now - job.submitted
        self._done.append(Finished(job.job_id, outcome, seconds, cut_short, release, timed_out))
        self._settle(job)

    def _settle(self, job: _Job) -> None:
        """(lock held) For a reported job: set its release once no part holds its claim;
        forget it once every part ended."""
        if not job.reported:
            return
        unended = [p for p in job.parts if not p.ended]
        if job.release is not None and not any(p.gate.delivering for p in unended):
            job.release.set()
        if unended:
            self._late.add(job)
        else:
            self._late.discard(job)
            self._jobs.pop(job.job_id, None)

    def _poll(self) -> None:
        """(lock held) Give up on the jobs past their deadline; report those given up on whose
        copies ended; set the releases due."""
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, job_id = heapq.heappop(self._deadlines)
            job = self._jobs.get(job_id)
            if job is not None and not job.reported and job.giving_up is None:
                self._give_up(job, timed_out=True)
        for job in list(self._giving_up):
            self._try_report(job)
        for job in list(self._late):
            self._settle(job)

    def finished(self) -> list[Finished]:
        """Jobs finished, or given up on, since the last call (non-blocking)."""
        with self._lock:
            self._poll()
            done, self._done = self._done, []
        return done

    def overdue_calls(self) -> list[tuple[Kind, float]]:
        """``(kind, seconds in its call)`` of each part that has been in its call longer than
        the deadline of its bytes, once per part: the store has not answered it. One clock
        read while none is due (callers ask at every lookup)."""
        now = self._clock()
        out: list[tuple[Kind, float]] = []
        if now < self._next_overdue:
            return out
        with self._lock:
            self._next_overdue = math.inf
            for part, job in self._running.items():
                if part.overdue or part.started is None:
                    continue
                if now - part.started > part.limit_s:
                    part.overdue = True
                    out.append((job.kind, now - part.started))
                else:
                    self._next_overdue = min(self._next_overdue, part.started + part.limit_s)
        return out

    def late(self) -> tuple[dict[str, int], dict[str, int]]:
        """Parts of jobs already reported that are still in their call, and their bytes, per
        kind: the threads and buffers the file system holds."""
        parts: dict[str, int] = {LOAD: 0, STORE: 0}
        nbytes: dict[str, int] = {LOAD: 0, STORE: 0}
        with self._lock:
            for part, job in self._running.items():
                if job.reported:
                    parts[job.kind] += 1
                    nbytes[job.kind] += part.spec.nbytes
        return parts, nbytes

    def wait_idle(self) -> None:
        """Block until every submitted job has been reported (finished, or given up on by its
        deadline) and every release of a job reported early is set: after it no part touches
        vLLM's rows. Bounded by the deadlines, except a promotion with ``defers_release``
        whose read into the rows hangs: it is waited for."""
        with self._lock:
            while True:
                self._poll()
                held = any(j.release is not None and not j.release.is_set() for j in self._late)
                if not self._unreported and not held:
                    return
                self._lock.wait(IDLE_POLL_S)

    def shutdown(self) -> None:
        """Report the jobs in flight (:meth:`wait_idle`) and stop the threads; a thread stuck in
        the file system ends once its call returns."""
        self.wait_idle()
        for pool in self._pools.values():
            pool.close()


@dataclass(eq=False)
class _Part:
    """A part of a job as it runs."""

    spec: Part
    index: int
    limit_s: float  # the deadline of its own bytes, from its start (overdue_calls)
    gate: DeliveryGate = field(default_factory=DeliveryGate)
    started: float | None = None
    ended: bool = False
    overdue: bool = False  # reported by overdue_calls


@dataclass(eq=False)
class _Job:
    """A job's parts and what the ended ones achieved."""

    job_id: int
    kind: Kind
    parts: list[_Part]
    submitted: float
    deadline: float
    ok_keys: set[bytes] = field(default_factory=set)
    nbytes: int = 0
    failed: set[int] = field(default_factory=set)  # indices of the parts that failed a key
    giving_up: bool | None = None  # being cut short: past its deadline (True) or early (False)
    reported: bool = False
    release: threading.Event | None = None

    def settled_failure(self) -> bool:
        """Whether a part failed and every part before the first failed one has ended."""
        if not self.failed:
            return False
        first = min(self.failed)
        return all(p.ended for p in self.parts[:first])
