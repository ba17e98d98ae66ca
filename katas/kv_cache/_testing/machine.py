"""The stage-1 state machine: a cache and its :class:`Model` under random operations,
compared at every step, and the walks every model test replays before its random steps.

``model_test("TTLCache", weighted=True)`` is the test class the suite collects (it marks
it with its rules); the machine reaches the cache under test through
:func:`katas.kv_cache._testing.caches.make`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas._harness.story import Story, check
from katas._harness.walks import Step, Walk, walked
from katas.kv_cache._testing.caches import EXPIRED, EXPLICIT, START, TTL, Heard, Log, make
from katas.kv_cache._testing.model import Model
from katas.kv_cache.api import CacheStats, EvictingCache, ManualClock

#: What every step checks.
RULE = "the cache does exactly what the model of stage 1's rules does"
KEYS = st.sampled_from(["a", "b", "c", "d", "e", "f"])
#: Values, None among them: a stored None is a value like any other (§falsy-hits).
VALUES = st.integers(0, 20) | st.none()


def weight_of(value: int | None) -> int:
    """What the weighted machines' ``weigh`` says a value weighs."""
    return 1 if value is None else value % 7


class CacheMachine(RuleBasedStateMachine):
    """A cache and its model under random operations, compared at every step."""

    kind = "LRUCache"
    weighted = False

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(START)
        self.log = Log()
        self.story = Story(f"{self.kind}: the steps so far", self.clock.now_ns, START)

    @initialize(maxsize=st.integers(1, 6), max_weight=st.integers(3, 12))
    def build(self, maxsize: int, max_weight: int) -> None:
        kw: dict[str, Any] = {"on_evict": self.log}
        if self.weighted:
            kw |= {"max_weight": max_weight, "weigh": weight_of}
        self.cache: EvictingCache = make(self.kind, maxsize, self.clock, **kw)
        ttl = TTL if self.kind == "TTLCache" else None
        self.model = Model(self.kind, maxsize, max_weight if self.weighted else None, ttl)
        self.story.add(f"{self.kind}({maxsize}, {kw})")

    def fail(self, what: str) -> str:
        """The failure's text: the rule, the steps so far, then ``what`` came instead."""
        return self.story.tell(RULE, what)

    def heard(self, expected: list[Heard], *, in_any_order: bool = False) -> None:
        calls = self.log.take()
        now = self.clock.now_ns()
        for key, value, cause in calls:
            if cause is EXPIRED:
                check(
                    self.model.dead.get(key, object()) == value
                    or any(
                        e.key == key and e.value == value and self.model.expired(e, now)
                        for e in self.model.entries
                    ),
                    self.fail(f"on_evict({key!r}, {value!r}, EXPIRED) for an entry not expired"),
                )
                self.model.dead.pop(key, None)
                self.model.expirations += 1
        others = [c for c in calls if c[2] is not EXPIRED]
        if in_any_order:
            others, expected = sorted(others, key=repr), sorted(expected, key=repr)
        check(
            others == expected,
            self.fail(f"on_evict calls: expected {expected} (and any EXPIRED), got {calls}"),
        )

    @rule(key=KEYS, value=VALUES)
    def put(self, key: str, value: int | None) -> None:
        self.story.add(f"put({key!r}, {value})")
        weight = weight_of(value)
        if self.weighted and weight > self.model.max_weight:  # type: ignore[operator]
            why = f"it weighs {weight} > max_weight={self.model.max_weight}"
            try:
                self.cache.put(key, value)
            except ValueError:
                pass
            except Exception as e:
                raise AssertionError(
                    self.fail(f"put({key!r}, {value}): expected ValueError ({why}), got {e!r}")
                ) from e
            else:
                raise AssertionError(
                    self.fail(f"put({key!r}, {value}): expected ValueError ({why}); it returned")
                )
            self.heard([])
            return
        expected = self.model.put(key, value, weight if self.weighted else 1, self.clock.now_ns())
        self.call(f"put({key!r}, {value})", lambda: self.cache.put(key, value))
        self.heard(expected)

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; an exception where the model expects none fails with the steps."""
        try:
            return fn()
        except Exception as e:
            raise AssertionError(
                self.fail(f"{what} raised {e!r}; the model expected no exception")
            ) from e

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        self.story.add(f"get({key!r})")
        hit, value = self.model.get(key, self.clock.now_ns())
        got = self.call(f"get({key!r})", lambda: self.cache.get(key, "MISS"))
        check(
            got == (value if hit else "MISS"),
            self.fail(f"get({key!r}): expected {value if hit else 'a miss'}, got {got!r}"),
        )
        self.heard([])

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        self.story.add(f"delete({key!r})")
        value = e.value if (e := self.model.find(key)) else None
        expected = self.model.delete(key, self.clock.now_ns())
        got = self.call(f"delete({key!r})", lambda: self.cache.delete(key))
        check(got is expected, self.fail(f"delete({key!r}): expected {expected}, got {got}"))
        self.heard([(key, value, EXPLICIT)] if expected else [])

    # Only on a full cache, so that most runs still fill it up and evict.
    @precondition(lambda self: len(self.model.entries) >= self.model.maxsize)
    @rule()
    def clear(self) -> None:
        self.story.add("clear()")
        expected = self.model.clear(self.clock.now_ns())
        self.call("clear()", self.cache.clear)
        self.heard(expected, in_any_order=True)

    @precondition(lambda self: self.kind == "TTLCache")
    @rule(ns=st.sampled_from([1, 250, 499, 500, 999, 1_000]))
    def advance(self, ns: int) -> None:
        self.story.add(f"advance({ns})")
        self.clock.advance(ns)

    # A rule, not an invariant: len() and statistics() may reclaim expired entries, and
    # observing after every step would hide a get or put that mishandles one.
    @rule()
    def observations_agree(self) -> None:
        now = self.clock.now_ns()
        self.model.settle(now)
        keys = self.model.order()
        held = self.call("list(cache)", lambda: list(self.cache))
        size = self.call("len(cache)", lambda: len(self.cache))
        check(
            held == keys and size == len(keys),
            self.fail(f"held keys (in eviction order): expected {keys}, got {held} (len {size})"),
        )
        for key in ["a", "b", "c", "d", "e", "f"]:
            contains = functools.partial(operator.contains, self.cache, key)
            check(
                self.call(f"{key!r} in cache", contains) == (key in keys),
                self.fail(f"{key!r} in cache: expected {key in keys}"),
            )
        self.heard([])  # observing may reclaim expired entries: EXPIRED calls only
        stats = self.call("statistics()", self.cache.statistics)
        self.heard([])
        m = self.model
        weight = sum(e.weight for e in m.entries) if self.weighted else len(keys)
        want = CacheStats(m.hits, m.misses, m.evictions, m.expirations, len(keys), weight)
        check(stats == want, self.fail(f"statistics(): expected {want}, got {stats}"))


def machine(kind: str, weighted: bool) -> type[RuleBasedStateMachine]:
    return type(f"{kind}{'Weighted' if weighted else ''}Machine", (CacheMachine,),
                {"kind": kind, "weighted": weighted})  # fmt: skip


def _put(key: str, value: int | None) -> Step:
    return ("put", {"key": key, "value": value})


def _key(rule: str, key: str) -> Step:
    return (rule, {"key": key})


_BUILD: Step = ("build", {"maxsize": 3, "max_weight": 12})
_OBSERVE: Step = ("observations_agree", {})
#: The walks every model test replays before its random steps (weights v % 7 stay under
#: max_weight, so the weighted caches walk the same way).
WALKS: dict[str, Walk] = {
    # A read refreshes recency and a membership test does not: after get("a") the order
    # is b, c, a whatever `in` asked in between, and the next put evicts b.
    "recency": [
        _BUILD,
        _put("a", 1),
        _put("b", 2),
        _put("c", 3),
        _key("get", "a"),
        _OBSERVE,
        _OBSERVE,
        _put("d", 4),
        _OBSERVE,
    ],
    # A replacement and a delete are no evictions.
    "removals": [_BUILD, _put("a", 1), _put("a", 8), _key("delete", "a"), _OBSERVE],
    # An update of a full cache evicts nothing; the key being written is never the victim.
    "full": [
        _BUILD,
        _put("a", 1),
        _put("b", 2),
        _put("c", 3),
        _put("b", 9),
        _OBSERVE,
        _put("d", 4),
        _OBSERVE,
    ],
    # A stored None is a value: read (a hit), replaced (REPLACED) and deleted (True,
    # EXPLICIT) like any other.
    "none": [
        _BUILD,
        _put("a", None),
        _key("get", "a"),
        _put("a", 5),
        _put("b", None),
        _key("delete", "b"),
        _OBSERVE,
    ],
    # A clear leaves nothing behind, its weight included: refilled, the cache evicts as
    # a fresh one would.
    "cleared": [
        _BUILD,
        _put("a", 1),
        _put("b", 6),
        _put("c", 5),
        ("clear", {}),
        _OBSERVE,
        _put("d", 6),
        _put("e", 6),
        _put("f", 1),
        _OBSERVE,
    ],
    # What a delete took leaves no trace in the order: the next evictions go as in a
    # fresh cache.
    "ghosts": [
        _BUILD,
        _put("a", 1),
        _put("b", 2),
        _key("delete", "a"),
        _put("c", 3),
        _put("d", 4),
        _put("e", 5),
        _OBSERVE,
    ],
}
TTL_WALKS: dict[str, Walk] = {
    **WALKS,
    # A deleted key's deadline goes with it (its new value outlives the old deadline),
    # and an entry is gone at the very instant of its deadline: for a read, and for
    # iteration, len and the counters.
    "deadlines": [
        _BUILD, _put("a", 1), _key("delete", "a"), ("advance", {"ns": TTL // 2}),
        _put("a", 2), _put("b", 3), ("advance", {"ns": TTL // 2}), _OBSERVE,
        ("advance", {"ns": TTL // 2}), _key("get", "a"), _OBSERVE,
    ],
    # An update restarts the deadline: the old one passes, the new one holds.
    "update": [
        _BUILD, _put("a", 1), ("advance", {"ns": TTL // 2}), _put("a", 2),
        ("advance", {"ns": TTL // 2}), _key("get", "a"), ("advance", {"ns": TTL // 2}),
        _key("get", "a"), _OBSERVE,
    ],
    # A full cache drops an expired entry before it evicts a live one; a delete at the
    # deadline finds nothing (EXPIRED, not EXPLICIT); a put over an expired key is no
    # replacement.
    "expired": [
        _BUILD, _put("a", 1), ("advance", {"ns": TTL // 2}), _put("b", 2), _put("c", 3),
        ("advance", {"ns": TTL // 2}), _put("d", 4), _OBSERVE,
        ("advance", {"ns": TTL // 2}), _key("delete", "b"), _put("c", 6), _OBSERVE,
    ],
}  # fmt: skip


def model_test(kind: str, weighted: bool) -> type[Any]:
    return walked(machine(kind, weighted), TTL_WALKS if kind == "TTLCache" else WALKS)
