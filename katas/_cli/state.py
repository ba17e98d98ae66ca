"""The learner's progress: attempts, revealed hints and the last result per kata stage.

Kept in one JSON file in the user's state directory (``$XDG_STATE_HOME/infra-katas/``,
default ``~/.local/state/infra-katas/``; ``KATA_STATE_DIR`` overrides it), never in the
repository. Every change is a :meth:`StateStore.update` transaction: an exclusive lock
on a side file, read, change, write to a temporary file and ``os.replace`` it over the
old one, so a crash or a second ``kata`` process never leaves half a file.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_STATE_DIR = "KATA_STATE_DIR"
APP = "infra-katas"
STATE_FILE = "state.json"
VERSION = 1  # ``reset_at`` in a result is optional, so files without it are still version 1
#: What :meth:`State.status` says of a stage: its learner's current code.
STATUSES = ("passed", "failing", "reset", "not started")

#: One attempt: kata, stage, mode ("solo" | "pair"), started (epoch s), seconds (length),
#: timebox_minutes, green_seconds (time to green or None), result ("green" | "timeout" |
#: "stopped" | "interrupted" | "ended"), passed, total, hints_used, and for pairing the
#: rubric sheet.
Attempt = dict[str, Any]


def _last_status(attempts: list[Attempt]) -> str | None:
    """``passed`` or ``failing`` by the newest of ``attempts``; None if there is none."""
    if not attempts:
        return None
    last = max(attempts, key=lambda a: _number(a.get("started")) or 0.0)
    return "passed" if last.get("green_seconds") is not None else "failing"


def _number(value: Any) -> float | None:
    """``value`` if it is a number (not a bool), as a float; else None (a hand-edited file)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


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


@dataclass
class State:
    """The decoded file; plain dicts and lists so the JSON stays readable by hand."""

    attempts: list[Attempt]
    hints: dict[str, int]  # stage key -> number of hints revealed
    #: stage key -> {ever_passed, last_ok, passed, total, at} of the last run, plus reset_at
    #: (and last_ok, passed, total None) after a ``kata reset`` until the next run.
    results: dict[str, dict[str, Any]]

    @classmethod
    def empty(cls) -> State:
        return cls([], {}, {})

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "attempts": self.attempts,
            "hints": self.hints,
            "results": self.results,
        }

    # --- queries -------------------------------------------------------------------------

    def attempts_of(self, kata: str, stage: int) -> list[Attempt]:
        return [a for a in self.attempts if a.get("kata") == kata and a.get("stage") == stage]

    def hints_revealed(self, kata: str, stage: int) -> int:
        return self.hints.get(stage_key(kata, stage), 0)

    def learners_attempts(self, kata: str, stage: int, unit: str | None = None) -> list[Attempt]:
        """The attempts that tested the learner's own code: of the whole stage, or (with
        ``unit``) of that practice unit alone, which never count as the stage's."""
        return [
            a
            for a in self.attempts_of(kata, stage)
            if a.get("learners_code", True) and a.get("unit") == unit
        ]

    def units_attempted(self, kata: str, stage: int) -> list[str]:
        """The practice units of the stage with an attempt of their own, in name order."""
        return sorted({str(a["unit"]) for a in self.attempts_of(kata, stage) if a.get("unit")})

    def unit_status(self, kata: str, stage: int, unit: str) -> str:
        """``passed`` or ``failing`` by the unit's last attempt; ``not started`` without."""
        return _last_status(self.learners_attempts(kata, stage, unit)) or "not started"

    def passed(self, kata: str, stage: int) -> bool:
        """Whether the learner's code *ever* passed the stage (a green attempt or test run),
        even if it was reset since: what unlocks ``kata reveal`` and ``kata hint --all``."""
        result = self.results.get(stage_key(kata, stage), {})
        return bool(result.get("ever_passed")) or any(
            a.get("green_seconds") is not None for a in self.learners_attempts(kata, stage)
        )

    def status(self, kata: str, stage: int) -> str:
        """What the learner's *current* code does: one of :data:`STATUSES`.

        ``passed`` or ``failing`` by the last run of it; ``reset`` once ``kata reset``
        restored the stub (until the next run); ``not started`` without any history.
        """
        result = self.results.get(stage_key(kata, stage))
        if result is not None:
            if result.get("reset_at") is not None:
                return "reset"
            if isinstance(result.get("last_ok"), bool):
                return "passed" if result["last_ok"] else "failing"
        last = _last_status(self.learners_attempts(kata, stage))
        if last:  # no run recorded for the stage: the last attempt says
            return last
        return "failing" if result is not None or self.attempts_of(kata, stage) else "not started"

    def green(self, kata: str, stage: int) -> bool:
        """Whether the learner's current code passes the stage (its last run did)."""
        return self.status(kata, stage) == "passed"

    def last_activity(self, kata: str, stage: int) -> float | None:
        """When the stage was last worked on (epoch s): a run, the end of an attempt, a reset."""
        result = self.results.get(stage_key(kata, stage), {})
        times = [_number(result.get("at")), _number(result.get("reset_at"))]
        for attempt in self.attempts_of(kata, stage):
            started = _number(attempt.get("started"))
            if started is not None:
                times.append(started + (_number(attempt.get("seconds")) or 0.0))
        found = [t for t in times if t is not None]
        return max(found) if found else None

    def best_seconds(self, kata: str, stage: int, unit: str | None = None) -> float | None:
        """The fastest time to green of the stage (or of one of its units)."""
        times = [
            float(a["green_seconds"])
            for a in self.learners_attempts(kata, stage, unit)
            if _number(a.get("green_seconds")) is not None
        ]
        return min(times) if times else None

    # --- changes -------------------------------------------------------------------------

    def record_result(
        self, kata: str, stage: int, *, ok: bool, passed: int, total: int, at: float
    ) -> None:
        key = stage_key(kata, stage)
        previous = self.results.get(key, {})
        self.results[key] = {  # a run describes the code as it is now: no longer "reset"
            "ever_passed": bool(previous.get("ever_passed")) or ok,
            "last_ok": ok,
            "passed": passed,
            "total": total,
            "at": at,
        }

    def record_reset(self, kata: str, stage: int, *, at: float) -> None:
        """The stage file is the stub again: its status is ``reset`` until the next run.

        The history stays: whether it ever passed, the attempts and their best time. A
        stage without any history stays ``not started``.
        """
        key = stage_key(kata, stage)
        if key not in self.results and not self.attempts_of(kata, stage):
            return
        previous = self.results.get(key, {})
        self.results[key] = {
            "ever_passed": self.passed(kata, stage),
            "last_ok": None,
            "passed": None,
            "total": None,
            "at": previous.get("at"),
            "reset_at": at,
        }

    def reveal_hint(self, kata: str, stage: int, count: int) -> None:
        key = stage_key(kata, stage)
        self.hints[key] = max(self.hints.get(key, 0), count)


def _decode(data: Any, path: Path) -> State:
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
    return State(attempts, hints, results)


class StateStore:
    """The state file in ``directory``; reads are lock-free, writes are transactions."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or state_dir()

    @property
    def path(self) -> Path:
        return self.directory / STATE_FILE

    def load(self) -> State:
        """The current state (empty if there is no file yet); :class:`StateError` if unusable."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return State.empty()
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
    def update(self) -> Iterator[State]:
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

    def _write(self, state: State) -> None:
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
    "Attempt",
    "State",
    "StateError",
    "StateStore",
    "stage_key",
    "state_dir",
]
