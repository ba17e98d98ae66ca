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
VERSION = 1

#: One attempt: kata, stage, mode ("solo" | "pair"), started (epoch s), seconds (length),
#: timebox_minutes, green_seconds (time to green or None), result ("green" | "timeout" |
#: "stopped" | "interrupted" | "ended"), passed, total, hints_used, and for pairing the
#: rubric sheet.
Attempt = dict[str, Any]


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
    results: dict[str, dict[str, Any]]  # stage key -> {ever_passed, last_ok, passed, total, at}

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

    def passed(self, kata: str, stage: int) -> bool:
        """Whether the learner's code ever passed the stage (a green attempt or test run)."""
        result = self.results.get(stage_key(kata, stage), {})
        return bool(result.get("ever_passed")) or any(
            a.get("green_seconds") is not None and a.get("learners_code", True)
            for a in self.attempts_of(kata, stage)
        )

    def status(self, kata: str, stage: int) -> str:
        if self.passed(kata, stage):
            return "passed"
        if self.attempts_of(kata, stage) or stage_key(kata, stage) in self.results:
            return "failing"
        return "not started"

    def best_seconds(self, kata: str, stage: int) -> float | None:
        times = [
            float(a["green_seconds"])
            for a in self.attempts_of(kata, stage)
            if isinstance(a.get("green_seconds"), int | float) and a.get("learners_code", True)
        ]
        return min(times) if times else None

    # --- changes -------------------------------------------------------------------------

    def record_result(
        self, kata: str, stage: int, *, ok: bool, passed: int, total: int, at: float
    ) -> None:
        key = stage_key(kata, stage)
        previous = self.results.get(key, {})
        self.results[key] = {
            "ever_passed": bool(previous.get("ever_passed")) or ok,
            "last_ok": ok,
            "passed": passed,
            "total": total,
            "at": at,
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
    "Attempt",
    "State",
    "StateError",
    "StateStore",
    "stage_key",
    "state_dir",
]
