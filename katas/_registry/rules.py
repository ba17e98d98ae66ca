"""The rules of a kata's prompt, by id: what a test declares it checks, and what a failing
test quotes back to the learner.

In a kata's ``README.md`` a rule is a list item that starts with its id, ``§`` and a
short name, inside a stage's section (``## Stage 1 …``)::

    - §fresh **A new key is fresh**: a full bucket, an empty log.

The id is unique in the kata's prompt; the rule's text is the whole list item (its
continuation lines included). A test declares the rules it checks with
``@pytest.mark.rule("fresh", ...)``; the repository's checks require every rule to have
a test and every declared id to be a rule of the test's own stage. Nothing here names a
kata, and nothing here imports pytest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from katas._registry.notes import section

#: ``- §fresh ...``: a rule's list item; the id is lowercase words joined by ``-``.
_ITEM = re.compile(r"^(?P<indent>\s*)[-*]\s+§(?P<id>[a-z0-9]+(?:-[a-z0-9]+)*)\b\s*(?P<text>.*)$")
_ANY_ITEM = re.compile(r"^\s*(?:[-*]|\d+[.)])\s+")
_EMPHASIS = re.compile(r"\*\*(.+?)\*\*|(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])")
ID_PATTERN = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Rule:
    """One rule of a stage: its id and its sentence(s), as plain text."""

    id: str
    text: str

    def quote(self, stage: int) -> str:
        """``rule §fresh (stage 1): A new key is fresh: a full bucket, an empty log.``"""
        return f"rule §{self.id} (stage {stage}): {self.text}"


def plain(markdown: str) -> str:
    """One line of text: emphasis markers and code backticks dropped, white space folded."""
    text = _EMPHASIS.sub(lambda m: m.group(1) or m.group(2), markdown)
    return " ".join(text.replace("`", "").split())


def stage_rules(prompt: str, section_name: str) -> dict[str, Rule]:
    """The rules in the prompt's section ``section_name`` (``Stage 1``), by id, in order.

    ValueError names a repeated id.
    """
    body = section(prompt, section_name)
    if body is None:
        return {}
    found: dict[str, Rule] = {}
    current: tuple[str, str, list[str]] | None = None  # (id, indent, lines)

    def close() -> None:
        if current is not None:
            rule_id, _, lines = current
            found[rule_id] = Rule(rule_id, plain(" ".join(lines)))

    fence = False
    for line in body.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        item = None if fence else _ITEM.match(line)
        if item is not None:
            close()
            if item["id"] in found or (current and current[0] == item["id"]):
                raise ValueError(f"rule §{item['id']} appears twice in section {section_name!r}")
            current = (item["id"], item["indent"], [item["text"]])
            continue
        if current is None:
            continue
        ends = (
            fence
            or not line.strip()
            or line.lstrip().startswith("#")
            or (_ANY_ITEM.match(line) and len(line) - len(line.lstrip()) <= len(current[1]))
        )
        if ends:
            close()
            current = None
        else:
            current[2].append(line.strip())
    close()
    return found


def all_rules(prompt: str, sections: dict[int, str]) -> dict[int, dict[str, Rule]]:
    """Every stage's rules: ``{stage: {id: Rule}}`` for ``{stage: section name}``.

    ValueError if an id is used by two stages.
    """
    by_stage = {stage: stage_rules(prompt, name) for stage, name in sections.items()}
    seen: dict[str, int] = {}
    for stage, rules in by_stage.items():
        for rule_id in rules:
            if rule_id in seen:
                raise ValueError(f"rule §{rule_id} appears in stages {seen[rule_id]} and {stage}")
            seen[rule_id] = stage
    return by_stage


__all__ = ["ID_PATTERN", "Rule", "all_rules", "plain", "stage_rules"]
