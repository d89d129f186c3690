"""``admit_after``: a block is stored once it was seen that many times, and the rest counted.

Driven through vLLM 0.33's real Scheduler (tests/connector/harness.py, metered.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from vllm.v1.kv_offload.base import ReqContext

from connector.offload import metrics as m
from connector.offload.admission import Admission
from kvstore import KVStore, StoreConfig

from .harness import prompt
from .metered import engine
from .test_failures import PROMPT


def test_admit_after_two_stores_a_prefix_on_its_second_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(monkeypatch, root=tmp_path, extra={"admit_after": 2})
    first = e.engine.serve("first", PROMPT)
    assert e.value(m.STORE_SKIPPED_BLOCKS, m.NOT_ADMITTED) == 5
    assert e.value(m.STORED_BLOCKS) == 0
    name = e.engine.manager.namespace.name
    with KVStore(StoreConfig(root=tmp_path)) as store:
        assert store.open_namespace(name).group(0).contains(first.block_hashes) == [False] * 5
    # The same prefix again (GPU prefix cache wiped): seen twice, stored.
    e.engine.wipe_kv()
    assert e.engine.scheduler.reset_prefix_cache()
    e.engine.serve("second", [*PROMPT, 5])
    assert e.value(m.STORED_BLOCKS) == 5
    assert e.value(m.STORE_SKIPPED_BLOCKS, m.NOT_ADMITTED) == 5  # unchanged
    assert e.engine.manager.admission.tracked == 0  # admitted keys are forgotten
    with KVStore(StoreConfig(root=tmp_path)) as store:
        assert store.open_namespace(name).group(0).contains(first.block_hashes) == [True] * 5
    # A prompt seen once is not stored.
    e.engine.serve("other", prompt(2 * 16 + 1, start=9000))
    assert e.value(m.STORE_SKIPPED_BLOCKS, m.NOT_ADMITTED) == 7
    assert e.value(m.STORED_BLOCKS) == 5
    e.engine.shutdown()


def test_a_request_counts_once_however_often_it_asks() -> None:
    admission = Admission(admit_after=3, capacity=10)
    a, b, c = ReqContext("a"), ReqContext("b"), ReqContext("c")
    key = b"k" * 36
    assert [admission.see(key, a) for _ in range(4)] == [1, 1, 1, 1]
    assert not admission.admit(key, a)
    assert not admission.admit(key, b)  # second request
    assert admission.admit(key, c)  # third request: admitted, and forgotten
    assert admission.tracked == 0


def test_admission_counts_are_bounded() -> None:
    admission = Admission(admit_after=2, capacity=2)
    context = ReqContext("a")
    for i in range(5):
        admission.see(bytes([i]) * 36, context)
    assert admission.tracked == 2  # the least recently seen fell out


def test_admit_after_one_tracks_nothing() -> None:
    admission = Admission(admit_after=1, capacity=2)
    assert admission.admit(b"k" * 36, ReqContext("a"))
    assert admission.tracked == 0
