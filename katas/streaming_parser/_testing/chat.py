"""Writing ``chat.completion.chunk`` events for the assembler tests, and folding them.

A chunk is built the way an OpenAI-style server sends it — :func:`chunk` of
:func:`delta` s, a delta's tool calls by :func:`call` — so a test reads as the stream it
feeds; :func:`assemble` folds events with a new assembler of the stage under test.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from katas._harness.under_test import stage
from katas.streaming_parser.api import ChatAssembler, ChatCompletion, ServerSentEvent


class Null:
    """JSON ``null`` for a field :func:`chunk` would otherwise leave out."""

    def __repr__(self) -> str:
        return "NULL"


#: ``chunk(..., usage=NULL)``: ``"usage": null``, as a server streaming with
#: ``include_usage`` sends it on every chunk but the usage-only one.
NULL = Null()


def chunk(
    *choices: dict[str, object], usage: dict[str, int] | Null | None = None
) -> ServerSentEvent:
    """One ``chat.completion.chunk`` event (id ``c1``, model ``m``) of these choices; its
    ``usage`` left out when None, sent as ``null`` when :data:`NULL`."""
    body: dict[str, object] = {"id": "c1", "model": "m", "choices": list(choices)}
    if usage is not None:
        body["usage"] = None if isinstance(usage, Null) else usage
    return ServerSentEvent(data=json.dumps(body))


def delta(index: int, finish: str | None = None, **fields: object) -> dict[str, object]:
    """The choice ``index`` of a chunk: its delta's ``fields`` and its ``finish_reason``."""
    return {"index": index, "delta": fields, "finish_reason": finish}


def call(
    index: int, arguments: str, call_id: str | None = None, name: str | None = None
) -> dict[str, object]:
    """A piece of the tool call ``index``: its ``arguments`` fragment, and on the first
    piece its id and function name."""
    function: dict[str, object] = {"arguments": arguments}
    if name is not None:
        function["name"] = name
    out: dict[str, object] = {"index": index, "function": function}
    if call_id is not None:
        out |= {"id": call_id, "type": "function"}
    return out


def new_assembler() -> ChatAssembler:
    """The stage's ``ChatStreamAssembler``."""
    assembler: ChatAssembler = stage().ChatStreamAssembler()
    return assembler


def assemble(events: Sequence[ServerSentEvent]) -> ChatCompletion:
    """What a new assembler folds ``events`` into."""
    assembler = new_assembler()
    for event in events:
        assembler.add(event)
    return assembler.result()


__all__ = ["NULL", "Null", "assemble", "call", "chunk", "delta", "new_assembler"]
