"""longest_present_prefix: exact on prefix-closed chains, O(log n) probes, holes detected."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.lookup import longest_present_prefix


class Probe:
    """A ``present`` callback over a set of present positions that counts its calls."""

    def __init__(self, present: Callable[[int], bool]) -> None:
        self._present = present
        self.calls: list[int] = []

    def __call__(self, i: int) -> bool:
        self.calls.append(i)
        return self._present(i)


def log_bound(n: int) -> int:
    """Probes allowed for a chain of n: binary search plus the verification samples."""
    return 2 * math.ceil(math.log2(n + 1)) + 1


def test_empty_chain() -> None:
    probe = Probe(lambda i: True)
    assert longest_present_prefix(0, probe) == 0
    assert probe.calls == []


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_all_present(n: int) -> None:
    probe = Probe(lambda i: True)
    assert longest_present_prefix(n, probe) == n
    assert len(probe.calls) <= log_bound(n)
    assert 0 in probe.calls  # position 0 is always verified


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_none_present(n: int) -> None:
    probe = Probe(lambda i: False)
    assert longest_present_prefix(n, probe) == 0
    assert len(probe.calls) <= log_bound(n)


@pytest.mark.parametrize("n", [1, 3, 10, 100, 257])
def test_every_prefix_length(n: int) -> None:
    for k in range(n + 1):
        probe = Probe(lambda i, k=k: i < k)  # type: ignore[misc]
        assert longest_present_prefix(n, probe) == k, k
        assert len(probe.calls) == len(set(probe.calls)), "a position was probed twice"
        assert len(probe.calls) <= log_bound(n), (k, len(probe.calls))


def test_probe_count_is_logarithmic() -> None:
    n = 1 << 16
    probe = Probe(lambda i: i < 40_000)
    assert longest_present_prefix(n, probe) == 40_000
    assert len(probe.calls) <= log_bound(n)  # 35 of 65536
    assert len(probe.calls) >= math.ceil(math.log2(n + 1))  # a binary search, not a guess


def sampled_positions(length: int) -> list[int]:
    """The verification probes below ``length``: length-2, -3, -5, -9, -17, ..., and 0."""
    out = []
    step = 2
    while length - step > 0:
        out.append(length - step)
        step = step * 2 - 1 if step > 2 else 3
    return [*out, 0]


def test_sampled_positions_are_exponential() -> None:
    assert sampled_positions(64) == [62, 61, 59, 55, 47, 31, 0]


@pytest.mark.parametrize("hole", sampled_positions(64))
def test_hole_below_boundary_found_by_verification(hole: int) -> None:
    """Every block present except ``hole``: the binary search alone would answer 64."""
    probe = Probe(lambda i: i != hole)
    assert longest_present_prefix(64, probe) == hole
    assert hole in probe.calls
    assert len(probe.calls) == len(set(probe.calls))
    assert len(probe.calls) <= 2 * log_bound(64)


def test_hole_at_zero_with_long_tail() -> None:
    probe = Probe(lambda i: i != 0)
    assert longest_present_prefix(1000, probe) == 0


def test_unsampled_hole_is_documented_limit() -> None:
    """A hole no probe visits is not seen (caught later by the read); the answer is n."""
    probe = Probe(lambda i: i != 10)
    assert longest_present_prefix(64, probe) == 64
    assert 10 not in probe.calls


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 80).flatmap(
        lambda n: st.tuples(st.just(n), st.sets(st.integers(0, max(n - 1, 0))))
    )
)
def test_answer_is_a_verified_boundary(case: tuple[int, set[int]]) -> None:
    """With arbitrary holes the answer r is never below the true prefix, position r was seen
    missing (or r == n), r-1 and 0 were seen present, and no probe is repeated."""
    n, holes = case
    present = {i for i in range(n) if i not in holes}
    probe = Probe(lambda i: i in present)
    r = longest_present_prefix(n, probe)
    true_prefix = next((i for i in range(n) if i not in present), n)
    assert true_prefix <= r <= n
    if r < n:
        assert r in probe.calls and r not in present
    if r > 0:
        assert r - 1 in probe.calls and r - 1 in present
        assert 0 in present
    assert len(probe.calls) == len(set(probe.calls))
    if holes & set(range(n)) == set(range(true_prefix, n)):
        assert r == true_prefix  # prefix-closed: exact
