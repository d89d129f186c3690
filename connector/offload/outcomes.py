"""What the worker's transfer jobs report: each job's outcome, and the failures kept for the
connector.

A job thread of :class:`connector.offload.worker.KVStoreWorker` returns an :class:`Outcome`:
the bytes this rank moved, and the keys (and, for loads, GPU block ids) that failed, each with
its :mod:`connector.offload.metrics` cause. A job that failed as a whole (it raised, was given
up at its deadline, or failed at once on a store found unresponsive) gets one from
:func:`failed` or :func:`unresponsive`, every one of its blocks failed.

:class:`FailureReports` takes the outcome of every job ``get_finished`` reports: one log line
per failed job (a debug line where only the hung store is to blame: its episode was told once),
and the failures kept until the connector
(:class:`connector.offload.vllm_connector.KVStoreConnector`) drains them: the keys of failed
stores and loads with their causes (for the scheduler, on every vLLM version) and, for loads
not reported to vLLM as failed jobs, the GPU block ids and requests that failed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from connector.offload import metrics as m
from connector.offload.metrics import error_cause, merge_causes
from kvstore import StoreTimeoutError
from kvstore.store.types import ReadStatus

log = logging.getLogger("kvstore.connector")


@dataclass
class Outcome:
    """What one job did on this rank."""

    nbytes: int = 0
    failed_keys: list[bytes] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    causes: dict[bytes, str] = field(default_factory=dict)  # failed key -> metrics cause
    whole_job: bool = False  # the job failed as a whole (raised, given up, failed fast)


class ReportedJob(Protocol):
    """What a failure report names of its job (the worker's record of it)."""

    job_id: int
    is_load: bool
    keys: Sequence[bytes]  # stores: the keys this rank writes
    req_id: str


class FailureReports:
    """The failures of finished jobs, kept until the connector takes them."""

    def __init__(self) -> None:
        self._load_error_blocks: set[int] = set()
        self._failed_load_requests: set[str] = set()
        self._failed_store_keys: list[bytes] = []
        self._failed_load_keys: list[bytes] = []
        self._failure_causes: dict[bytes, str] = {}  # failed key -> connector.offload.metrics cause

    def record(self, job: ReportedJob, outcome: Outcome, vllm_recomputes_request: bool) -> None:
        """Log a failed job and keep its failures (nothing for a job without any)."""
        if not outcome.failed_keys:
            return
        kind = "load" if job.is_load else "store"
        detail = ", ".join(f"{n} {r}" for r, n in outcome.reasons.most_common())
        if not job.is_load:
            consequence = "they are not published"
        elif vllm_recomputes_request:
            consequence = "reported as a failed job: the engine recomputes the request"
        else:
            consequence = "the engine recomputes them"
        # A hung store's jobs are told once per episode (Responsiveness), not once each.
        hung = set(outcome.causes.values()) <= {m.TIMEOUT, m.UNRESPONSIVE_REASON}
        (log.debug if hung else log.warning)(
            "kvstore: %s job %d: %d of %d blocks failed (%s); %s",
            kind,
            job.job_id,
            len(outcome.failed_keys),
            len(job.keys),
            detail,
            consequence,
        )
        merge_causes(self._failure_causes, outcome.causes)
        if job.is_load:
            self._failed_load_keys.extend(outcome.failed_keys)
            if not vllm_recomputes_request:
                self._load_error_blocks.update(outcome.failed_blocks)
                if job.req_id:
                    self._failed_load_requests.add(job.req_id)
        else:
            self._failed_store_keys.extend(outcome.failed_keys)

    def take_load_error_blocks(self) -> set[int]:
        """GPU block ids whose load failed since the last call."""
        out, self._load_error_blocks = self._load_error_blocks, set()
        return out

    def take_failed_load_requests(self) -> set[str]:
        """Requests with a failed load since the last call."""
        out, self._failed_load_requests = self._failed_load_requests, set()
        return out

    def take_failed_keys(self) -> tuple[list[bytes], list[bytes]]:
        """(keys of failed stores, keys of failed loads) since the last call."""
        out = (self._failed_store_keys, self._failed_load_keys)
        self._failed_store_keys, self._failed_load_keys = [], []
        return out

    def take_failure_causes(self) -> dict[bytes, str]:
        """Why each key of :meth:`take_failed_keys` failed (:mod:`.metrics` causes)."""
        out, self._failure_causes = self._failure_causes, {}
        return out


def fail(
    outcome: Outcome,
    keys: Sequence[bytes],
    blocks: Sequence[int],
    exc: Any,
    cause: str | None = None,
) -> None:
    """Add ``keys`` (and GPU ``blocks``) to ``outcome`` as failed with ``exc`` (and ``cause``,
    else the cause ``exc`` tells)."""
    outcome.failed_keys.extend(keys)
    outcome.failed_blocks.extend(blocks)
    outcome.reasons[_error_text(exc)] += len(keys)
    cause = cause or error_cause(exc)
    for key in keys:
        outcome.causes[key] = cause


def failed(
    keys: Sequence[bytes], blocks: Sequence[int], exc: BaseException, cause: str | None = None
) -> Outcome:
    """A job failed as a whole: all of its blocks, with ``exc`` (and ``cause``, else the
    cause ``exc`` tells)."""
    outcome = Outcome(whole_job=True)
    fail(outcome, keys, blocks, exc, cause)
    return outcome


def unresponsive(keys: Sequence[bytes], blocks: Sequence[int]) -> Outcome:
    """A job failed at once, never sent to a store found unresponsive."""
    error = StoreTimeoutError("the store is unresponsive: not tried")
    return failed(keys, blocks, error, m.UNRESPONSIVE_REASON)


def read_reason(status: ReadStatus) -> str:
    """The log line's words for a block read that failed with ``status``."""
    return {
        ReadStatus.MISS: "missing",
        ReadStatus.CORRUPT: "corrupt, quarantined",
        ReadStatus.ERROR: "read error",
    }.get(status, status.value)


def _error_text(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
