"""The recorded OpenAI streams (``fixtures/openai-streams/``) and what each assembles to."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from katas.streaming_parser.api import ChatCompletion

FIXTURES = Path(__file__).parent / "fixtures" / "openai-streams"


@dataclass(frozen=True)
class Recorded:
    """One recorded body and the final state its README says a correct assembler reaches."""

    name: str
    body: bytes
    expected: dict[str, Any]


def recorded() -> list[Recorded]:
    expected = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))
    return [Recorded(name, (FIXTURES / name).read_bytes(), want) for name, want in expected.items()]


def summary(result: ChatCompletion) -> dict[str, Any]:
    """``result`` in the shape of ``expected.json`` (tool-call arguments parsed as JSON)."""
    return {
        "done": result.done,
        "total_tokens": result.usage.total_tokens if result.usage else None,
        "choices": [
            {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "content": c.content,
                "refusal": c.refusal,
                "tool_calls": [
                    {"id": t.id, "name": t.name, "arguments": _json_or_text(t.arguments)}
                    for t in c.tool_calls
                ],
            }
            for c in result.choices
        ],
    }


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # shown as it is: the assertion says what was expected


__all__ = ["FIXTURES", "Recorded", "recorded", "summary"]
