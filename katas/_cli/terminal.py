"""The keyboard side of a timed session: single key presses and yes/no questions.

:class:`Terminal` is what the session loops use, so tests drive them with a scripted
fake (and a :class:`~katas._runtime.clock.ManualClock`) instead of a keyboard and real time.
:class:`KeyboardTerminal` reads the real one: with a terminal on stdin, keys arrive
without Enter (cbreak mode, Ctrl-C still interrupts); without one, no key ever arrives
and waiting is plain sleeping.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Protocol, TextIO

from katas._runtime.clock import NS_PER_S


class Terminal(Protocol):
    """Key presses and questions; ``wait_key`` is also how a session waits."""

    @property
    def interactive(self) -> bool:
        """Whether a person can answer questions (stdin is a terminal)."""
        ...

    def keys(self) -> contextlib.AbstractContextManager[None]:
        """While entered, single key presses are read without Enter and not echoed."""
        ...

    def wait_key(self, timeout_ns: int) -> str | None:
        """Wait at most ``timeout_ns`` for a key press; the key, or None."""
        ...

    def ask(self, question: str) -> str | None:
        """Ask for one line of input; None if nobody can answer (not interactive, EOF)."""
        ...


class KeyboardTerminal:
    """The process's own stdin."""

    def __init__(self, stdin: TextIO | None = None) -> None:
        self.stdin = stdin or sys.stdin
        self._cbreak = False
        self._typed = ""  # what arrived after the key a read returned, not taken yet

    @property
    def interactive(self) -> bool:
        try:
            return self.stdin.isatty()
        except (ValueError, OSError):  # closed or detached
            return False

    @contextlib.contextmanager
    def keys(self) -> Iterator[None]:
        if not self.interactive:
            yield
            return
        import termios
        import tty

        fd = self.stdin.fileno()
        saved = termios.tcgetattr(fd)
        try:
            tty.setcbreak(fd)
            self._cbreak = True
            yield
        finally:
            self._cbreak = False
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)

    def wait_key(self, timeout_ns: int) -> str | None:
        if self._typed:
            key, self._typed = self._typed[0], self._typed[1:]
            return key
        timeout = max(0, timeout_ns) / NS_PER_S
        if not self._cbreak:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self.stdin], [], [], timeout)
        if not ready:
            return None
        text = os.read(self.stdin.fileno(), 256).decode(errors="replace")
        if text.startswith("\x1b"):  # an arrow or function key: one escape, nothing else
            return text[:1]
        # Typed faster than read (a question after ?, a paste): the rest is kept, for the
        # next keys or the next line asked for.
        self._typed = text[1:]
        return text[:1] or None

    def ask(self, question: str) -> str | None:
        if not self.interactive:
            return None
        typed, self._typed = self._typed, ""
        line, newline, rest = typed.replace("\r", "\n").partition("\n")
        if newline:  # the whole answer was typed ahead
            self._typed = rest
            print(question + line, flush=True)
            return line
        try:
            import readline  # line editing for input(), and room for what was typed ahead
        except ImportError:  # no readline: what was typed ahead starts the answer
            return self._input(question, typed)
        readline.set_startup_hook(lambda: readline.insert_text(line))
        try:
            return self._input(question, "")
        finally:
            readline.set_startup_hook(None)

    @staticmethod
    def _input(question: str, before: str) -> str | None:
        try:
            return before + input(question)
        except EOFError:
            return None


__all__ = ["KeyboardTerminal", "Terminal"]
