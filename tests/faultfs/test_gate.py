"""faultfs's rules without FUSE: which operations a freeze or delay holds, and for how long."""

from __future__ import annotations

import threading
import time

import pytest

from tests.faultfs.gate import Gate, Rule, op_classes


def _passes_within(gate: Gate, seconds: float, op: str, *paths: str) -> bool:
    """Does ``op`` on ``paths`` get through ``gate`` within ``seconds`` (in a thread)?"""
    thread = threading.Thread(target=gate.passage, args=(op, op, *paths), daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_operation_classes() -> None:
    assert op_classes("all") == {"lookup", "read", "write"}
    assert op_classes(["read", "write"]) == {"read", "write"}
    assert op_classes(["link", "fsync"]) == {"link", "fsync"}
    for bad in ("stat", [], ["read", "readdirplus"]):
        with pytest.raises(ValueError, match="expected operation classes"):
            op_classes(bad)


def test_a_rule_matches_its_classes_and_glob() -> None:
    rule = Rule(frozenset({"read"}), "store/*/c/*", None)
    assert rule.matches("read", "read", ("store/ns/c/0/1",), 0.0)
    assert not rule.matches("read", "read", ("store/ns/zarr.json",), 0.0)
    assert not rule.matches("lookup", "getattr", ("store/ns/c/0/1",), 0.0)
    # a rename matches by either name
    assert rule.matches("read", "read", ("elsewhere", "store/ns/c/0/1"), 0.0)
    expired = Rule(frozenset({"read"}), None, None, until=1.0)
    assert expired.matches("read", "read", ("x",), 0.5)
    assert not expired.matches("read", "read", ("x",), 1.0)
    link = Rule(frozenset({"link"}), None, None)  # one operation of the write class
    assert link.matches("write", "link", ("x",), 0.0)
    assert not link.matches("write", "create", ("x",), 0.0)


def test_a_freeze_holds_until_thaw_and_counts_what_it_holds() -> None:
    gate = Gate()
    gate.freeze("read", "a/*")
    assert _passes_within(gate, 1.0, "read", "b/x")  # another path
    assert _passes_within(gate, 1.0, "lookup", "a/x")  # another class
    held = threading.Thread(target=gate.passage, args=("read", "read", "a/x"), daemon=True)
    held.start()
    time.sleep(0.2)
    assert held.is_alive() and gate.stats()["blocked"] == {"read": 1}
    gate.thaw()
    held.join(2.0)
    assert not held.is_alive() and gate.stats()["blocked"] == {"read": 0}


def test_a_forgotten_freeze_ends_by_itself() -> None:
    gate = Gate(freeze_limit_s=0.3)
    gate.freeze("all")
    start = time.monotonic()
    gate.passage("write", "create", "x")
    assert 0.25 <= time.monotonic() - start < 5


def test_a_delay_slows_and_zero_removes_it() -> None:
    gate = Gate()
    gate.delay(["lookup", "read"], 0.3)
    start = time.monotonic()
    gate.passage("read", "read", "x")
    assert time.monotonic() - start >= 0.29
    gate.delay("read", 0)
    start = time.monotonic()
    gate.passage("read", "read", "x")
    assert time.monotonic() - start < 0.2
    start = time.monotonic()
    gate.passage("lookup", "getattr", "x")  # the lookup delay stays
    assert time.monotonic() - start >= 0.29
    with pytest.raises(ValueError, match="seconds >= 0"):
        gate.delay("read", -1)


def test_clear_releases_delays_and_freezes_at_once() -> None:
    gate = Gate()
    gate.delay("read", 60)
    gate.freeze("write")
    threads = [
        threading.Thread(target=gate.passage, args=(c, name, "x"), daemon=True)
        for c, name in (("read", "read"), ("write", "create"))
    ]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert gate.stats()["delayed"] == {"read": 1} and gate.stats()["blocked"] == {"write": 1}
    gate.clear()
    for t in threads:
        t.join(2.0)
        assert not t.is_alive()
    assert gate.stats()["calls"] == {"read": 1, "write": 1}
    assert gate.stats()["ops"] == {"read": 1, "create": 1}
