"""The timed loops behind ``kata start`` (solo practice) and ``kata pair`` (interviewing).

Both read time only from an injected clock (``now_ns()``, integer nanoseconds) and wait
only through a :class:`~katas._kit.terminal.Terminal`, so tests run a 45-minute session
in milliseconds with a :class:`~katas._kit.clock.ManualClock` and a scripted terminal.
The live line (countdown, progress bar, keys) is a renderable that reads the clock each
time it is drawn, so in a real terminal it keeps ticking while a suite runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from katas._kit.clock import NS_PER_S
from katas._kit.suites import SuiteRun
from katas._kit.terminal import Terminal
from katas._kit.watch import Watcher

#: How often a session looks for saved files and redraws.
POLL_NS = NS_PER_S // 2
RUN_KEYS = ("r", " ", "\n", "\r")
HINT_KEYS = ("h",)
QUIT_KEYS = ("q",)


class Clock(Protocol):
    def now_ns(self) -> int: ...


def clock_text(ns: int) -> str:
    """``mm:ss`` (``h:mm:ss`` past an hour), never negative."""
    seconds = max(0, ns) // NS_PER_S
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes:02}:{secs:02}"


def tally(result: SuiteRun) -> tuple[int, int]:
    """``(passed, ran)``: skipped tests count for neither."""
    passed = len(result.by_outcome("passed"))
    return passed, passed + len(result.failures())


class _Refresh(Protocol):
    def refresh(self) -> None: ...


class _NoLive:
    def refresh(self) -> None:
        pass


@contextlib.contextmanager
def live_line(console: Console, view: RenderableType) -> Iterator[_Refresh]:
    """The live countdown in a terminal; nothing at all when output goes to a file or pipe
    (the events printed line by line tell the story there)."""
    if not console.is_terminal:
        yield _NoLive()
        return
    with Live(
        view,
        console=console,
        auto_refresh=True,
        refresh_per_second=4,
        redirect_stdout=False,
        redirect_stderr=False,
    ) as live:
        yield live


def _countdown(left_ns: int, timebox_ns: int, title: str) -> tuple[Text, Table]:
    """The head of a live line (time left, red in the last five minutes) and the empty grid
    below it: a 30-wide column for a progress bar and one for its words."""
    head = Text.assemble(
        ("⏱ ", ""),
        (clock_text(left_ns), "bold red" if left_ns < 5 * 60 * NS_PER_S else "bold"),
        (f" left of {clock_text(timebox_ns)} · {title}", "dim"),
    )
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=30)
    grid.add_column()
    return head, grid


# --- kata start ------------------------------------------------------------------------------


@dataclass
class SoloOutcome:
    """How a practice attempt ended."""

    result: str  # green | timeout | stopped | interrupted
    elapsed_ns: int
    green_ns: int | None  # time to green: from the start to the save that turned it green
    last: SuiteRun | None
    runs: int


@dataclass
class _SoloView:
    clock: Clock
    started_ns: int
    timebox_ns: int
    title: str
    last: SuiteRun | None = None
    running: str | None = None  # why a run is in progress ("saved stage1.py")
    runs: int = 0

    def __rich__(self) -> RenderableType:
        left = self.started_ns + self.timebox_ns - self.clock.now_ns()
        head, grid = _countdown(left, self.timebox_ns, self.title)
        if self.last is None:
            passed, ran = 0, 0
        else:
            passed, ran = tally(self.last)
        bar = ProgressBar(
            total=max(ran, 1), completed=passed, width=30, complete_style="green", style="red"
        )
        status = Text(f"{passed}/{ran} passed" if self.last else "not run yet", style="bold")
        if self.running:
            status.append(f"  running… ({self.running})", style="yellow")
        grid.add_row(bar, status)
        keys = Text("r run now · h next hint · q stop · Ctrl-C stop", style="dim")
        return Group(head, grid, keys)


@dataclass
class SoloSession:
    """One practice attempt: countdown, watching, re-running, time to green."""

    clock: Clock
    terminal: Terminal
    console: Console
    timebox_ns: int
    watcher: Watcher
    run_tests: Callable[[], SuiteRun]
    on_result: Callable[[SuiteRun, int], None]  # (result, elapsed_ns)
    on_hint: Callable[[], None]
    title: str = ""
    poll_ns: int = POLL_NS

    def _elapsed(self, started: int) -> int:
        return self.clock.now_ns() - started

    def _run(self, view: _SoloView, live: _Refresh, why: str, started: int) -> SuiteRun:
        view.running = why
        live.refresh()
        try:
            result = self.run_tests()
        finally:
            view.running = None
        view.last = result
        view.runs += 1
        self.on_result(result, self._elapsed(started))
        live.refresh()
        return result

    def run(self) -> SoloOutcome:
        started = self.clock.now_ns()
        view = _SoloView(self.clock, started, self.timebox_ns, self.title)
        result = "stopped"
        green: int | None = None
        try:
            with self.terminal.keys(), live_line(self.console, view) as live:
                trigger: str | None = "start"
                while True:
                    if trigger is not None:
                        trigger_ns = self._elapsed(started)
                        if self._run(view, live, trigger, started).ok:
                            green = trigger_ns
                            result = "green"
                            break
                        trigger = None
                    left = started + self.timebox_ns - self.clock.now_ns()
                    if left <= 0:
                        result = "timeout"
                        break
                    key = self.terminal.wait_key(min(self.poll_ns, left))
                    if key is not None:
                        key = key.lower()
                    if key in QUIT_KEYS:
                        break
                    if key in HINT_KEYS:
                        self.on_hint()
                    changed = self.watcher.poll()
                    if changed:
                        names = sorted({p.name for p in changed})
                        trigger = "saved " + ", ".join(names[:3]) + ("…" if len(names) > 3 else "")
                    elif key in RUN_KEYS:
                        trigger = "run now"
                    live.refresh()
        except KeyboardInterrupt:
            result = "interrupted"
        return SoloOutcome(result, self._elapsed(started), green, view.last, view.runs)


# --- kata pair -------------------------------------------------------------------------------


@dataclass
class PairOutcome:
    result: str  # timeout | stopped | interrupted
    elapsed_ns: int
    swaps: int


@dataclass
class _PairView:
    clock: Clock
    started_ns: int
    timebox_ns: int
    swap_ns: int
    title: str
    swaps: int = 0
    roles: tuple[str, str] = ("A", "B")
    keys_text: str = ""  # the session's own keys ("n next note · p the prompt")

    def __rich__(self) -> RenderableType:
        now = self.clock.now_ns()
        elapsed = now - self.started_ns
        head, grid = _countdown(self.timebox_ns - elapsed, self.timebox_ns, self.title)
        grid.add_row(
            ProgressBar(
                total=max(self.timebox_ns, 1), completed=min(elapsed, self.timebox_ns), width=30
            ),
            Text(f"{clock_text(elapsed)} elapsed"),
        )
        lines: list[RenderableType] = [head, grid]
        if self.swap_ns:
            next_swap = self.swap_ns * (self.swaps + 1) - elapsed
            lines.append(
                Text(
                    f"driver: {self.roles[0]} · navigator: {self.roles[1]} · "
                    f"swap in {clock_text(next_swap)}"
                )
            )
        keys = f"{self.keys_text} · " if self.keys_text else ""
        lines.append(Text(f"{keys}q end the session now · Ctrl-C end", style="dim"))
        return Group(*lines)


@dataclass(frozen=True)
class SessionKey:
    """A key a pairing session answers besides q: its label in the live line, its action."""

    label: str  # "next note"
    action: Callable[[], None]  # prints above the live line; the timer keeps running


@dataclass
class PairSession:
    """The interview timer: countdown and driver/navigator swaps every ``swap_ns``."""

    clock: Clock
    terminal: Terminal
    console: Console
    timebox_ns: int
    swap_ns: int  # 0: no swaps
    on_swap: Callable[[int, int], None]  # (swap number, elapsed_ns)
    title: str = ""
    poll_ns: int = POLL_NS
    keys: Mapping[str, SessionKey] = field(default_factory=dict)  # lower-case key -> action

    def run(self) -> PairOutcome:
        started = self.clock.now_ns()
        view = _PairView(self.clock, started, self.timebox_ns, self.swap_ns, self.title)
        view.keys_text = " · ".join(f"{k} {key.label}" for k, key in self.keys.items())
        result = "timeout"
        try:
            with self.terminal.keys(), live_line(self.console, view) as live:
                while True:
                    elapsed = self.clock.now_ns() - started
                    if elapsed >= self.timebox_ns:
                        break
                    while self.swap_ns and elapsed >= self.swap_ns * (view.swaps + 1):
                        view.swaps += 1
                        view.roles = (view.roles[1], view.roles[0])
                        self.on_swap(view.swaps, self.swap_ns * view.swaps)
                    waits = [self.poll_ns, self.timebox_ns - elapsed]
                    if self.swap_ns:
                        waits.append(self.swap_ns * (view.swaps + 1) - elapsed)
                    key = self.terminal.wait_key(max(1, min(waits)))
                    if key is not None and key.lower() in QUIT_KEYS:
                        result = "stopped"
                        break
                    if key is not None and key.lower() in self.keys:
                        self.keys[key.lower()].action()
                    live.refresh()
        except KeyboardInterrupt:
            result = "interrupted"
        return PairOutcome(result, self.clock.now_ns() - started, view.swaps)


__all__ = [
    "POLL_NS",
    "PairOutcome",
    "PairSession",
    "SessionKey",
    "SoloOutcome",
    "SoloSession",
    "clock_text",
    "live_line",
    "tally",
]
