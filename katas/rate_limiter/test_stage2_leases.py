"""Stage 2, leases: ``ConcurrencyLimiter`` — at most N requests in flight per key, each
holding a lease that expires (see katas/rate_limiter/README.md; extended).

The clock is a ``ManualClock`` that moves only when a test sets it, so "expired at this
instant" is exact to the nanosecond; races are provoked with barrier-started bursts
under a tiny ``sys.setswitchinterval``, with exact counts. The limiter is built by
:func:`katas.rate_limiter._testing.threads.concurrency`.

Map: leases granted under threads (lease-grant, lease-release) · release, idempotent
and of leases this limiter never granted (lease-release, lease-statistics) · expiry at
the exact instant, by whichever call comes next, release included (lease-expiry) · a
clock that steps back (lease-expiry) · bad arguments (lease-bad-arguments) · the model
test (lease-grant, lease-release, lease-expiry, lease-statistics).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from katas._harness.marks import extended
from katas._harness.story import expect
from katas._harness.under_test import stage
from katas._harness.waiting import tiny_switch_interval
from katas.rate_limiter._testing.threads import concurrency, run_together
from katas.rate_limiter.api import (
    NS_PER_S,
    ConcurrencyStatistics,
    InProcessLeaseLimiter,
    Lease,
    ManualClock,
)

pytestmark = [pytest.mark.stage(2)]

KEYS = st.sampled_from(["a", "b", "c"])


@pytest.mark.rule("lease-grant", "lease-release")
@extended
def test_stage2_concurrency_limiter_caps_in_flight_under_threads() -> None:
    threads, attempts, cap = 8, 10, 13
    with tiny_switch_interval():
        for round_no in range(60):
            _, limiter = concurrency(cap)

            def burst(_: int, limiter: InProcessLeaseLimiter = limiter) -> list[Lease]:
                return [lease for _ in range(attempts) if (lease := limiter.try_acquire("k"))]

            leases = [lease for got in run_together(threads, burst) for lease in got]
            assert len(leases) == cap, (
                f"{threads} threads × {attempts} try_acquire('k') with "
                f"max_in_flight={cap} got {len(leases)} leases (round {round_no}); exactly "
                f"{cap} must be granted"
            )
            assert len({lease.id for lease in leases}) == cap, "lease ids must be unique"
            assert limiter.in_flight("k") == cap

            def release(
                i: int, limiter: InProcessLeaseLimiter = limiter, leases: list[Lease] = leases
            ) -> list[bool]:
                return [limiter.release(lease) for lease in leases[i::threads]]

            released = run_together(threads, release)
            assert sum(ok for got in released for ok in got) == cap
            assert limiter.in_flight("k") == 0


@pytest.mark.rule("lease-release", "lease-statistics")
@extended
def test_stage2_concurrency_release_is_idempotent() -> None:
    _, limiter = concurrency(2)
    a, b = limiter.try_acquire("k"), limiter.try_acquire("k")
    assert isinstance(a, Lease) and isinstance(b, Lease) and a.id != b.id
    assert limiter.try_acquire("k") is None, "max_in_flight=2 and 2 leases are held"
    assert limiter.release(a) is True
    assert limiter.release(a) is False, "releasing a lease twice must return False"
    c = limiter.try_acquire("k")
    assert c is not None, "a released slot must be reusable"
    extra = limiter.try_acquire("k")
    assert extra is None, (
        "leases b and c are held with max_in_flight=2, yet a third was granted: the "
        "second release(a) freed someone else's slot — release must be idempotent"
    )
    assert limiter.in_flight("k") == 2
    assert limiter.statistics().in_flight_by_key == {"k": 2}


@pytest.mark.rule("lease-expiry", "lease-grant", "lease-release")
@extended
def test_stage2_concurrency_lease_expires_exactly_after_lease_ns() -> None:
    clock, limiter = concurrency(1, lease_ns=5 * NS_PER_S)
    lease = limiter.try_acquire("k")
    assert lease is not None and lease.key == "k"
    assert lease.expires_at_ns == clock.now_ns() + 5 * NS_PER_S
    clock.advance(5 * NS_PER_S - 1)
    assert limiter.try_acquire("k") is None, "the lease is still valid 1 ns before expiry"
    clock.advance(1)
    fresh = limiter.try_acquire("k")
    assert fresh is not None, (
        "a lease whose holder vanished must expire lease_ns after it was granted, freeing the slot"
    )
    assert limiter.statistics().expired == 1
    assert limiter.release(lease) is False, "releasing an expired lease returns False"
    assert limiter.try_acquire("k") is None, (
        "releasing the expired lease freed the slot of the lease that replaced it"
    )
    assert limiter.release(fresh) is True
    assert limiter.statistics().in_flight_by_key == {}, "idle keys must be forgotten"


@pytest.mark.rule("lease-bad-arguments")
@extended
@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_in_flight": 0, "lease_ns": NS_PER_S}, "max_in_flight"),
        ({"max_in_flight": True, "lease_ns": NS_PER_S}, "max_in_flight"),
        ({"max_in_flight": 2, "lease_ns": 0}, "lease_ns"),
        ({"max_in_flight": 2, "lease_ns": 0.5}, "lease_ns"),
    ],
    ids=["max0", "maxTrue", "lease0", "leaseFloat"],
)
def test_stage2_concurrency_bad_arguments_name_the_parameter(
    kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=param):
        stage(2).ConcurrencyLimiter(clock=ManualClock(), **kwargs)


@extended
@pytest.mark.rule("lease-expiry", "lease-statistics")
def test_stage2_concurrency_reads_reclaim_expired_leases_by_themselves() -> None:
    for read in ("in_flight", "statistics"):
        clock, limiter = concurrency(2, lease_ns=5 * NS_PER_S)
        first = limiter.try_acquire("k")
        clock.advance(NS_PER_S)
        second = limiter.try_acquire("k")
        assert first is not None and second is not None

        def held(limiter: InProcessLeaseLimiter = limiter, read: str = read) -> object:
            if read == "in_flight":
                return limiter.in_flight("k")
            return limiter.statistics()

        t1, t2 = first.expires_at_ns, second.expires_at_ns
        for at, n, expired in ((t1 - 1, 2, 0), (t1, 1, 1), (t2 - 1, 1, 1), (t2, 0, 2)):
            clock.set(at)
            got = held()
            want: object = n
            if read == "statistics":
                want = ConcurrencyStatistics(n, {"k": n} if n else {}, expired)
            expect(
                got,
                want,
                f"leases granted at 0 and 1 s for 5 s; with no other call, "
                f"{read}() at {(at - t1) / NS_PER_S + 5:.9f} s must count the leases "
                f"whose expires_at_ns has not come yet (reclaiming the others)",
            )


@extended
@pytest.mark.rule("lease-release", "lease-expiry", "lease-statistics")
def test_stage2_concurrency_release_at_expiry_finds_the_lease_expired() -> None:
    clock, limiter = concurrency(2, lease_ns=5 * NS_PER_S)
    early, late = limiter.try_acquire("k"), limiter.try_acquire("k")
    assert early is not None and late is not None
    expires = late.expires_at_ns
    clock.set(expires - 1)
    expect(limiter.release(early), True, "1 ns before its expiry a lease is still held")
    clock.set(expires)
    expect(
        limiter.release(late),
        False,
        "two leases granted at 0 for 5 s; the first released at 5 s - 1 ns, then the clock "
        "set to 5 s and release(second) called, with no other call in between: the lease "
        "expired at 5 s, and release, like every call, reclaims what has expired first — "
        "False (its slot may belong to someone else by now)",
    )
    expect(
        limiter.statistics(),
        ConcurrencyStatistics(0, {}, 1),
        "the second lease was reclaimed by expiry (expired=1), not released",
    )


@extended
@pytest.mark.rule("lease-release", "lease-statistics")
def test_stage2_concurrency_release_of_a_lease_it_does_not_hold_changes_nothing() -> None:
    _, limiter = concurrency(2)
    held = limiter.try_acquire("k")
    assert held is not None
    _, other = concurrency(2)
    theirs = other.try_acquire("x")
    assert theirs is not None
    strangers = {
        "another limiter's lease (key 'x')": theirs,
        "an id it never granted": Lease("k", held.id + 1_000, held.expires_at_ns),
        "a held id under another key": Lease("x", held.id, held.expires_at_ns),
        "a held id with another expiry": Lease("k", held.id, held.expires_at_ns + 1),
    }
    for what, lease in strangers.items():
        expect(
            limiter.release(lease),
            False,
            f"release({lease}) — {what}: a Lease is a value (key, id, expiry), and one "
            "equal to no lease this limiter holds is not held: False",
        )
        expect(
            limiter.statistics(),
            ConcurrencyStatistics(1, {"k": 1}, 0),
            f"after release of {what}: nothing changes, the one lease on 'k' is still held",
        )
    expect(limiter.release(held), True, "the lease it granted is released")


@extended
@pytest.mark.rule("lease-expiry", "lease-grant")
def test_stage2_concurrency_a_clock_step_back_revives_no_lease() -> None:
    clock, limiter = concurrency(1, lease_ns=5 * NS_PER_S)
    start = clock.now_ns()
    first = limiter.try_acquire("k")
    assert first is not None
    clock.set(start + 5 * NS_PER_S)
    expect(limiter.in_flight("k"), 0, "the lease granted at 0 for 5 s expired at 5 s")
    clock.set(start + 2 * NS_PER_S)  # an NTP step: the clock jumps 3 s back
    expect(
        limiter.in_flight("k"),
        0,
        "lease at 0 for 5 s, read at 5 s, then the clock stepped back to 2 s: the limiter's "
        "time never goes back (it is the latest the clock has said), so the expired lease "
        "stays expired",
    )
    expect(limiter.release(first), False, "and its release finds it gone")
    second = limiter.try_acquire("k")
    assert second is not None, "the slot is free"
    expect(
        second.expires_at_ns,
        start + 10 * NS_PER_S,
        "a lease granted after the step back expires lease_ns after the limiter's time "
        "(5 s, the latest the clock said), not after the stepped-back clock (2 s)",
    )
    clock.set(start + 10 * NS_PER_S - 1)
    expect(limiter.in_flight("k"), 1, "held until 10 s - 1 ns")
    clock.set(start + 10 * NS_PER_S)
    expect(limiter.statistics(), ConcurrencyStatistics(0, {}, 2), "and gone at 10 s")


class ConcurrencyLimiterMachine(RuleBasedStateMachine):
    """Leases against a model: held until released or until ``lease_ns`` has passed."""

    leases = Bundle("leases")

    @initialize(cap=st.integers(1, 3), lease_s=st.integers(1, 4))
    def build(self, cap: int, lease_s: int) -> None:
        self.clock = ManualClock()
        self.cap, self.lease_ns = cap, lease_s * NS_PER_S
        self.limiter: InProcessLeaseLimiter = stage(2).ConcurrencyLimiter(
            max_in_flight=cap, lease_ns=self.lease_ns, clock=self.clock
        )
        self.live: dict[int, tuple[str, int]] = {}  # id -> (key, expires_at)
        self.expired = 0

    def expire(self) -> None:
        now = self.clock.now_ns()
        for lease_id, (_, expires) in list(self.live.items()):
            if expires <= now:
                del self.live[lease_id]
                self.expired += 1

    def held(self, key: str) -> int:
        return sum(k == key for k, _ in self.live.values())

    @rule(target=leases, key=KEYS)
    def try_acquire(self, key: str) -> Lease | None:
        self.expire()
        lease = self.limiter.try_acquire(key)
        if self.held(key) >= self.cap:
            assert lease is None, f"{key!r} holds {self.cap} = max leases, got {lease}"
        else:
            assert lease is not None, f"{key!r} holds {self.held(key)} < {self.cap}"
            assert lease.id not in self.live and lease.key == key
            assert lease.expires_at_ns == self.clock.now_ns() + self.lease_ns
            self.live[lease.id] = (key, lease.expires_at_ns)
        return lease

    @rule(lease=leases)
    def release(self, lease: Lease | None) -> None:
        self.expire()
        expected = lease is not None and lease.id in self.live
        got = self.limiter.release(lease) if lease is not None else False
        expect(
            got,
            expected,
            f"release({lease}): True only for a lease still held (not released before, "
            "not expired)",
        )
        if expected and lease is not None:
            del self.live[lease.id]

    @rule(ns=st.sampled_from([1, NS_PER_S - 1, NS_PER_S, 3 * NS_PER_S]))
    def advance(self, ns: int) -> None:
        self.clock.advance(ns)

    @invariant()
    def statistics_match(self) -> None:
        if not hasattr(self, "limiter"):
            return
        self.expire()
        stats = self.limiter.statistics()
        by_key = dict(Counter(k for k, _ in self.live.values()))
        assert (stats.in_flight, stats.in_flight_by_key, stats.expired) == (
            len(self.live),
            by_key,
            self.expired,
        ), f"statistics {stats}, expected in flight {by_key}, expired {self.expired}"
        for key in by_key:
            assert self.limiter.in_flight(key) == by_key[key]


TestStage2ConcurrencyLimiterModel = pytest.mark.extended(
    pytest.mark.rule("lease-grant", "lease-release", "lease-expiry", "lease-statistics")(
        ConcurrencyLimiterMachine.TestCase
    )
)
