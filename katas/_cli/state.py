"""The learner's progress and the file it is kept in.

:class:`Practice` is the typed model every command reads and changes: the timed
attempts (:class:`Attempt`), the hints revealed, the last run of each kata stage
(:class:`StageResult`); it says a stage's status, its best time and what to do next
(:meth:`Practice.where`). It is kept in one JSON file in the user's state directory
(``$XDG_STATE_HOME/infra-katas/``, default ``~/.local/state/infra-katas/``;
``KATA_STATE_DIR`` overrides it), never in the repository, as plain JSON a person can
read (:class:`Attempt` and :class:`StageResult` keep every key they do not know, so a
file stays whole). Every change is a :meth:`StateStore.update` transaction: an exclusive
lock on a side file, read, change, write to a temporary file and ``os.replace`` it over
the old one, so a crash or a second ``kata`` process never leaves half a file.

A file that cannot be read back (invalid JSON, a wrong shape, a newer version) raises
:class:`StateError` with one line for the user, and is never written over: the store
refuses every write until the user moves it away, so no recorded history is lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from katas._registry.catalog import Kata, Stage
from katas._runtime.clock import NS_PER_S

ENV_STATE_DIR = "KATA_STATE_DIR"
APP = "infra-katas"
STATE_FILE = "state.json"
VERSION = 1  # ``reset_at`` in a result is optional, so files without it are still version 1
#: What :meth:`Practice.status` says of a stage: its learner's current code.
STATUSES = ("passed", "failing", "reset", "not started")


def clock_text(ns: int) -> str:
    """``mm:ss`` (``h:mm:ss`` past an hour), never negative."""
    seconds = max(0, ns) // NS_PER_S
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes:02}:{secs:02}"


def _number(value: object) -> float | None:
    """``value`` if it is a number (not a bool); else None (a hand-edited file)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    return None


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _keep(record: Attempt | StageResult | Round, data: Mapping[str, object]) -> None:
    """Make ``record`` (just decoded from ``data``) write back what ``data`` held: its keys
    unknown here or holding a value of the wrong type as they are, and no key it lacked —
    so a file this command reads (a hand-edited one too) is written back as it was."""
    written = record.to_json()
    record.other = {k: v for k, v in data.items() if k not in written or written[k] != v}
    record.missing = frozenset(written) - frozenset(data)


@dataclass(frozen=True)
class Asked:
    """A question asked in interview mode: its words, the clarifying question it was
    answered as (None: the stock answer), and when (seconds into the attempt)."""

    text: str
    means: str | None
    seconds: float
    before_first_run: bool


@dataclass
class Interview:
    """What an interview-mode attempt (``kata start --interview``) adds to it: the
    questions asked, the stage's key questions, when the full prompt was opened (None:
    never) and the curveball shown at the end."""

    asked: list[Asked] = field(default_factory=list)
    key: list[str] = field(default_factory=list)
    prompt_opened_seconds: float | None = None
    curveball: str = ""

    def key_asked(self, *, before_first_run: bool) -> list[str]:
        """The key questions asked (before the first run only, with ``before_first_run``)."""
        meant = {a.means for a in self.asked if a.before_first_run or not before_first_run}
        return [q for q in self.key if q in meant]

    def key_missed(self) -> list[str]:
        """The key questions never asked."""
        asked = set(self.key_asked(before_first_run=False))
        return [q for q in self.key if q not in asked]

    @classmethod
    def from_json(cls, data: object) -> Interview | None:
        if not isinstance(data, Mapping):
            return None
        asked = data.get("asked")
        key = data.get("key")
        return cls(
            asked=[
                Asked(
                    str(a.get("text", "")),
                    _text(a.get("means")),
                    _number(a.get("seconds")) or 0.0,
                    bool(a.get("before_first_run")),
                )
                for a in (asked if isinstance(asked, list) else [])
                if isinstance(a, Mapping)
            ],
            key=[str(k) for k in key] if isinstance(key, list) else [],
            prompt_opened_seconds=_number(data.get("prompt_opened_seconds")),
            curveball=str(data.get("curveball", "")),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "asked": [
                {
                    "text": a.text,
                    "means": a.means,
                    "seconds": a.seconds,
                    "before_first_run": a.before_first_run,
                }
                for a in self.asked
            ],
            "key": list(self.key),
            "prompt_opened_seconds": self.prompt_opened_seconds,
            "curveball": self.curveball,
        }


@dataclass
class Attempt:
    """One timed session at a stage: solo (``kata start``), an interview (``kata start
    --interview``) or pairing (``kata pair``).

    In the file it is one object with these keys; the optional ones appear only where
    they apply (a solo attempt's runs, a pairing's rubric sheet, a unit's name).
    """

    kata: str
    stage: int | None
    mode: str  # solo | interview | pair
    started: float | None  # epoch s
    seconds: float | None  # its length
    timebox_minutes: float | None
    green_seconds: float | None  # time to green, or None
    result: str  # green | timeout | stopped | interrupted
    passed: int | None
    total: int | None
    hints_used: int = 0
    learners_code: bool = True  # whether it tested the learner's own code
    unit: str | None = None  # a practice unit attempted alone: never the stage's result
    # solo: runs finished, whether of the core only, the earlier stages' code
    runs: int | None = None
    core_only: bool | None = None
    base: str | None = None
    #: with ``went_on``: when the whole suite went green after the core (None: never)
    whole_green_seconds: float | None = None
    went_on: bool = False  # the learner went on from the core to the whole suite
    # pair: swaps announced, the rubric sheet's rows and its file (an interview's rubric
    # is the learner's self-assessment)
    swaps: int | None = None
    rubric: list[dict[str, str]] | None = None
    sheet: str | None = None
    interview: Interview | None = None
    other: dict[str, object] = field(default_factory=dict)  # kept as the file had them
    missing: frozenset[str] = frozenset()  # keys the file did not have

    _OPTIONAL = ("unit", "runs", "core_only", "base", "swaps", "rubric", "sheet", "interview")

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Attempt:
        rubric, core_only = data.get("rubric"), data.get("core_only")
        attempt = cls(
            kata=str(data.get("kata", "?")),
            stage=_integer(data.get("stage")),
            mode=str(data.get("mode", "solo")),
            started=_number(data.get("started")),
            seconds=_number(data.get("seconds")),
            timebox_minutes=_number(data.get("timebox_minutes")),
            green_seconds=_number(data.get("green_seconds")),
            result=str(data.get("result", "?")),
            passed=_integer(data.get("passed")),
            total=_integer(data.get("total")),
            hints_used=_integer(data.get("hints_used")) or 0,
            learners_code=bool(data.get("learners_code", True)),
            unit=str(data["unit"]) if data.get("unit") else None,
            runs=_integer(data.get("runs")),
            core_only=core_only if isinstance(core_only, bool) else None,
            base=_text(data.get("base")),
            whole_green_seconds=_number(data.get("whole_green_seconds")),
            went_on="whole_green_seconds" in data,
            swaps=_integer(data.get("swaps")),
            rubric=rubric if isinstance(rubric, list) else None,
            sheet=_text(data.get("sheet")),
            interview=Interview.from_json(data.get("interview")),
        )
        _keep(attempt, data)
        return attempt

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("whole_green_seconds", "went_on", "other", "missing")
        }
        data = {k: v for k, v in data.items() if v is not None or k not in self._OPTIONAL}
        if self.interview is not None:
            data["interview"] = self.interview.to_json()
        if self.went_on:
            data["whole_green_seconds"] = self.whole_green_seconds
        return {k: v for k, v in {**data, **self.other}.items() if k not in self.missing}

    @property
    def green(self) -> bool:
        return self.green_seconds is not None

    @property
    def ended(self) -> float | None:
        """When it ended (epoch s), if the file says when it started."""
        return None if self.started is None else self.started + (self.seconds or 0.0)


@dataclass
class StageResult:
    """The last run of the learner's code of a stage (``kata test``, an attempt's last run).

    After ``kata reset`` its ``reset_at`` says when the stub came back, and ``last_ok``,
    ``passed`` and ``total`` are None until the next run.
    """

    ever_passed: bool = False
    last_ok: bool | None = None
    passed: int | None = None
    total: int | None = None
    at: float | None = None  # epoch s
    reset_at: float | None = None
    other: dict[str, object] = field(default_factory=dict)
    missing: frozenset[str] = frozenset()

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> StageResult:
        last_ok = data.get("last_ok")
        result = cls(
            ever_passed=bool(data.get("ever_passed")),
            last_ok=last_ok if isinstance(last_ok, bool) else None,
            passed=_integer(data.get("passed")),
            total=_integer(data.get("total")),
            at=_number(data.get("at")),
            reset_at=_number(data.get("reset_at")),
        )
        _keep(result, data)
        return result

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "ever_passed": self.ever_passed,
            "last_ok": self.last_ok,
            "passed": self.passed,
            "total": self.total,
            "at": self.at,
        }
        if self.reset_at is not None:
            data["reset_at"] = self.reset_at
        return {k: v for k, v in {**data, **self.other}.items() if k not in self.missing}


@dataclass
class Round:
    """One round of an interview mode: a debugging round (``kata debug``: a copy of a
    stage's reference with catalogue bugs in it, to find and fix from an incident report)
    or a review round (``kata review``: proposed changes to approve or reject)."""

    mode: str  # debug | review
    kata: str
    stage: int
    entries: list[str]  # the diffs shown, as ``kata/stageN_slug``
    started: float | None  # epoch s
    seconds: float | None
    result: str  # debug: solved | timeout | stopped | interrupted; review: done | stopped
    # debug: where the copy was laid out, the suite runs finished, the lines added or
    # removed in the copy against its bugged start, the hints shown
    copy: str = ""
    runs: int = 0
    lines_changed: int = 0
    hints_used: int = 0
    # review: verdicts that were right, and of the bugs rejected, the rules named right
    verdicts_right: int = 0
    rules_right: int = 0
    rules_asked: int = 0
    paired: bool = False  # run by an interviewer in ``kata pair --round``
    other: dict[str, object] = field(default_factory=dict)
    missing: frozenset[str] = frozenset()

    _INTEGERS = (
        "runs",
        "lines_changed",
        "hints_used",
        "verdicts_right",
        "rules_right",
        "rules_asked",
    )

    @property
    def solved(self) -> bool:
        return self.result == "solved"

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Round:
        entries = data.get("entries")
        record = cls(
            mode=str(data.get("mode", "?")),
            kata=str(data.get("kata", "?")),
            stage=_integer(data.get("stage")) or 0,
            entries=[str(e) for e in entries] if isinstance(entries, list) else [],
            started=_number(data.get("started")),
            seconds=_number(data.get("seconds")),
            result=str(data.get("result", "?")),
            copy=str(data.get("copy", "")),
            paired=data.get("paired") is True,
        )
        for name in cls._INTEGERS:
            setattr(record, name, _integer(data.get(name)) or 0)
        _keep(record, data)
        return record

    def to_json(self) -> dict[str, object]:
        kept = [f.name for f in fields(self) if f.name not in ("other", "missing")]
        data = {name: getattr(self, name) for name in kept}
        return {k: v for k, v in {**data, **self.other}.items() if k not in self.missing}


def _last_status(attempts: list[Attempt]) -> str | None:
    """``passed`` or ``failing`` by the newest of ``attempts``; None if there is none."""
    if not attempts:
        return None
    last = max(attempts, key=lambda a: a.started or 0.0)
    return "passed" if last.green else "failing"


class StateError(Exception):
    """The state file cannot be used; ``str()`` is one line for the user."""


def state_dir() -> Path:
    """``KATA_STATE_DIR``, else ``$XDG_STATE_HOME/infra-katas``, else ``~/.local/state/…``."""
    explicit = os.environ.get(ENV_STATE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else None
    return (base or Path.home() / ".local" / "state") / APP


def stage_key(kata: str, stage: int) -> str:
    return f"{kata}/{stage}"


@dataclass(frozen=True)
class WhereAmI:
    """The learner's position: stages green, the stage in progress, what to run next."""

    summary: str  # "3 of 9 stages green · in progress: rate_limiter 2 (failing, 4/9 passed)"
    command: str  # "kata start rate_limiter 2"
    why: str  # what follows the command on its line: " · core: …", ", then kata start …"
    stage: tuple[Kata, Stage] | None  # the stage in progress, or the one to do next


@dataclass
class Practice:
    """The learner's progress: the attempts, the hints revealed and each stage's last run.

    It answers what :mod:`katas._cli` asks of the history (a stage's status, its best
    time, where the learner is) and records what happens (a run, a reset, a hint).
    """

    attempts: list[Attempt]
    hints: dict[str, int]  # stage key -> number of hints revealed
    results: dict[str, StageResult]  # stage key -> its last run
    rounds: list[Round] = field(default_factory=list)  # kata debug, kata review; once any

    @classmethod
    def empty(cls) -> Practice:
        return cls([], {}, {})

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "version": VERSION,
            "attempts": [a.to_json() for a in self.attempts],
            "hints": self.hints,
            "results": {key: r.to_json() for key, r in self.results.items()},
        }
        if self.rounds:
            data["rounds"] = [r.to_json() for r in self.rounds]
        return data

    # --- queries -------------------------------------------------------------------------

    def attempts_of(self, kata: str, stage: int) -> list[Attempt]:
        return [a for a in self.attempts if a.kata == kata and a.stage == stage]

    def times_drawn(self, kata: str) -> dict[str, int]:
        """How often each catalogue entry of ``kata`` was drawn for a debugging round."""
        drawn: dict[str, int] = {}
        for round_ in self.rounds:
            if round_.mode == "debug" and round_.kata == kata:
                for entry in round_.entries:
                    drawn[entry] = drawn.get(entry, 0) + 1
        return drawn

    def hints_revealed(self, kata: str, stage: int) -> int:
        return self.hints.get(stage_key(kata, stage), 0)

    def learners_attempts(self, kata: str, stage: int, unit: str | None = None) -> list[Attempt]:
        """The attempts that tested the learner's own code: of the whole stage, or (with
        ``unit``) of that practice unit alone, which never count as the stage's."""
        return [a for a in self.attempts_of(kata, stage) if a.learners_code and a.unit == unit]

    def units_attempted(self, kata: str, stage: int) -> list[str]:
        """The practice units of the stage with an attempt of their own, in name order."""
        return sorted({a.unit for a in self.attempts_of(kata, stage) if a.unit})

    def unit_status(self, kata: str, stage: int, unit: str) -> str:
        """``passed`` or ``failing`` by the unit's last attempt; ``not started`` without."""
        return _last_status(self.learners_attempts(kata, stage, unit)) or "not started"

    def passed(self, kata: str, stage: int) -> bool:
        """Whether the learner's code *ever* passed the stage (a green attempt or test run),
        even if it was reset since: what unlocks ``kata reveal`` and ``kata hint --all``."""
        result = self.results.get(stage_key(kata, stage))
        return (result is not None and result.ever_passed) or any(
            a.green for a in self.learners_attempts(kata, stage)
        )

    def status(self, kata: str, stage: int) -> str:
        """What the learner's *current* code does: one of :data:`STATUSES`.

        ``passed`` or ``failing`` by the last run of it; ``reset`` once ``kata reset``
        restored the stub (until the next run); ``not started`` without any history.
        """
        result = self.results.get(stage_key(kata, stage))
        if result is not None:
            if result.reset_at is not None:
                return "reset"
            if result.last_ok is not None:
                return "passed" if result.last_ok else "failing"
        last = _last_status(self.learners_attempts(kata, stage))
        if last:  # no run recorded for the stage: the last attempt says
            return last
        return "failing" if result is not None or self.attempts_of(kata, stage) else "not started"

    def green(self, kata: str, stage: int) -> bool:
        """Whether the learner's current code passes the stage (its last run did)."""
        return self.status(kata, stage) == "passed"

    def last_activity(self, kata: str, stage: int) -> float | None:
        """When the stage was last worked on (epoch s): a run, the end of an attempt, a reset."""
        result = self.results.get(stage_key(kata, stage)) or StageResult()
        times = [result.at, result.reset_at, *(a.ended for a in self.attempts_of(kata, stage))]
        found = [t for t in times if t is not None]
        return max(found) if found else None

    def best_seconds(self, kata: str, stage: int, unit: str | None = None) -> float | None:
        """The fastest time to green of the stage (or of one of its units)."""
        times = [
            a.green_seconds
            for a in self.learners_attempts(kata, stage, unit)
            if a.green_seconds is not None
        ]
        return float(min(times)) if times else None

    def best_text(self, kata: str, stage: int) -> str:
        """The best time as ``mm:ss``, or "—" for a stage never timed green."""
        seconds = self.best_seconds(kata, stage)
        return "—" if seconds is None else clock_text(int(seconds * NS_PER_S))

    def how_far(self, kata: str, stage: int) -> str:
        """``failing, 4/9 passed`` or ``reset to the stub``: the state of a stage in progress."""
        status = self.status(kata, stage)
        if status == "reset":
            return "reset to the stub"
        result = self.results.get(stage_key(kata, stage)) or StageResult()
        if result.passed is not None and result.total:
            return f"{status}, {result.passed}/{result.total} passed"
        return status

    def where(self, katas: Sequence[Kata]) -> WhereAmI:
        """Where the learner is, and what to do next.

        The stage in progress is the one worked on last (a run, an attempt, a reset) that
        is not green now: carry on with it. Without one, the next stage is the one after
        the stage that went green last, else the first one not green: read its prompt,
        then time yourself. Once everything is green: a timed attempt at the stage never
        timed, or the slowest one.
        """
        stages = [(kata, stage) for kata in katas for stage in kata.stages]
        if not stages:
            return WhereAmI("no stages yet", "kata --help", "", None)
        green = [self.green(k.name, s.number) for k, s in stages]
        head = f"{sum(green)} of {len(stages)} stages green"
        when = [self.last_activity(k.name, s.number) for k, s in stages]
        # the stages worked on, the latest first (on a tie, the earlier stage first)
        touched = sorted(
            (i for i in range(len(stages)) if when[i] is not None),
            key=lambda i: (when[i], -i),
            reverse=True,
        )
        in_progress = [i for i in touched if not green[i]]
        if in_progress:
            kata, stage = stages[in_progress[0]]
            return WhereAmI(
                f"{head} · in progress: {kata.name} {stage.number} "
                f"({self.how_far(kata.name, stage.number)})",
                f"kata start {kata.name} {stage.number}",
                f" · core: {stage.core}",
                (kata, stage),
            )
        if all(green):
            timed = [(self.best_seconds(k.name, s.number), i) for i, (k, s) in enumerate(stages)]
            never = [i for seconds, i in timed if seconds is None]
            index = never[0] if never else max(timed, key=lambda t: t[0] or 0.0)[1]
            kata, stage = stages[index]
            best = self.best_text(kata.name, stage.number)
            return WhereAmI(
                f"{head} — all done. With a friend: kata pair KATA STAGE",
                f"kata start {kata.name} {stage.number}",
                " (green, never timed)" if never else f" (beat your slowest best, {best})",
                (kata, stage),
            )
        index = green.index(False)
        last_green = [i for i in touched if green[i]][:1]
        if last_green and last_green[0] + 1 < len(stages):
            after = last_green[0] + 1
            if stages[after][0] is stages[after - 1][0] and not green[after]:
                index = after  # the next stage of the kata that went green last
        kata, stage = stages[index]
        newcomer = not touched and not self.attempts
        return WhereAmI(
            f"{head} · new here: begin with the first stage's prompt"
            if newcomer
            else f"{head} · next: {kata.name} {stage.number}",
            f"kata show {kata.name} {stage.number}",
            f", then kata start {kata.name} {stage.number} ({stage.timebox_minutes} min)",
            (kata, stage),
        )

    # --- changes -------------------------------------------------------------------------

    def record_result(
        self, kata: str, stage: int, *, ok: bool, passed: int, total: int, at: float
    ) -> None:
        """A run of the learner's code: it describes the code as it is now (not "reset")."""
        key = stage_key(kata, stage)
        previous = self.results.get(key) or StageResult()
        self.results[key] = StageResult(previous.ever_passed or ok, ok, passed, total, at)

    def record_reset(self, kata: str, stage: int, *, at: float) -> None:
        """The stage file is the stub again: its status is ``reset`` until the next run.

        The history stays: whether it ever passed, the attempts and their best time. A
        stage without any history stays ``not started``.
        """
        key = stage_key(kata, stage)
        if key not in self.results and not self.attempts_of(kata, stage):
            return
        previous = self.results.get(key) or StageResult()
        self.results[key] = StageResult(self.passed(kata, stage), at=previous.at, reset_at=at)

    def reveal_hint(self, kata: str, stage: int, count: int) -> None:
        key = stage_key(kata, stage)
        self.hints[key] = max(self.hints.get(key, 0), count)

    def record_attempt(
        self, attempt: Attempt, hints_before: int, last: tuple[bool, int, int] | None, at: float
    ) -> None:
        """Add ``attempt``, with the hints revealed since ``hints_before``; with ``last``
        ``(ok, passed, total)`` of its last run of the learner's code, that run's result."""
        if attempt.stage is None:
            raise ValueError("an attempt is at a stage")
        attempt.hints_used = max(0, self.hints_revealed(attempt.kata, attempt.stage) - hints_before)
        self.attempts.append(attempt)
        if last is not None and attempt.learners_code:
            ok, passed, total = last
            self.record_result(
                attempt.kata, attempt.stage, ok=ok, passed=passed, total=total, at=at
            )


def _decode(data: object, path: Path) -> Practice:
    def bad(what: str) -> StateError:
        return StateError(
            f"progress file {path} is not usable ({what}); nothing was changed — "
            f"move it away to start afresh, or fix it"
        )

    if not isinstance(data, dict):
        raise bad("not a JSON object")
    version = data.get("version")
    if version != VERSION:
        raise bad(f"version {version!r}, this kata command reads version {VERSION}")
    attempts, hints, results = data.get("attempts"), data.get("hints"), data.get("results")
    if not isinstance(attempts, list) or not all(isinstance(a, dict) for a in attempts):
        raise bad("'attempts' must be a list of objects")
    if not isinstance(hints, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in hints.values()
    ):
        raise bad("'hints' must map stages to counts")
    if not isinstance(results, dict) or not all(isinstance(v, dict) for v in results.values()):
        raise bad("'results' must map stages to objects")
    rounds = data.get("rounds", [])
    if not isinstance(rounds, list) or not all(isinstance(r, dict) for r in rounds):
        raise bad("'rounds' must be a list of objects")
    return Practice(
        [Attempt.from_json(a) for a in attempts],
        hints,
        {str(key): StageResult.from_json(r) for key, r in results.items()},
        [Round.from_json(r) for r in rounds],
    )


class StateStore:
    """The state file in ``directory``; reads are lock-free, writes are transactions."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or state_dir()

    @property
    def path(self) -> Path:
        return self.directory / STATE_FILE

    def load(self) -> Practice:
        """The current state (empty if there is no file yet); :class:`StateError` if unusable."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return Practice.empty()
        except (OSError, UnicodeDecodeError) as exc:
            raise StateError(f"progress file {self.path} cannot be read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StateError(
                f"progress file {self.path} is corrupted (invalid JSON at line {exc.lineno}); "
                "nothing was changed — move it away to start afresh, or fix it"
            ) from None
        return _decode(data, self.path)

    @contextlib.contextmanager
    def update(self) -> Iterator[Practice]:
        """Lock, load, let the caller change the state, write it back atomically.

        Nothing is written if the body raises, or if the file on disk is unusable.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            lock = open(self.directory / "state.lock", "a+")  # noqa: SIM115 - held below
        except OSError as exc:
            raise StateError(
                f"cannot write to the state directory {self.directory}: {exc}"
            ) from None
        with lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            state = self.load()
            yield state
            self._write(state)

    def _write(self, state: Practice) -> None:
        text = json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=".state-", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def save_file(self, relative: str, text: str) -> Path:
        """Write ``text`` to ``relative`` under the state directory (atomically); its path."""
        path = self.directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(tmp, path)
        return path


__all__ = [
    "ENV_STATE_DIR",
    "STATUSES",
    "Asked",
    "Attempt",
    "Interview",
    "Practice",
    "Round",
    "StageResult",
    "StateError",
    "StateStore",
    "WhereAmI",
    "clock_text",
    "stage_key",
    "state_dir",
]
