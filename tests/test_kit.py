"""The harness pieces suites build on: forced interleavings and boundary strategies."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings

from katas._harness.interleave import Gate, Parked
from katas._harness.strategies import around, near, sizes
from katas._harness.waiting import spawn


def test_a_gate_parks_a_thread_until_it_opens() -> None:
    gate = Gate("inside the loader")
    seen: list[str] = []
    thread = spawn(lambda: gate.wrap(seen.append)("loaded"), "leader")
    gate.wait_arrived()
    assert seen == [] and thread.is_alive()
    gate.open()
    thread.outcome("the leader returns once the gate is open")
    assert seen == ["loaded"] and gate.arrivals == 1


def test_a_gate_with_a_limit_parks_only_the_first_arrivals() -> None:
    gate = Gate("first only", limit=1)
    first = spawn(gate.pass_through, "first")
    gate.wait_arrived()
    gate.pass_through()  # the second arrival passes at once
    assert first.is_alive()
    gate.open()
    first.outcome("released")


def test_parked_holds_the_chosen_methods_and_counts_who_is_inside() -> None:
    gate = Gate("inside put")
    inner: dict[str, int] = {}
    parked = Parked(inner, gate, at={"__setitem__", "update"})
    lock = threading.Lock()

    def put() -> None:
        with lock:  # the code under test holds its lock around the inner call
            parked.update(a=1)

    thread = spawn(put, "writer")
    gate.wait_arrived()
    assert parked.inside == 1 and lock.locked() and inner == {}
    assert parked.get("a") is None  # other methods are not held
    gate.open()
    thread.outcome("the writer finishes")
    assert inner == {"a": 1} and parked.most_inside == 2


def test_a_gate_that_is_never_opened_fails_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("katas._harness.interleave.DEADLINE_S", 0.01)
    with pytest.raises(AssertionError, match="never opened it"):
        Gate("forgotten").pass_through()


@settings(max_examples=50)
@given(around(100, spread=1), near([0, 500], 0, 1000), sizes(8))
def test_boundary_strategies_stay_in_range(a: int, n: int, size: int) -> None:
    assert a in (99, 100, 101) and 0 <= n <= 1000 and 0 <= size <= 16


def test_boundary_strategies_reach_the_boundary_on_every_run() -> None:
    seen: set[int] = set()

    @settings(max_examples=40, derandomize=True, database=None)
    @given(near([500], 0, 10**9))
    def draw(n: int) -> None:
        seen.add(n)

    draw()
    assert {499, 500, 501} & seen, sorted(seen)[:10]
