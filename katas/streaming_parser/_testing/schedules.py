"""Fault schedules for the replicas: cuts at the bytes a test chooses, and random ones.

A schedule is the list of actions the replicas' next connections get, in order (the
actions are listed in :mod:`.replica`). :func:`cuts_at` turns offsets in the whole
stream into the ``cut:``/``end:`` actions of the connections that resume it, so a test
says where the stream breaks, not how many bytes each connection carries;
:func:`awkward` names the offsets where a break hurts; :func:`schedules` draws a stream
and a schedule of any faults.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from .replica import Block
from .replicas import body_offsets, token_blocks
from .sse import interpret


def cuts_at(blocks: Sequence[Block], offsets: Sequence[int], kind: str = "cut") -> list[str]:
    """A schedule that cuts the stream at each body ``offset`` of the whole stream, in
    order: each connection resumes after the last event the one before completed."""
    body = b"".join(b.raw for b in blocks)
    ends = body_offsets(blocks)
    actions: list[str] = []
    resumed_at = 0  # the body offset the next connection starts at
    for offset in sorted(set(offsets)):
        if offset <= resumed_at:
            continue
        actions.append(f"{kind}:{offset - resumed_at}")
        done = len(interpret(body[:offset]).events)  # one event per block
        resumed_at = ends[done - 1] if done else 0
    return actions


def awkward(blocks: Sequence[Block]) -> list[int]:
    """Body offsets where a cut splits something: inside each block's ``id:`` line, just
    after it, one and two bytes before each block's end (between a CR and its LF) and at
    the end itself."""
    out, start = [], 0
    for block, end in zip(blocks, body_offsets(blocks), strict=True):
        line = block.raw.find(b"id:")
        out += [start + line + 2, start + block.raw.find(b"\n", line) + 1, end - 2, end - 1, end]
        start = end
    return [o for o in out if o > 0]


def at_and_over_a_limit(blocks: Sequence[Block], limit: str, value: int) -> list[Block]:
    """``blocks`` (IDs 1, 2, …) with event 3 exactly at ``limit`` (``max_line_bytes`` or
    ``max_event_bytes``) = ``value`` and event 4 one byte over it, each far within the
    other limit: a data line of ``value`` bytes, then a comment line of ``value`` + 1; or
    an event whose data (its values, one LF each) is ``value`` bytes in short lines, then
    one of ``value`` + 1."""
    if limit == "max_line_bytes":
        line = b"data: " + b"x" * (value - len(b"data: "))
        comment = b":" + b"y" * value  # it adds nothing to an event
        raws = [b"id: 3\n" + line + b"\n\n", b"id: 4\n" + comment + b"\ndata: d\n\n"]
    else:
        short = max(1, min(15, value // 4))
        values = [b"a" * short] * (value // (short + 1))
        rest = value - len(values) * (short + 1)  # the last line's value and its LF
        if rest:
            values.append(b"a" * (rest - 1))
        one_more = [*values[:-1], values[-1] + b"b"]

        def event(n: int, lines: list[bytes]) -> bytes:
            return b"id: %d\n" % n + b"".join(b"data: " + v + b"\n" for v in lines) + b"\n"

        raws = [event(3, values), event(4, one_more)]
    return [*blocks[:2], Block(raws[0], "3"), Block(raws[1], "4"), *blocks[4:]]


#: A stream of token events and the faults its connections get.
Schedule = tuple[list[Block], list[str]]


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    """1 to 8 token events (maybe with a ``retry:``) and up to 8 faults: cuts and clean
    ends anywhere in the body, 5xx and 429 answers, refused connections."""
    count = draw(st.integers(1, 8), label="events")
    blocks = token_blocks(count, retry_ms=draw(st.sampled_from([None, 0, 5])))
    size = body_offsets(blocks)[-1]
    fault = st.one_of(
        st.builds("cut:{}".format, st.integers(0, size)),
        st.builds("end:{}".format, st.integers(0, size)),
        st.sampled_from(["status:500", "status:502", "status:503", "status:429", "refuse"]),
    )
    return blocks, draw(st.lists(fault, max_size=8), label="faults")


__all__ = ["Schedule", "at_and_over_a_limit", "awkward", "cuts_at", "schedules"]
