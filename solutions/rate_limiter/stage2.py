"""Stage 2 reference: the stage-1 limiters shared by threads and by tasks.

- :class:`ThreadSafeLimiter` — per-key striped locks around any stage-1 limiter, plus a
  blocking, FIFO-per-key ``acquire``.
- :class:`AsyncLimiter` — the same waiting discipline for anyio tasks (asyncio, trio).
- :class:`ConcurrencyLimiter` — caps requests *in flight* per key with expiring leases.

Every wait goes through the injected clock, so tests move time with ``ManualClock``.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager

import anyio
import anyio.lowlevel

from katas.rate_limiter.api import (
    Clock,
    ConcurrencyStatistics,
    Decision,
    Lease,
    LimiterStatistics,
    RateLimiter,
    SweepableLimiter,
    WaitingClock,
)

#: The wrapper sweeps after at least this many operations, and at least as many as
#: there were keys left after the previous sweep: sweeping stays amortised O(1).
_SWEEP_MIN_OPS = 1024


#: More stripes than this buys no parallelism, only memory (2^63 would never finish).
MAX_STRIPES = 2**16


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass, but True as a cost or a count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")


def _check_timeout(timeout_ns: int | None) -> None:
    if timeout_ns is not None:
        _check_int("timeout_ns", timeout_ns, 0)


class _Waiter:
    """One caller queued on a key; compared by identity."""

    __slots__ = ("cost", "due", "wake")

    def __init__(self, cost: int) -> None:
        self.cost = cost
        # As the head: the earliest instant its cost may fit (its last denial, or a
        # refund's instant). A head woken past its deadline is admitted only if that was
        # no later than the deadline; None: not known, so not admitted then.
        self.due: int | None = None
        self.wake: anyio.Event | None = None  # tasks only: set to make it look again


def _late(me: _Waiter, now: int, deadline: int | None) -> bool:
    """True if the head woke past its deadline and its cost fitted only after it."""
    return deadline is not None and now > deadline and (me.due is None or me.due > deadline)


def _fits_at_deadline(
    inner: RateLimiter, key: str, queue: deque[_Waiter], me: _Waiter, deadline: int, now: int
) -> bool:
    """A waiter behind the head, awake at its deadline: do it and those ahead fit now?

    If so it must not give up: it waits for them to take their share, then takes its own.
    """
    if now > deadline:
        return False
    demand = 0
    for waiter in queue:
        demand += waiter.cost
        if waiter is me:
            break
    if not inner.peek(key, demand).allowed:
        return False
    me.due = now  # it fitted by its deadline, however late its turn comes
    return True


def _may_fit_now(queue: deque[_Waiter] | None, now: int) -> None:
    """A refund or a reset at ``now``: the head's cost may fit from then on."""
    if queue:
        head = queue[0]
        head.due = now if head.due is None else min(head.due, now)


def _queued_denial(inner: RateLimiter, key: str, cost: int, queue: deque[_Waiter]) -> Decision:
    """The decision for a request that finds waiters queued on ``key``: denied.

    The units on hand belong to the queue, so none remain for a newcomer. Retry-after
    is the wait until the queue's demand plus this cost (capped at the limit) is on
    hand — a lower bound, as refunds aside nothing arrives sooner.
    """
    alone = inner.peek(key, cost)
    if alone.retry_after_ns is None:  # can never fit, queue or not; the units are the queue's
        return Decision(
            allowed=False,
            limit=alone.limit,
            remaining=0,
            retry_after_ns=None,
            reset_after_ns=alone.reset_after_ns,
        )
    ahead = sum(w.cost for w in queue)
    together = inner.peek(key, min(ahead + cost, alone.limit)).retry_after_ns or 0
    return Decision(
        allowed=False,
        limit=alone.limit,
        remaining=0,
        retry_after_ns=max(1, together),
        reset_after_ns=alone.reset_after_ns,
    )


def _first_try(inner: RateLimiter, key: str, cost: int, queued: bool) -> bool | None:
    """Admit at once (True), give up at once (False: can never fit), or None: wait."""
    if not queued:
        first = inner.try_acquire(key, cost)
        if first.allowed:
            return True
        return False if first.retry_after_ns is None else None
    return False if inner.peek(key, cost).retry_after_ns is None else None


class ThreadSafeLimiter:
    """Any stage-1 limiter, safe for many threads, with a blocking FIFO ``acquire``.

    Build the inner limiter with ``auto_sweep=False`` and the same clock: its sweep
    walks every key, so it must run under *all* stripes, which only this wrapper can
    do — it sweeps itself every so many operations (amortised), or on ``sweep()``.
    """

    def __init__(self, inner: SweepableLimiter, *, clock: WaitingClock, stripes: int = 64) -> None:
        _check_int("stripes", stripes, 1)
        if stripes > MAX_STRIPES:
            raise ValueError(f"stripes must be at most {MAX_STRIPES}, got {stripes}")
        self._inner = inner
        self._clock = clock
        # A stripe guards the inner state of its keys *and* their waiter queues, so a
        # waiter sleeps on the very condition that guards what it waits for. The hot
        # path takes the bare lock: entering a Condition costs a Python-level call.
        self._locks = [threading.Lock() for _ in range(stripes)]
        self._conds = [threading.Condition(lock) for lock in self._locks]
        self._queues: list[dict[str, deque[_Waiter]]] = [{} for _ in range(stripes)]
        self._ops = itertools.count(1)  # next() is atomic: a lock-free operation count
        self._sweep_at = _SWEEP_MIN_OPS
        self._sweeping = threading.Lock()

    def _stripe(self, key: str) -> tuple[threading.Condition, dict[str, deque[_Waiter]]]:
        i = hash(key) % len(self._conds)
        return self._conds[i], self._queues[i]

    @contextmanager
    def _all_stripes(self) -> Iterator[None]:
        # In index order, and no one holding a stripe ever takes another: no deadlock.
        with ExitStack() as stack:
            for lock in self._locks:
                stack.enter_context(lock)
            yield

    def _sweep_due(self) -> None:
        """The amortised sweep, once ``_sweep_at`` operations have been counted.

        Called holding no stripe; one thread sweeps, the others carry on.
        """
        if self._sweeping.acquire(blocking=False):
            try:
                with self._all_stripes():
                    self._inner.sweep()
                    left = self._inner.tracked_keys()
                # A plain int read by other threads without a lock: a stale value only
                # moves one sweep by a few operations.
                self._sweep_at = next(self._ops) + max(_SWEEP_MIN_OPS, left)
            finally:
                self._sweeping.release()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit now or deny; always denied while ``key`` has waiters (no overtaking)."""
        if type(cost) is not int or cost < 1:  # the hot path: no call when the cost is fine
            _check_int("cost", cost, 1)
        i = hash(key) % len(self._locks)
        with self._locks[i]:
            queue = self._queues[i].get(key)
            if queue:
                decision = _queued_denial(self._inner, key, cost, queue)
            else:
                decision = self._inner.try_acquire(key, cost)
        if next(self._ops) >= self._sweep_at:
            self._sweep_due()
        return decision

    def peek(self, key: str, cost: int = 1) -> Decision:
        """What ``try_acquire`` would decide now, changing nothing."""
        _check_int("cost", cost, 1)
        cond, queues = self._stripe(key)
        with cond:
            queue = queues.get(key)
            if queue:
                return _queued_denial(self._inner, key, cost, queue)
            return self._inner.peek(key, cost)

    def acquire(self, key: str, cost: int = 1, *, timeout_ns: int | None = None) -> bool:
        """Block until ``cost`` is admitted (True) or ``timeout_ns`` has passed (False).

        Waiters on one key are admitted in arrival order. A cost that can never fit
        returns False at once; a caller that times out consumes nothing.
        """
        _check_int("cost", cost, 1)
        _check_timeout(timeout_ns)
        cond, queues = self._stripe(key)
        try:
            with cond:
                outcome = _first_try(self._inner, key, cost, key in queues)
                if outcome is not None or timeout_ns == 0:
                    return bool(outcome)
                return self._wait(cond, queues, key, cost, timeout_ns)
        finally:
            if next(self._ops) >= self._sweep_at:
                self._sweep_due()

    def _wait(
        self,
        cond: threading.Condition,
        queues: dict[str, deque[_Waiter]],
        key: str,
        cost: int,
        timeout_ns: int | None,
    ) -> bool:
        deadline = None if timeout_ns is None else self._clock.now_ns() + timeout_ns
        me = _Waiter(cost)
        queue = queues.setdefault(key, deque())
        queue.append(me)
        try:
            while True:
                wake_at = deadline
                if queue[0] is me:  # only the head may take units: FIFO
                    if _late(me, self._clock.now_ns(), deadline):
                        return False
                    decision = self._inner.try_acquire(key, cost)
                    if decision.allowed:
                        return True
                    due = me.due = self._clock.now_ns() + (decision.retry_after_ns or 0)
                    wake_at = due if deadline is None else min(due, deadline)
                if deadline is not None and (now := self._clock.now_ns()) >= deadline:
                    if queue[0] is me or not _fits_at_deadline(
                        self._inner, key, queue, me, deadline, now
                    ):
                        return False
                    wake_at = None  # until those ahead leave: it is then the head
                self._clock.wait_until_ns(cond, wake_at)
        finally:
            queue.remove(me)
            if not queue:
                del queues[key]
            # The next waiter may now be the head, and may fit in what this one left:
            # wake everyone on the stripe (one notify could wake another key's waiter).
            cond.notify_all()

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units (capped), and let waiters look at them."""
        _check_int("cost", cost, 1)
        cond, queues = self._stripe(key)
        with cond:
            self._inner.refund(key, cost)
            _may_fit_now(queues.get(key), self._clock.now_ns())
            cond.notify_all()

    def reset(self, key: str) -> None:
        """Return ``key`` to fresh; its waiters look again."""
        cond, queues = self._stripe(key)
        with cond:
            self._inner.reset(key)
            _may_fit_now(queues.get(key), self._clock.now_ns())
            cond.notify_all()

    def tracked_keys(self) -> int:
        """The inner limiter's ``tracked_keys()``, read under every stripe."""
        with self._all_stripes():
            return self._inner.tracked_keys()

    def sweep(self) -> int:
        """Forget idle keys now, under every stripe; return how many were forgotten."""
        with self._all_stripes():
            return self._inner.sweep()

    def statistics(self) -> LimiterStatistics:
        """Callers blocked in ``acquire``, in total and per key."""
        by_key: dict[str, int] = {}
        for cond, queues in zip(self._conds, self._queues, strict=True):
            with cond:
                by_key.update((key, len(queue)) for key, queue in queues.items())
        return LimiterStatistics(waiters=sum(by_key.values()), waiters_by_key=by_key)


class AsyncLimiter:
    """Any stage-1 limiter for anyio tasks of one event loop, with a FIFO ``acquire``.

    All state changes happen between awaits on the loop's thread, so no lock is
    needed and the inner limiter may sweep itself.
    """

    def __init__(self, inner: RateLimiter, *, clock: WaitingClock) -> None:
        self._inner = inner
        self._clock = clock
        self._queues: dict[str, deque[_Waiter]] = {}

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit now or deny; always denied while ``key`` has waiters (no overtaking)."""
        _check_int("cost", cost, 1)
        queue = self._queues.get(key)
        if queue:
            return _queued_denial(self._inner, key, cost, queue)
        return self._inner.try_acquire(key, cost)

    async def acquire(self, key: str, cost: int = 1, *, timeout_ns: int | None = None) -> bool:
        """Wait until ``cost`` is admitted (True) or ``timeout_ns`` has passed (False).

        FIFO per key. Cancellation or a timeout consumes nothing and lets the
        waiters behind go ahead. A cost that can never fit returns False at once.
        """
        _check_int("cost", cost, 1)
        _check_timeout(timeout_ns)
        await anyio.lowlevel.checkpoint_if_cancelled()
        outcome = _first_try(self._inner, key, cost, key in self._queues)
        if outcome is not None or timeout_ns == 0:
            # Still a scheduling point, like every trio primitive; but not a cancellation
            # point any more: the units may already be consumed.
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return bool(outcome)
        deadline = None if timeout_ns is None else self._clock.now_ns() + timeout_ns
        me = _Waiter(cost)
        queue = self._queues.setdefault(key, deque())
        queue.append(me)
        try:
            while True:
                wake_at = deadline
                if queue[0] is me:
                    if _late(me, self._clock.now_ns(), deadline):
                        return False
                    decision = self._inner.try_acquire(key, cost)
                    if decision.allowed:
                        return True  # no await after consuming: a cancel cannot undo it
                    due = me.due = self._clock.now_ns() + (decision.retry_after_ns or 0)
                    wake_at = due if deadline is None else min(due, deadline)
                if deadline is not None and (now := self._clock.now_ns()) >= deadline:
                    if queue[0] is me or not _fits_at_deadline(
                        self._inner, key, queue, me, deadline, now
                    ):
                        return False
                    wake_at = None  # until nudged as the head
                await self._sleep(me, wake_at)
        finally:  # admitted, timed out or cancelled: leave, and wake the new head
            queue.remove(me)
            if queue:
                self._nudge(queue[0])
            else:
                del self._queues[key]

    async def _sleep(self, me: _Waiter, wake_at: int | None) -> None:
        """Sleep until nudged or until the clock reaches ``wake_at``."""
        wake = me.wake = anyio.Event()
        if wake_at is None:
            await wake.wait()
            return

        async def alarm() -> None:
            await self._clock.sleep_until_ns_async(wake_at)
            wake.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(alarm)
            await wake.wait()
            tg.cancel_scope.cancel()

    @staticmethod
    def _nudge(waiter: _Waiter) -> None:
        if waiter.wake is not None:
            waiter.wake.set()

    @asynccontextmanager
    async def limit(self, key: str, cost: int = 1) -> AsyncIterator[None]:
        """``async with limiter.limit(key):`` — wait for admission, then run the body.

        The units are spent on entry (a rate, not a concurrency cap): leaving the
        block, normally or not, gives nothing back. A cost that can never fit raises
        ValueError rather than run the body unadmitted.
        """
        if not await self.acquire(key, cost):
            raise ValueError(f"cost {cost} can never fit the limit of key {key!r}")
        yield

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units (capped); the head waiter looks at them."""
        _check_int("cost", cost, 1)
        self._inner.refund(key, cost)
        if queue := self._queues.get(key):
            _may_fit_now(queue, self._clock.now_ns())
            self._nudge(queue[0])

    def statistics(self) -> LimiterStatistics:
        """Tasks waiting in ``acquire``, in total and per key."""
        by_key = {key: len(queue) for key, queue in self._queues.items()}
        return LimiterStatistics(waiters=sum(by_key.values()), waiters_by_key=by_key)


class ConcurrencyLimiter:
    """At most ``max_in_flight`` requests per key at once; thread-safe.

    A lease a holder never releases (it crashed) is reclaimed ``lease_ns`` after it
    was granted. Leases all live ``lease_ns`` and time never goes backwards here, so
    grant order is expiry order: one ordered dict serves as the expiry queue.
    """

    def __init__(self, *, max_in_flight: int, lease_ns: int, clock: Clock) -> None:
        _check_int("max_in_flight", max_in_flight, 1)
        _check_int("lease_ns", lease_ns, 1)
        self._max = max_in_flight
        self._lease_ns = lease_ns
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: OrderedDict[int, Lease] = OrderedDict()  # by id, in expiry order
        self._held: dict[str, int] = {}  # key -> live leases; keys at 0 are dropped
        self._ids = itertools.count(1)
        self._last_ns = clock.now_ns()
        self._expired = 0

    def _now_and_expire(self) -> int:
        """The clock (clamped: never backwards); reclaim every lease due by then."""
        now = self._last_ns = max(self._last_ns, self._clock.now_ns())
        while self._leases:
            lease = next(iter(self._leases.values()))
            if lease.expires_at_ns > now:
                break
            self._leases.popitem(last=False)
            self._drop(lease.key)
            self._expired += 1
        return now

    def _drop(self, key: str) -> None:
        left = self._held[key] - 1
        if left:
            self._held[key] = left
        else:
            del self._held[key]

    def try_acquire(self, key: str) -> Lease | None:
        """A lease for one request on ``key``, or None if ``max_in_flight`` are held (no wait)."""
        with self._lock:
            now = self._now_and_expire()
            if self._held.get(key, 0) >= self._max:
                return None
            lease = Lease(key=key, id=next(self._ids), expires_at_ns=now + self._lease_ns)
            self._leases[lease.id] = lease
            self._held[key] = self._held.get(key, 0) + 1
            return lease

    def release(self, lease: Lease) -> bool:
        """End ``lease``; True if it was held. Idempotent: a second release, or one
        after expiry, changes nothing (the slot may belong to someone else by now)."""
        with self._lock:
            self._now_and_expire()
            if self._leases.get(lease.id) != lease:
                return False
            del self._leases[lease.id]
            self._drop(lease.key)
            return True

    def in_flight(self, key: str) -> int:
        """Leases currently held on ``key``."""
        with self._lock:
            self._now_and_expire()
            return self._held.get(key, 0)

    def statistics(self) -> ConcurrencyStatistics:
        """Leases held, in total and per key, and how many expired so far."""
        with self._lock:
            self._now_and_expire()
            return ConcurrencyStatistics(
                in_flight=len(self._leases),
                in_flight_by_key=dict(self._held),
                expired=self._expired,
            )
