"""The harness's clocks and interleavings catch what they promise to: a busy loop on a
frozen ManualClock, a wake-up left to the clock, a gap between two lock sections; and a
wait that ends short names the thread that died."""

from __future__ import annotations

import threading

import pytest

from katas._harness import waiting
from katas._harness.interleave import pause_after_unlocks
from katas._harness.resting import SelfWakingClock
from katas._harness.waiting import eventually, spawn
from katas._runtime.clock import SPIN_LIMIT, ManualClock


def test_a_thread_that_waits_for_a_past_deadline_again_and_again_is_a_busy_loop() -> None:
    clock, cond = ManualClock(100), threading.Condition()
    with cond:
        for _ in range(SPIN_LIMIT - 1):
            clock.wait_until_ns(cond, 100)  # due already: returns at once
        with pytest.raises(RuntimeError, match="busy loop"):
            clock.wait_until_ns(cond, 100)
        clock.advance(1)  # time moved: a wait for the instant that came is fine again
        clock.wait_until_ns(cond, 101)


def test_on_a_self_waking_clock_a_deadline_wakes_only_its_own_thread() -> None:
    clock, cond = SelfWakingClock(0), threading.Condition()
    woken: list[str] = []

    def sleeper(name: str, deadline: int | None) -> None:
        with cond:
            clock.wait_until_ns(cond, deadline)
        woken.append(name)

    forever = spawn(lambda: sleeper("no deadline", None), "no deadline")
    timed = spawn(lambda: sleeper("deadline 10", 10), "deadline 10")
    eventually(lambda: clock.sleepers() == 2, "both asleep on the clock")
    clock.advance(10)
    timed.outcome("the thread whose deadline came")
    assert woken == ["deadline 10"] and forever.is_alive()
    with cond:
        cond.notify_all()
    forever.outcome("the other, once notified")


def test_pause_after_unlocks_lets_another_thread_in_between_two_lock_sections() -> None:
    lock, seen, done = threading.Lock(), [], threading.Event()

    def two_sections() -> None:
        pause_after_unlocks(__name__, lambda: "other" in seen, done.is_set, deadline_s=5)
        with lock:
            seen.append("first")
        with lock:
            seen.append("second")
        done.set()

    def other() -> None:
        eventually(lambda: "first" in seen, "the first section")
        with lock:
            seen.append("other")

    other_thread = spawn(other, "other")
    spawn(two_sections, "two sections").outcome("both sections")
    other_thread.outcome("the other thread")
    assert seen == ["first", "other", "second"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_wait_that_ends_short_names_the_thread_that_died() -> None:
    waiting.begin_test()
    waiting.at_rest(lambda: True)  # nothing more can happen: judge at once

    def die() -> None:
        raise ValueError("the component's thread broke")

    thread = threading.Thread(target=die, name="worker-1")
    thread.start()
    thread.join()
    with pytest.raises(AssertionError, match="worker-1: ValueError: the component's thread"):
        waiting.eventually(lambda: False, "something the dead thread would have done")
