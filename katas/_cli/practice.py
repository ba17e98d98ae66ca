"""The timed loops behind ``kata start`` (solo practice) and ``kata pair`` (interviewing).

Both read time only from an injected clock (``now_ns()``, integer nanoseconds) and wait
only through a :class:`~katas._cli.terminal.Terminal` or, while tests run, the run in
progress (:class:`RunningSuite`), so tests run a 45-minute session in milliseconds with a
:class:`~katas._runtime.clock.ManualClock`, a scripted terminal and scripted runs. The live
line (countdown, progress bar, keys) is a renderable that reads the clock each time it is
drawn, so in a real terminal it keeps ticking while a suite runs.
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

from katas._cli.state import clock_text
from katas._cli.terminal import Terminal
from katas._cli.watch import Watcher
from katas._registry.suites import SuiteRun
from katas._runtime.clock import NS_PER_S, Clock

#: How often a session looks for saved files and redraws.
POLL_NS = NS_PER_S // 2
RUN_KEYS = ("r", " ", "\n", "\r")
WHOLE_KEYS = ("a",)  # the full picture: every selected test, no stop at the first failure
HINT_KEYS = ("h",)
QUIT_KEYS = ("q",)


def tally(result: SuiteRun) -> tuple[int, int]:
    """``(passed, of)``: the tests that ran, and those a run stopped at its first failure
    left; skipped tests count for neither."""
    passed = len(result.by_outcome("passed"))
    return passed, passed + len(result.failures()) + result.not_run


def verdict(result: SuiteRun) -> str:
    """``47/61 passed`` (``, 5 timed out`` and ``, 1 crashed`` where some did), or for a
    run that stopped at its first failure what it knows: ``3 passed, then a failure; 57
    not run``."""
    passed, of = tally(result)
    if result.not_run:
        return f"{passed} passed, then a failure{result.troubles()}; {result.not_run} not run"
    return f"{passed}/{of} passed{result.troubles()}"


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

#: How long a session waits at a time for a run in progress before it reads keys and the
#: clock again: at most this long, ``q`` or ``r`` takes to act while tests run.
RUN_WAIT_NS = NS_PER_S // 20


class StartRun(Protocol):
    """Starts a run of the suite: ``whole`` runs every selected test; otherwise the tests
    that failed last run first and the run stops at the first failure (feedback in
    seconds while practising)."""

    def __call__(self, whole: bool) -> RunningSuite: ...


class RunningSuite(Protocol):
    """A suite run in progress, as :func:`~katas._registry.suites.start_suite` starts one."""

    def wait(self, timeout_s: float | None = None) -> SuiteRun | None:
        """Wait at most ``timeout_s`` for the result; None if it is not there yet."""
        ...

    def kill(self) -> None:
        """End the run now (and whatever it started)."""
        ...


@dataclass
class SoloOutcome:
    """How a practice attempt ended."""

    result: str  # how it ended: green | timeout | stopped | interrupted
    elapsed_ns: int
    green_ns: int | None  # time to (first) green: from the start to the save that turned it so
    last: SuiteRun | None  # the last run that finished
    runs: int  # runs that finished
    green: SuiteRun | None = None  # the run that first went green
    restarts: int = 0  # runs cancelled for a fresher one (a save or r while tests ran)


@dataclass
class _SoloView:
    clock: Clock
    started_ns: int
    timebox_ns: int
    title: str
    last: SuiteRun | None = None
    running: str | None = None  # why a run is in progress ("saved stage1.py")
    running_since_ns: int = 0
    runs: int = 0
    keys_text: str = ""  # the session's own keys ("? ask a question · p the prompt")

    def __rich__(self) -> RenderableType:
        now = self.clock.now_ns()
        left = self.started_ns + self.timebox_ns - now
        head, grid = _countdown(left, self.timebox_ns, self.title)
        if self.last is None:
            passed, ran = 0, 0
        else:
            passed, ran = tally(self.last)
        bar = ProgressBar(
            total=max(ran, 1), completed=passed, width=30, complete_style="green", style="red"
        )
        status = Text(verdict(self.last) if self.last else "not run yet", style="bold")
        if self.running:
            took = (now - self.running_since_ns) // NS_PER_S
            status.append(f"  running {took}s… ({self.running})", style="yellow")
        grid.add_row(bar, status)
        run_key = "r restart" if self.running else "r run now"
        more = f"{self.keys_text} · " if self.keys_text else ""
        keys = Text(
            f"{run_key} (failed first, stops at a failure) · a run all · h next hint · "
            f"{more}q stop",
            style="dim",
        )
        return Group(head, grid, keys)


@dataclass
class _SoloState:
    """What one attempt knows between its stretches of watching."""

    view: _SoloView
    trigger: str | None = "start"  # why the next run starts now (None: no run to start)
    whole: bool = True  # whether that run is of every test (else failed first, stop at one)
    trigger_ns: int = 0  # when the run in progress was asked for (elapsed)
    running: RunningSuite | None = None
    next_poll_ns: int = 0
    green_ns: int | None = None
    green: SuiteRun | None = None
    restarts: int = 0
    pause: Callable[[], None] | None = None  # what to do outside the live line, then go on


@dataclass(frozen=True)
class SessionKey:
    """A key a session answers besides its built-in ones (r, a, h, q): its label in the
    live line and its action.

    An action that ``reads`` a line of input runs outside the live line (the run in
    progress goes on meanwhile); any other prints above it, the timer still ticking.
    """

    label: str  # "next note"
    action: Callable[[], None]
    reads: bool = False


@dataclass
class SoloSession:
    """One practice attempt: countdown, watching, re-running, time to green.

    A run goes on while the session reads keys and watches files: ``q`` (or Ctrl-C, or
    the end of the timebox) kills it and ends the attempt at once, ``r`` or a save starts
    a fresh run in its place. The first run, and one after ``a``, runs every test; one
    after a save or ``r`` runs what failed last first and stops at the first failure.
    When a run goes green, ``on_green`` (outside the live line, so it may ask a question)
    returns why to go on watching, or None to end the attempt. ``keys`` are the
    session's own (an interview's ``?`` and ``p``); without ``run_at_start`` nothing runs
    until the first save or ``r``.
    """

    clock: Clock
    terminal: Terminal
    console: Console
    timebox_ns: int
    watcher: Watcher
    start_run: StartRun
    on_result: Callable[[SuiteRun, int], None]  # (result, elapsed_ns) of each finished run
    on_hint: Callable[[], None]
    on_green: Callable[[SuiteRun, int], str | None] | None = None  # (result, time to green)
    title: str = ""
    poll_ns: int = POLL_NS
    run_wait_ns: int = RUN_WAIT_NS
    keys: Mapping[str, SessionKey] = field(default_factory=dict)  # lower-case key -> action
    run_at_start: bool = True

    def _elapsed(self, state: _SoloState) -> int:
        return self.clock.now_ns() - state.view.started_ns

    def _start(self, state: _SoloState, live: _Refresh) -> None:
        why = state.trigger or "run now"
        if state.running is not None:  # stale: the files changed, or r asked for a fresh run
            state.running.kill()
            state.running = None
            state.restarts += 1
            self.console.print(
                Text(f"[{clock_text(self._elapsed(state))}] restarted: {why}", style="dim")
            )
        state.trigger = None
        state.trigger_ns = self._elapsed(state)
        state.running = self.start_run(state.whole)
        state.view.running = why
        state.view.running_since_ns = self.clock.now_ns()
        live.refresh()

    def _finished(self, state: _SoloState, result: SuiteRun) -> None:
        state.running = None
        state.view.running = None
        state.view.last = result
        state.view.runs += 1
        self.on_result(result, self._elapsed(state))

    def _watch(self, state: _SoloState) -> str:
        """Watch until a run goes green, the timebox ends or ``q``: how it ended."""
        with self.terminal.keys(), live_line(self.console, state.view) as live:
            try:
                while True:
                    if state.trigger is not None:
                        self._start(state, live)
                    now = self.clock.now_ns()
                    left = state.view.started_ns + self.timebox_ns - now
                    if left <= 0:
                        return "timeout"
                    if state.running is not None:
                        finished = state.running.wait(min(self.run_wait_ns, left) / NS_PER_S)
                        key = self.terminal.wait_key(0)
                        if finished is not None:
                            self._finished(state, finished)
                            if finished.ok:
                                return "green"
                    else:
                        key = self.terminal.wait_key(min(self.poll_ns, left))
                    key = key.lower() if key is not None else None
                    if key in QUIT_KEYS:
                        return "stopped"
                    if key in HINT_KEYS:
                        self.on_hint()
                    own = self.keys.get(key) if key is not None else None
                    if own is not None and own.reads:
                        state.pause = own.action
                        return "pause"
                    if own is not None:
                        own.action()
                    now = self.clock.now_ns()
                    if state.running is None or now >= state.next_poll_ns:
                        state.next_poll_ns = now + self.poll_ns
                        changed = self.watcher.poll()
                    else:
                        changed = []
                    if changed:
                        names = sorted({p.name for p in changed})
                        more = "…" if len(names) > 3 else ""
                        state.trigger, state.whole = "saved " + ", ".join(names[:3]) + more, False
                    elif key in RUN_KEYS:
                        state.trigger, state.whole = "run now", False
                    elif key in WHOLE_KEYS:
                        state.trigger, state.whole = "run all", True
                    live.refresh()
            finally:
                # q, the timebox, Ctrl-C: the run goes too (a pause lets it run on)
                if state.running is not None and state.pause is None:
                    state.running.kill()
                    state.running = None
                    state.view.running = None

    def run(self) -> SoloOutcome:
        view = _SoloView(self.clock, self.clock.now_ns(), self.timebox_ns, self.title)
        view.keys_text = " · ".join(f"{k} {key.label}" for k, key in self.keys.items())
        state = _SoloState(view, trigger="start" if self.run_at_start else None)
        result = "stopped"
        try:
            while True:
                result = self._watch(state)
                if state.pause is not None:
                    pause, state.pause = state.pause, None
                    pause()
                    continue
                if result != "green" or view.last is None:
                    break
                if state.green_ns is None:
                    state.green_ns, state.green = state.trigger_ns, view.last
                again = self.on_green(view.last, state.trigger_ns) if self.on_green else None
                if again is None:
                    break
                state.trigger, state.whole = again, True  # a new selection: all of it
        except KeyboardInterrupt:
            result = "interrupted"
        finally:
            if state.running is not None:  # Ctrl-C during a pause: the run goes too
                state.running.kill()
                state.running = None
        return SoloOutcome(
            result,
            self._elapsed(state),
            state.green_ns,
            view.last,
            view.runs,
            state.green,
            state.restarts,
        )


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
    "RUN_WAIT_NS",
    "PairOutcome",
    "PairSession",
    "RunningSuite",
    "SessionKey",
    "SoloOutcome",
    "SoloSession",
    "clock_text",
    "live_line",
    "tally",
]
