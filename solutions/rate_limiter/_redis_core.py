"""What the stage-3 limiters share: validation, key layout, reply parsing, failure handling.

The sync and async limiters differ only in whether the script call is awaited; all the
rest lives here, so stage3.py holds just the public surface.
"""

from __future__ import annotations

import threading
from fractions import Fraction
from typing import Any

from redis.exceptions import SlotNotCoveredError

from katas.rate_limiter.api import (
    NS_PER_S,
    Clock,
    Decision,
    FailureMode,
    RateLimiter,
    RedisAlgorithm,
    RedisLimiterStats,
    StampedDecision,
    check_client,
)

from . import _redis_scripts as lua

_ALGORITHMS = ("token_bucket", "sliding_log", "fixed_window")
_FAILURE_MODES = ("open", "closed", "local")
_MAX_SCALED = 2**51  # limit × window_us: the scripts' doubles stay exact below 2^53


def positive_int(name: str, value: object) -> int:
    if type(value) is not int:  # bool is an int subclass, and never a count
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


class RedisCore:
    """Validation, key layout, reply parsing and failure handling shared by sync and async."""

    def __init__(
        self,
        client: Any,
        *,
        algorithm: RedisAlgorithm,
        limit: int,
        window_ns: int,
        clock: Clock,
        key_prefix: str,
        failure_mode: FailureMode,
        expected_nodes: int,
        probe_interval_ns: int,
    ) -> None:
        if algorithm not in _ALGORITHMS:
            raise ValueError(f"algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
        self._limit = positive_int("limit", limit)
        window_ns = positive_int("window_ns", window_ns)
        if window_ns % 1000:
            raise ValueError(f"window_ns must be a whole number of µs, got {window_ns}")
        if limit * (window_ns // 1000) >= _MAX_SCALED:
            raise ValueError(f"limit × window_ns/1000 must be below 2^51, got {limit}, {window_ns}")
        if failure_mode not in _FAILURE_MODES:
            raise ValueError(f"failure_mode must be one of {_FAILURE_MODES}, got {failure_mode!r}")
        self._nodes = positive_int("expected_nodes", expected_nodes)
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ValueError(f"key_prefix must be a non-empty str, got {key_prefix!r}")
        if type(probe_interval_ns) is not int or probe_interval_ns < 0:
            raise ValueError(f"probe_interval_ns must be an int >= 0, got {probe_interval_ns!r}")
        if not callable(getattr(clock, "now_ns", None)):
            raise TypeError(f"clock must have now_ns(), got {clock!r}")
        check_client(client)  # a socket timeout, and no retry that runs a script twice
        self._client = client
        self._algorithm = algorithm
        self._window_ns = window_ns
        self._args = (b"%d" % limit, b"%d" % (window_ns // 1000))  # encoded once, not per call
        self._clock = clock
        self._prefix = key_prefix
        self._mode = failure_mode
        self._probe_ns = probe_interval_ns
        self._script = client.register_script(lua.SCRIPTS[algorithm])
        self._lock = threading.Lock()
        # A cluster client names the master that serves a key; a plain client has one server.
        self._owner = getattr(client, "get_node_from_key", None)
        # Per server: skip it until then (client clock). One dead master of three must not
        # send the keys of the two live ones to the failure mode.
        self._retry_at_ns: dict[str, int] = {}
        self._counts = [0, 0, 0]  # redis decisions, fallback decisions, redis errors
        self._local = self._local_limiter() if failure_mode == "local" else None

    def _local_limiter(self) -> RateLimiter:
        from . import stage1  # the stage-1 limiters, at this node's share of the limit

        share = max(1, self._limit // self._nodes)
        if self._algorithm == "token_bucket":
            rate = Fraction(share * NS_PER_S, self._window_ns)
            return stage1.TokenBucket(capacity=share, refill_per_s=rate, clock=self._clock)
        if self._algorithm == "sliding_log":
            return stage1.SlidingLog(limit=share, window_ns=self._window_ns, clock=self._clock)
        return stage1.FixedWindow(limit=share, window_ns=self._window_ns, clock=self._clock)

    def _keys(self, key: str) -> list[str]:
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {key!r}")
        # {k:key} is the hash tag: Redis Cluster hashes only what is inside, up to the
        # first "}", so a key's state and log share a slot and one script may touch both.
        # The "k:" keeps the tag non-empty whatever the key ("" or "}x" would otherwise
        # make an empty tag, and Cluster would hash the two whole, different, names).
        tag = f"{self._prefix}{{k:{key}}}"
        if self._algorithm != "sliding_log":
            return [f"{tag}:m"]
        # The log can empty itself mid-script (expired units trimmed, a refund of them
        # all) and is touched again after that. In a slot that is migrating, Redis checks
        # a script's keys before it runs, but fails a command on a key that is missing by
        # then halfway through, the writes before it kept. ":moving" is never written: a
        # missing key makes Redis answer TRYAGAIN to the whole script while the slot
        # moves, so the sliding log waits (failure mode) instead of half-running.
        return [f"{tag}:m", f"{tag}:l", f"{tag}:moving"]

    def _server_of(self, name: str) -> str:
        """Which server decides for the Redis key ``name``: its slot's master as the
        cluster client sees the cluster now; ``""`` for a plain client's one server (or
        while a cluster client does not know the slot's master yet)."""
        if self._owner is None:
            return ""
        try:
            return str(self._owner(name).name)
        except SlotNotCoveredError:
            return ""

    def _call_args(self, key: str, cost: int, mode: bytes) -> tuple[list[str], list[Any], str]:
        """The script's keys and arguments, and the server they go to."""
        cost = positive_int("cost", cost)
        if mode == b"r":  # more than the limit never comes back: the script's numbers stay small
            cost = min(cost, self._limit)
        keys = self._keys(key)
        return keys, [*self._args, cost, mode], self._server_of(keys[0])

    def _should_try(self, server: str) -> bool:
        retry_at = self._retry_at_ns.get(server)  # one read: no lock needed on the hot path
        return retry_at is None or self._clock.now_ns() >= retry_at

    def _decided(self, reply: bytes | str, server: str) -> StampedDecision:
        allowed, remaining, retry_us, reset_us, op, now_us = map(int, reply.split())
        with self._lock:
            # It answers: stop skipping it. An interval still running was started by a
            # failure while this call was in flight (it was sent when none ran): it stands.
            retry_at = self._retry_at_ns.get(server)
            if retry_at is not None and retry_at <= self._clock.now_ns():
                del self._retry_at_ns[server]
            self._counts[0] += 1
        retry_ns = None if retry_us < 0 else retry_us * 1000
        return StampedDecision(
            allowed == 1, self._limit, remaining, retry_ns, reset_us * 1000, op, now_us
        )

    def _failed(self, server: str) -> None:
        with self._lock:
            self._counts[2] += 1
            self._retry_at_ns[server] = self._clock.now_ns() + self._probe_ns

    def _fallback(self, key: str, cost: int, acquire: bool, server: str) -> Decision:
        with self._lock:
            self._counts[1] += 1
            if self._local is not None:
                local = self._local
                return local.try_acquire(key, cost) if acquire else local.peek(key, cost)
            wait = max(1, self._retry_at_ns.get(server, 0) - self._clock.now_ns())
        if cost > self._limit:
            return Decision(False, self._limit, 0, None, 0)
        if self._mode == "open":
            return Decision(True, self._limit, self._limit - cost, 0, 0)
        # closed: deny, and suggest retrying when Redis will next be asked
        return Decision(False, self._limit, 0, wait, 0)

    def _refund_fallback(self, key: str, cost: int) -> None:
        """A refund Redis did not get: counted, and dropped — or refunded locally."""
        with self._lock:
            self._counts[1] += 1
            if self._local is not None:
                self._local.refund(key, cost)

    def _stats(self) -> RedisLimiterStats:
        with self._lock:
            return RedisLimiterStats(*self._counts)
