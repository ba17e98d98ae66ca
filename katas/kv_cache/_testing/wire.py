"""Holding a Redis reply on the wire: the command ran on the server, its reply is read
but not yet returned to the caller, so a test can make another client write "while the
reply is on the wire". ``Tap`` and ``Holds`` wrap ``client.execute_command`` on one
client object, which every redis-py command goes through (a registered script's EVALSHA
too).

And what a client sends: ``Sent`` records it; ``HoldBefore`` holds a command before it
is sent (the server has not seen it yet); ``HeldSubscribe`` holds back a listener's
``SUBSCRIBE`` on its pub/sub connection until the test releases it.
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


def _text(arg: object) -> str:
    return arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)


class Sent:
    """Records every command sent on one client object, as text: ``("SET", name, …)``."""

    def __init__(self, client: redis.Redis) -> None:
        self._inner: Callable[..., Any] = client.execute_command
        self.commands: list[tuple[str, ...]] = []
        client.execute_command = self._execute  # type: ignore[method-assign]

    def _execute(self, *args: Any, **options: Any) -> Any:
        self.commands.append(tuple(_text(a) for a in args))
        return self._inner(*args, **options)

    def naming(self, key: str) -> list[tuple[str, ...]]:
        """The commands with an argument that is a Redis key name for ``key``
        (``<prefix><epoch>:<key>``), in the order they were sent."""
        return [c for c in self.commands if any(a.endswith(f":{key}") for a in c[1:])]


def ttl_ms(command: tuple[str, ...]) -> int | None:
    """The time to live in ms a command sets: ``SET … PX n``, ``PSETEX name n value`` or
    ``PEXPIRE name n`` (None for any other command)."""
    name = command[0].upper()
    if name == "SET":
        options = [a.upper() for a in command[3:]]
        return int(command[3 + options.index("PX") + 1]) if "PX" in options else None
    if name in ("PSETEX", "PEXPIRE"):
        return int(command[2])
    return None


#: Whatever a cache's call sends first (a ``HoldBefore`` of these holds it, whichever it is).
EVERY_COMMAND = ("GET", "SET", "DEL", "UNLINK", "EVAL", "EVALSHA", "MGET", "PSETEX", "EXISTS")


class HoldBefore:
    """Holds the next command of ``commands`` sent on ``client`` once armed, *before* it is
    sent: the server has not seen it yet (a :class:`Tap` holds a reply, after)."""

    def __init__(self, client: redis.Redis, *commands: str) -> None:
        self._inner: Callable[..., Any] = client.execute_command
        self._commands = {c.upper() for c in commands}
        self._armed = False
        self._lock = threading.Lock()
        self.reached = threading.Event()
        self.release = threading.Event()
        self.gave_up = threading.Event()  # the test never released it: it went on anyway
        client.execute_command = self._execute  # type: ignore[method-assign]

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def _execute(self, *args: Any, **options: Any) -> Any:
        with self._lock:
            hold = self._armed and _text(args[0]).upper() in self._commands
            self._armed &= not hold
        if hold:
            self.reached.set()
            if not self.release.wait(DEADLINE_S):
                self.gave_up.set()
        return self._inner(*args, **options)


class HeldSubscribe:
    """Holds back every ``SUBSCRIBE`` sent on a pub/sub connection of ``client`` (a fresh
    client: its pool has made no connection yet) until :meth:`release`: the listener has
    sent it as far as it can tell, but the server has not seen it, so nothing published
    meanwhile reaches it and no confirmation can come."""

    def __init__(self, client: redis.Redis) -> None:
        self._cond = threading.Condition()
        self._held: list[Callable[[], None]] = []
        self._released = False
        owner = self
        pool = client.connection_pool
        base: type[Any] = pool.connection_class

        class Holding(base):  # type: ignore[misc]
            def send_command(self, *args: Any, **kwargs: Any) -> None:
                def send() -> None:
                    base.send_command(self, *args, **kwargs)

                if _text(args[0]).upper() != "SUBSCRIBE" or not owner._hold(send):
                    send()

        pool.connection_class = Holding

    def _hold(self, send: Callable[[], None]) -> bool:
        with self._cond:
            if self._released:
                return False
            self._held.append(send)
            self._cond.notify_all()
            return True

    def wait_held(self, count: int = 1) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self._held) >= count, DEADLINE_S)
        check(ok, f"near cache: its listener must SUBSCRIBE; {len(self._held)} held")

    def release(self) -> None:
        """Send what was held, and let every later SUBSCRIBE through."""
        with self._cond:
            self._released = True
            held, self._held = self._held, []
        for send in held:
            send()
