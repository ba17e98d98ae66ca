"""Holding a Redis reply on the wire: the command ran on the server, its reply is read
but not yet returned to the caller, so a test can make another client write "while the
reply is on the wire". Both wrap ``client.execute_command`` on one client object, which
every redis-py command goes through (a registered script's EVALSHA too).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis

from katas._harness.story import check
from katas._harness.waiting import DEADLINE_S


class Tap:
    """Holds the ``skip + 1``-th reply to one of ``commands`` on ``client`` once armed.

    Every redis-py command goes through ``client.execute_command``; the tap replaces it
    on this one client object (a registered script's EVALSHA goes through it too).
    """

    def __init__(self, client: redis.Redis, *commands: str) -> None:
        self._inner: Callable[..., Any] = client.execute_command
        self._commands = {c.upper() for c in commands}
        self._armed = 0
        self._lock = threading.Lock()
        self.reached = threading.Event()
        self.release = threading.Event()
        client.execute_command = self._execute  # type: ignore[method-assign]

    def arm(self, skip: int = 0) -> None:
        self.reached.clear()
        self.release.clear()
        with self._lock:
            self._armed = skip + 1

    def _execute(self, *args: Any, **options: Any) -> Any:
        result = self._inner(*args, **options)
        with self._lock:
            hold = False
            if self._armed and str(args[0]).upper() in self._commands:
                self._armed -= 1
                hold = self._armed == 0
        if hold:
            self.reached.set()
            self.release.wait(DEADLINE_S)
        return result


class Holds:
    """Holds every reply to one of ``commands`` on ``client`` while armed, each on its own
    event, in the order they come: ``wait(n)`` for the n-th, ``release(n)`` lets it go."""

    def __init__(self, client: redis.Redis, *commands: str) -> None:
        self._inner: Callable[..., Any] = client.execute_command
        self._commands = {c.upper() for c in commands}
        self._cond = threading.Condition()
        self.armed = False
        self.held: list[threading.Event] = []
        client.execute_command = self._execute  # type: ignore[method-assign]

    def _execute(self, *args: Any, **options: Any) -> Any:
        result = self._inner(*args, **options)
        if not self.armed or str(args[0]).upper() not in self._commands:
            return result
        release = threading.Event()
        with self._cond:
            self.held.append(release)
            self._cond.notify_all()
        release.wait(DEADLINE_S)
        return result

    def wait(self, count: int) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.held) >= count, DEADLINE_S)
        check(ok, f"near cache: expected {count} GET replies held, saw {len(self.held)}")

    def release_all(self) -> None:
        self.armed = False
        for event in self.held:
            event.set()
