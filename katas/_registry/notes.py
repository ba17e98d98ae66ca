"""Reading a kata's HINTS.md and INTERVIEWER.md by their headings.

Both files have one ``## <stage section>`` per stage (the ``section`` of kata.toml, e.g.
``## Stage 1`` or ``## Stage 1 — Single-threaded``). In HINTS.md each ``### …`` heading
inside it is one hint, in order. In INTERVIEWER.md the stage section holds ``###``
parts (``Read aloud``, ``Clarifying questions …``, ``Rubric`` …), and the file-level
``## The follow-up ladder`` section is shown with every stage. Nothing here names a kata.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FENCE = re.compile(r"^\s*(```|~~~)")


def sections(text: str, level: int) -> list[tuple[str | None, str]]:
    """Split ``text`` at headings of ``level`` or above (outside code fences).

    Returns ``(heading or None, chunk)``; each chunk starts with its heading line.
    """
    heading_re = re.compile(rf"^(#{{1,{level}}})\s+(.*?)\s*#*\s*$")
    chunks: list[tuple[str | None, list[str]]] = [(None, [])]
    fence: str | None = None
    for line in text.splitlines(keepends=True):
        marker = _FENCE.match(line)
        if marker:
            fence = None if fence == marker.group(1) else fence or marker.group(1)
        heading = heading_re.match(line) if fence is None else None
        if heading:
            chunks.append((heading.group(2), [line]))
        else:
            chunks[-1][1].append(line)
    return [(title, "".join(lines)) for title, lines in chunks]


def is_section(heading: str | None, name: str) -> bool:
    """``Stage 1`` and ``Stage 1 — Single-threaded`` are section "Stage 1"; ``Stage 10`` is not."""
    if heading is None or not heading.lower().startswith(name.lower()):
        return False
    rest = heading[len(name) :]
    return not rest or not rest[0].isalnum()


def section(text: str, name: str) -> str | None:
    """The body of the level-2 section ``name`` (without its heading), or None."""
    for heading, chunk in sections(text, 2):
        if chunk.startswith("##") and not chunk.startswith("###") and is_section(heading, name):
            return chunk.split("\n", 1)[1] if "\n" in chunk else ""
    return None


@dataclass(frozen=True)
class Part:
    """A ``###`` part of a section: its heading and its Markdown body."""

    title: str
    body: str


def parts(body: str) -> list[Part]:
    """The ``###`` parts of a section body; text before the first one is an untitled part."""
    found: list[Part] = []
    for heading, chunk in sections(body, 3):
        text = chunk.split("\n", 1)[1] if heading is not None and "\n" in chunk else chunk
        if heading is None:
            if text.strip():
                found.append(Part("", text.strip()))
        else:
            found.append(Part(heading, text.strip()))
    return found


def hints(text: str, stage_section: str) -> list[Part] | None:
    """The hints of one stage in order, or None if HINTS.md has no such section."""
    body = section(text, stage_section)
    if body is None:
        return None
    found = [p for p in parts(body) if p.title]
    if not found and body.strip():  # a section without ### headings is one hint
        found = [Part("Hint 1", body.strip())]
    return found


# --- INTERVIEWER.md ------------------------------------------------------------------------

LADDER = "The follow-up ladder"
RUBRIC = "Rubric"
CLARIFYING = "Clarifying questions"
READ_ALOUD = "Read aloud"
CURVEBALLS = "Curveballs"
#: How a clarifying question is marked key (its answer changes the code): at its end.
_KEY = re.compile(r"\s*\*\(key\)\*\s*$")
#: Other words a candidate asks it in, hidden from the rendered table: ``<!-- also: a; b -->``
#: at the end of the question's cell (the interview mode matches questions on them too).
_ALSO = re.compile(r"\s*<!--\s*also:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class InterviewerNotes:
    """The stage's parts of INTERVIEWER.md and the file-wide follow-up ladder."""

    stage_parts: list[Part]
    ladder: str | None

    def part(self, title: str) -> Part | None:
        return next((p for p in self.stage_parts if is_section(p.title, title)), None)


def interviewer_notes(text: str, stage_section: str) -> InterviewerNotes | None:
    body = section(text, stage_section)
    if body is None:
        return None
    return InterviewerNotes(parts(body), section(text, LADDER))


def table_rows(markdown: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``markdown`` (header and rule dropped)."""
    rows: list[list[str]] = []
    in_table = False
    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("|") and stripped.endswith("|"):
            cells = [c.strip() for c in stripped.strip("|").split("|")]
            in_table = True
            if all(re.fullmatch(r":?-{2,}:?", c) for c in cells if c):
                continue
            rows.append(cells)
        elif in_table:
            break
    return rows[1:]  # the first row is the header


@dataclass(frozen=True)
class Question:
    """A clarifying question a strong candidate asks, the answer to give, whether it is
    key (its answer changes the code), and other ways of asking it (``also``)."""

    text: str
    answer: str
    key: bool
    also: tuple[str, ...] = ()


def _question(cell: str, answer: str) -> Question:
    also = _ALSO.search(cell)
    cell = _ALSO.sub("", cell)
    words = tuple(w.strip() for w in also.group(1).split(";") if w.strip()) if also else ()
    return Question(_KEY.sub("", cell), answer, bool(_KEY.search(cell)), words)


def clarifying_questions(text: str, stage_section: str) -> list[Question]:
    """The stage's ``### Clarifying questions …`` table of INTERVIEWER.md, in order."""
    notes = interviewer_notes(text, stage_section)
    part = notes.part(CLARIFYING) if notes is not None else None
    if part is None:
        return []
    return [_question(row[0], row[1]) for row in table_rows(part.body) if len(row) >= 2 and row[0]]


def stage_part(text: str, stage_section: str, title: str) -> str:
    """The body of one ``###`` part of the stage's section of INTERVIEWER.md ("" if none)."""
    notes = interviewer_notes(text, stage_section)
    part = notes.part(title) if notes is not None else None
    return part.body if part is not None else ""


def curveballs(text: str, stage_section: str) -> list[str]:
    """The stage's curveballs, one Markdown bullet each (``- **Fault — …** …``)."""
    body = stage_part(text, stage_section, CURVEBALLS)
    items = re.split(r"\n(?=- )", "\n" + body.strip())
    return [item.strip() for item in items if item.strip().startswith("- ")]


DEFAULT_AXES = ("Problem solving", "Correctness & complexity", "Communication", "Code quality")


def rubric_axes(text: str, stage_section: str) -> list[tuple[str, list[str]]]:
    """``(axis, [strong, acceptable, weak …])`` from the stage's ``### Rubric`` table.

    Falls back to the first rubric in the file, then to four generic axes.
    """
    notes = interviewer_notes(text, stage_section)
    candidates: list[str] = []
    if notes is not None and (rubric := notes.part(RUBRIC)) is not None:
        candidates.append(rubric.body)
    for heading, chunk in sections(text, 3):
        if heading is not None and is_section(heading, RUBRIC):
            candidates.append(chunk)
    for body in candidates:
        rows = [r for r in table_rows(body) if r and r[0]]
        if rows:
            return [(row[0], row[1:]) for row in rows]
    return [(axis, []) for axis in DEFAULT_AXES]


__all__ = [
    "InterviewerNotes",
    "Part",
    "Question",
    "clarifying_questions",
    "curveballs",
    "hints",
    "interviewer_notes",
    "is_section",
    "parts",
    "rubric_axes",
    "section",
    "sections",
    "stage_part",
    "table_rows",
]
