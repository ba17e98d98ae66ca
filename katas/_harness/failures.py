"""Reading a failed kata test: what kind of failure it is, the one line that says it, the
line a learner needs besides it, and the rule of the prompt it broke.

The pytest plugin (:mod:`katas._harness.pytest_plugin`) writes these into the
``--kata-report`` JSON and into pytest's own failure report; the ``kata`` command shows
them. Kinds: ``not_implemented`` (a stub's ``Todo``), ``timeout`` (the test ran
past its profile's deadline), ``assertion`` and ``error``. Nothing here names a kata.
"""

from __future__ import annotations

import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from katas._harness import profiles
from katas._registry.impl import NOT_IMPLEMENTED
from katas._runtime.native import BUILD_SAYS, BuildError
from katas._runtime.todo import Todo

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


def _walk(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes/contexts and the members of exception groups."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        for linked in (e.__cause__, e.__context__):
            if linked is not None:
                stack.append(linked)


def _members(exc: BaseException) -> Iterator[BaseException]:
    """The leaves of an exception group (itself, if it is none)."""
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _members(e)
    else:
        yield exc


#: pytest's words when ``pytest.raises(match=…)`` met a message the pattern does not
#: match, then the pattern and the message a line each (pytest 9: ``Expected regex:`` and
#: ``Actual message:``; before: ``Regex:`` and ``Input:``).
_REGEX_MISMATCH = "Regex pattern did not match."
_REGEX_PATTERN = re.compile(r"^\s*(?:Expected regex|Regex):\s*(?P<text>.*)$", re.M)
_REGEX_INPUT = re.compile(r"^\s*(?:Actual message|Input):\s*(?P<text>.*)$", re.M)


def regex_mismatch(text: str) -> str:
    """``expected a message matching 'x', got 'y'`` from pytest's text of a
    ``pytest.raises(match=…)`` that met another message; "" for any other text."""
    if _REGEX_MISMATCH not in text.split("\n", 1)[0]:
        return ""
    pattern, message = _REGEX_PATTERN.search(text), _REGEX_INPUT.search(text)
    if pattern is None or message is None:
        return ""
    return f"expected a message matching {pattern['text'].strip()}, got {message['text'].strip()}"


def _first_line(text: str, empty: str) -> str:
    """An assertion's one line: its first, or ``empty``; a regex mismatch's first line says
    the pattern and the message too (pytest puts them on the lines after)."""
    if not text:
        return empty
    head = text.splitlines()[0]
    mismatch = regex_mismatch(text)
    return f"{head.removesuffix('.')}: {mismatch}" if mismatch else head


def classify(exc: BaseException) -> tuple[str, str]:
    """``(kind, message)``: kind is ``not_implemented``, ``timeout``, ``assertion`` or
    ``error``."""
    for e in _walk(exc):
        if isinstance(e, profiles.TestTimedOut):
            return "timeout", str(e)
    for e in _walk(exc):
        if isinstance(e, Todo):
            return "not_implemented", NOT_IMPLEMENTED + (str(e) or type(e).__name__)
    top = exc
    if isinstance(top, BaseExceptionGroup):
        # The group's own members only: an assertion's __context__ (the cancellation of
        # the wait that timed out, say) is not a second failure.
        leaves = list(_members(top))
        if leaves and all(isinstance(e, AssertionError | pytest.fail.Exception) for e in leaves):
            return "assertion", _first_line(str(leaves[0]), "assert")
    if isinstance(top, AssertionError | pytest.fail.Exception):
        return "assertion", _first_line(str(top), "assertion failed")
    return "error", f"{type(top).__name__}: {top}".splitlines()[0]


def machine_of(item: pytest.Item) -> type | None:
    """The hypothesis state machine a stateful test (its ``runTest``) walks, or None."""
    return getattr(getattr(item, "obj", None), "_hypothesis_state_machine_class", None)


#: A step in hypothesis's note of a failing run (``state.put(key='a', value=1)``), or in a
#: fixed walk's (:func:`katas._harness.walks.replay`).
_STEP = re.compile(r"^state\.(?P<rule>\w+)\(")


def failing_rule(exc: BaseException) -> str | None:
    """The rule of a state machine whose step failed: the last step before ``teardown`` in
    the notes of ``exc`` (or of the first assertion of its group); None if they say none."""
    for e in (exc, *_assertions(exc)):
        steps = [m["rule"] for n in getattr(e, "__notes__", ()) if (m := _STEP.match(n))]
        steps = [s for s in steps if s != "teardown"]
        if steps:
            return steps[-1]
    return None


def _assertions(exc: BaseException) -> Iterator[BaseException]:
    """The assertion failures ``exc`` stands for: itself, or the leaves of its group."""
    return (e for e in _members(exc) if isinstance(e, AssertionError | pytest.fail.Exception))


def explained_once(text: str) -> str:
    """An assertion's text, said once: a suite's message that already states what was
    expected and what came loses pytest's rewritten comparison of the same objects
    (``assert <repr> == <repr>`` and its ``+ where`` lines); one that does not keeps it,
    since then it is the only place the values are shown."""
    lines = text.splitlines()
    cut = next((i for i, line in enumerate(lines) if i and line.startswith("assert ")), None)
    if cut is None or not _EXPECTED_OR_GOT.search("\n".join(lines[:cut])):
        return text
    return "\n".join(lines[:cut])


def tell_once(exc: BaseException, stage: int, machine: type | None = None) -> None:
    """Rewrite, in place, the messages of the assertions that failed a stage's test: each
    tagged ``stage N:`` (from the test's marker, not typed into every message) and
    :func:`explained_once`. A stateful test's tag names its ``machine`` and the rule whose
    step failed (``stage 1: LRUCacheMachine, rule put: …``), which its test id, hypothesis's
    ``runTest``, does not. Called before pytest formats the failure."""
    tag = f"stage {stage}: "
    if machine is not None:
        rule = failing_rule(exc)
        tag += f"{machine.__name__}{f', rule {rule}' if rule else ''}: "
    for e in _assertions(exc):
        if isinstance(e, pytest.fail.Exception):
            msg = e.msg or ""
            e.msg = msg if msg.startswith(tag) else tag + msg
        elif e.args and isinstance(e.args[0], str):
            text = explained_once(e.args[0])
            e.args = (text if text.startswith(tag) else tag + text, *e.args[1:])
        elif not e.args:  # a bare ``raise AssertionError``
            e.args = (tag + "assertion failed",)


#: Where the report's ``detail`` is cut: one line a learner reads, not a wall of text.
DETAIL_CHARS = 400
#: A line saying both what was expected and what came instead.
_EXPECTED_GOT = re.compile(r"\bexpected\b.*\bgot\b|\bgot\b.*\bexpected\b", re.IGNORECASE)
_EXPECTED_OR_GOT = re.compile(r"\b(?:expected|got)\b", re.IGNORECASE)
#: What pytest appends to a long explanation (a suite may quote one in its message).
_PYTEST_NOTES = ("...Full output truncated, use '-vv' to show", "Use -v to get more diff")
#: pytest's explanation of an ``assert a == b``: the difference itself.
_PYTEST_DIFF = re.compile(
    r"^(?:At index \d+ diff: .+|(?:Left|Right) contains .+|[\w.]+: .+ != .+)$"
)


def assertion_detail(text: str) -> str:
    """The line of an assertion's text a learner needs besides its first one.

    A failure reads ``stage 1: <invariant>`` (the tag is :func:`tell_once`'s), then the
    steps taken, then what was expected and what came (``=> remaining: expected 0, got
    -1``, a line with both words, or an ``expected X`` line above a ``got Y`` one); pytest
    adds its ``assert 3 == 4`` where the message does not say the values. In that
    order of preference; the first line's own expected/got part if it says it (a narrow
    screen cuts long first lines off before it); "" if nothing says more.
    """
    for note in _PYTEST_NOTES:
        text = text.replace(note, "")
    mismatch = regex_mismatch(text)
    if mismatch:
        return mismatch
    lines = [" ".join(line.split()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return ""
    head, rest = lines[0], lines[1:]
    for line in rest:
        if line.startswith("=>"):
            return line.removeprefix("=>").strip()
    for line in rest:
        if _EXPECTED_GOT.search(line) and not line.startswith(("assert ", "+ ")):
            return line[1:-1] if line.startswith("(") and line.endswith(")") else line
    for i in range(1, len(rest)):
        if rest[i - 1].startswith("expected ") and rest[i].startswith("got "):
            return f"{rest[i - 1]}, {rest[i]}"
    if _EXPECTED_GOT.search(head):
        found = _EXPECTED_OR_GOT.search(head)
        return head[found.start() :] if found else head
    diffs = [line for line in rest if _PYTEST_DIFF.match(line)]
    if head.startswith("assert "):  # a bare assert: pytest's line is the message already
        return diffs[0] if diffs else ""
    compared = next((line for line in rest if line.startswith("assert ")), "")
    if "..." in compared and diffs:  # pytest abbreviated both sides; its diff says more
        return diffs[0]
    return compared


_LIBRARIES = {Path(p).resolve() for p in (sysconfig.get_paths()["stdlib"], sys.prefix)}
_HARNESS = Path(__file__).resolve().parent


def _is_learners(filename: str) -> bool:
    """Whether code in ``filename`` is the learner's or a test's: not the harness, the
    standard library or an installed package, nor generated code."""
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return _HARNESS not in path.parents and not any(lib in path.parents for lib in _LIBRARIES)


def _learners_frame(exc: BaseException) -> str:
    """``stage1.py:12 in add: return a + None``: the innermost frame of the traceback
    that :func:`_is_learners` (the learner's code, else the test), or ""."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if _is_learners(frame.filename):
            line = f": {frame.line.strip()}" if frame.line and frame.line.strip() else ""
            return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}{line}"
    return ""


def running_place(frame: FrameType) -> str:
    """``stage1.py:145 in _decide``: where a running thread is, by the same rule — its
    innermost frame that :func:`_is_learners`, else the innermost one."""
    found: FrameType | None = frame
    while found is not None and not _is_learners(found.f_code.co_filename):
        found = found.f_back
    found = found or frame
    return f"{Path(found.f_code.co_filename).name}:{found.f_lineno} in {found.f_code.co_name}"


def failure_detail(exc: BaseException, kind: str) -> str:
    """The report's ``detail`` of a failure :func:`classify` called ``kind``: for an
    assertion :func:`assertion_detail`; for an error where it was raised (a syntax error:
    the offending line); "" for a stub's ``Todo``. At most DETAIL_CHARS."""
    if kind in ("not_implemented", "timeout"):  # the message is the whole story
        return ""
    focus = exc
    if isinstance(exc, BaseExceptionGroup):  # what classify read the message from
        leaves = [e for e in _walk(exc) if not isinstance(e, BaseExceptionGroup)]
        if leaves:
            focus = leaves[0]
    if kind == "assertion":
        detail = assertion_detail(str(focus))
    elif isinstance(focus, SyntaxError):
        detail = " ".join((focus.text or "").split())
    elif isinstance(focus, BuildError):  # the compiler's first error, its path made short
        detail = shown_path(str(focus).splitlines()[0].split(BUILD_SAYS, 1)[-1])
        return detail  # whole: a cut compiler message hides what to fix
    else:
        where = _learners_frame(focus)
        detail = where if focus is exc else f"{type(focus).__name__}: {focus} — {where}"
    if len(detail) > DETAIL_CHARS:
        detail = detail[: DETAIL_CHARS - 1] + "…"
    return detail


def part_of(item: pytest.Item) -> str:
    """The part of its stage a kata test belongs to: ``core`` or ``extended``."""
    return "core" if item.get_closest_marker("core") else "extended"


def failed_record(
    item: pytest.Item, kind: str, message: str, detail: str = "", rules: list[str] | None = None
) -> dict[str, Any]:
    """A failed test's entry in the ``--kata-report`` JSON, which the ``kata`` command reads:
    the failure's kind, its one line, the line beside it and the rules it checks."""
    return {
        "outcome": "failed",
        "kind": kind,
        "message": message,
        "detail": detail,
        "rules": rules or [],
        "part": part_of(item),
    }


def shown_path(text: str) -> str:
    """``text`` with the working directory's absolute path left off the paths it holds."""
    return text.replace(f"{Path.cwd().as_posix()}/", "")


# --- tracebacks --------------------------------------------------------------------------

_HYPOTHESIS = ("hypothesis", "_hypothesis_pytestplugin", "pluggy", "_pytest")


def is_noise(path: str | Path) -> bool:
    """A traceback frame a learner never needs: hypothesis's engine and this harness."""
    parts = Path(path).parts
    return _HARNESS in Path(path).resolve().parents or any(p in _HYPOTHESIS for p in parts)


# --- where to start ----------------------------------------------------------------------

_STAGE_OF = re.compile(r"\bstage (\d+)\b")
_NAME = re.compile(r"[A-Za-z_][\w]*")


def start_hint(
    missing: list[tuple[str, str]], suite_stage: int, file_for: Callable[[str], str]
) -> str:
    """The line that ends a run whose failures are all "not implemented yet".

    ``missing`` holds ``(part, message)`` of each such failure in test order (part:
    ``core`` or ``extended``). It names the first core thing of the suite's own stage to
    write and its file; when the core stops in an earlier stage it points at that stage,
    or at ``--base=reference``. ``file_for(message)`` is the file in the tested
    implementation that the first message's function lives in
    (``katas/rate_limiter/stage1.py``, or a C file such as ``…/csrc/hotpath.c``).
    """

    def stage_of(message: str) -> int:
        found = _STAGE_OF.search(message)
        return int(found[1]) if found else suite_stage

    count = f"{len(missing)} test{'s' if len(missing) != 1 else ''} not implemented yet"
    core = [m for part, m in missing if part == "core"] or [m for _, m in missing]
    earlier = sorted({stage_of(m) for m in core if stage_of(m) < suite_stage})
    own = [m for m in core if stage_of(m) >= suite_stage]
    if not own:  # the core of this stage cannot start: an earlier stage is missing
        return (
            f"{count}, and they stop in stage {'/'.join(map(str, earlier))}: write that "
            f"first, or add --base=reference to run stage {suite_stage} on the reference's"
        )
    first = own[0].removeprefix(NOT_IMPLEMENTED)
    found = _NAME.match(first)
    thing = found.group(0) if found else first
    part = "core" if any(part == "core" for part, _ in missing) else "extended"
    return f"{count} — start with {thing} ({part}) in {file_for(own[0])}"
