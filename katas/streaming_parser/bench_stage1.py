"""Stage 1 benchmarks: collected only when this file is named on the command line.

    python -m pytest katas/streaming_parser/bench_stage1.py --impl=solutions --benchmark-only -q

The workload is the spec's: a 20 MB ``text/event-stream`` body of OpenAI-like
``chat.completion.chunk`` events (one long completion: a role chunk, content tokens —
some of them multi-byte UTF-8, sent raw as the API does — a few tool-call fragments,
the finish chunk, the usage-only chunk and ``data: [DONE]``), built once from a seeded
RNG and cut (untimed) into chunks of 4 KiB or 64 bytes, as a socket would hand them
over. One round of a contender parses the whole body, from a fresh parser, and counts
the events; every contender must count the same (the number the body was built with).

The contenders: the implementation under test (``--impl``), the reference, and
httpx-sse (from the ``[bench]`` extra) run as its ``iter_sse`` runs on a response:
each chunk through an incremental UTF-8 decoder (httpx's ``iter_text``), the text
through ``SSELineDecoder``, each line, its LF stripped, through ``SSEDecoder``.
Each group runs them in turn within every round (each round starting with the next
one), so that drift on a shared machine hits them alike, and reports the ratios of each
one's best round in ``extra_info`` (``--benchmark-json``, which ``kata bench`` reads)
and on stdout (printed even without ``-s``). The spec's targets — informational,
benchmarks never fail CI:

- >= 1.2x httpx-sse's MB/s at 4 KiB chunks and >= 1.5x at 64-byte chunks, in the same
  run (the spec measured httpx-sse at ~125 and ~52 MB/s).
- Linear time: one 4 MiB ``data:`` line fed in 64-byte chunks takes <= 8x the time of
  a 1 MiB line (a buffer re-scanned or copied on every chunk takes ~16x, and tens of
  seconds a round at 4 MiB); both parsers are built with room for the 4 MiB line.
  If the implementation takes over a second on the 4 MiB line (tried once, untimed,
  first), the benchmark runs a single round after its warm-up instead of fifteen.

Measured here (the reference as ``--impl``; 2 shared cores, load ~2-3 from other
jobs): 20 MB, 76 081 events. At 4 KiB chunks ~250-320 MB/s against httpx-sse's
~150-205 (1.44-1.72x); at 64 bytes ~110-120 MB/s against ~42-75 (1.54-1.75x); the
4 MiB line ~3.4-4.1x the 1 MiB one (~13 ms against ~3.3), httpx-sse ~4.5x. The
reference against itself spans 0.89-1.10 (once 0.59 at 64 bytes, a run the machine's
other jobs hit unevenly): the noise to read every other ratio with.
"""

from __future__ import annotations

import codecs
import functools
import json
import math
import random
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from katas._harness.bench import Contender, interleaved, report, say
from katas._registry import impl as _impl

pytestmark = [pytest.mark.stage(1)]

httpx_sse = pytest.importorskip(
    "httpx_sse", reason="the anchors come with `pip install -e .[bench]`"
)
from httpx_sse._decoders import SSEDecoder, SSELineDecoder  # noqa: E402

STREAM_BYTES = 20_000_000  # the body's size (at least): the spec's 20 MB
SEED = 20_240_601
MB = 1_000_000
KIB, MIB = 1 << 10, 1 << 20
ROUNDS_4KIB = 7  # a round parses the 20 MB three times: ~0.3 s at 4 KiB here
ROUNDS_64B = 5  # ~1.2 s a round at 64 bytes
ROUNDS_LINE = 15  # a round takes ~0.1 s here; a quadratic parser's, tens of seconds
SLOW_S = 1.0  # a 4 MiB line that takes longer: one round only (see the test)
#: Room for the long line (and its event's data) in both its sizes.
LINE_LIMITS = {"max_line_bytes": 8 * MIB, "max_event_bytes": 16 * MIB}

#: Content tokens as a tokenizer cuts text: mostly short ASCII with a leading space,
#: some punctuation, some multi-byte UTF-8 (2, 3 and 4 bytes) that chunking splits.
TOKENS = (
    " the", " a", " of", " to", " and", " in", " is", " that", " for", " it", " as",
    " model", " token", " stream", " parser", " event", " data", " line", " chunk",
    " server", " client", " request", " response", " latency", " throughput", " cache",
    ",", ".", ":", ";", " (", ")", "\n", "\n\n", " -", " \"", "\"", "'s", "ing", "ed",
    " café", " naïve", " Größe", " déjà", "—", "…", " “", "”", " €", " 東京", " 模型",
    " данные", " λ", " 🙂", " 🚀", "✓", " 0", " 1", " 42", " 3.14", " x", " y", "\t",
)  # fmt: skip


def _chunk_json(chunk_id: str, created: int, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": "gpt-4o-2024-08-06",
        "system_fingerprint": "fp_5050236cbd",
        "choices": [choice],
    }


@functools.cache
def stream() -> tuple[bytes, int]:
    """``(body, events)``: the spec's 20 MB stream and the number of events it holds."""
    rng = random.Random(SEED)
    chunk_id = "chatcmpl-" + "".join(rng.choices("ABCDEFGHabcdefgh0123456789", k=29))
    created = 1_727_346_172
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

    def line(payload: dict[str, Any]) -> bytes:
        return b"data: " + dumps(payload).encode() + b"\n\n"

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    parts = [line(_chunk_json(chunk_id, created, choice({"role": "assistant", "content": ""})))]
    size, calls = len(parts[0]), 0
    while size < STREAM_BYTES:
        if rng.random() < 0.002:  # now and then, a tool call in pieces
            head = {"index": calls, "id": f"call_{calls:06d}", "type": "function"}
            pieces = [{**head, "function": {"name": "lookup", "arguments": ""}}]
            pieces += [
                {"index": calls, "function": {"arguments": piece}}
                for piece in ('{"q', 'uery": "', rng.choice(TOKENS).strip() or "x", '"}')
            ]
            calls += 1
            new = [
                line(_chunk_json(chunk_id, created, choice({"tool_calls": [p]}))) for p in pieces
            ]
        else:
            token = rng.choice(TOKENS)
            new = [line(_chunk_json(chunk_id, created, choice({"content": token})))]
        parts += new
        size += sum(map(len, new))
    usage = {"prompt_tokens": 57, "completion_tokens": len(parts), "total_tokens": 57 + len(parts)}
    parts.append(line(_chunk_json(chunk_id, created, choice({}, "stop"))))
    parts.append(
        line({**_chunk_json(chunk_id, created, choice({})), "choices": [], "usage": usage})
    )
    parts.append(b"data: [DONE]\n\n")
    return b"".join(parts), len(parts)


@functools.cache
def chunked(size: int) -> list[bytes]:
    """The stream cut into chunks of ``size`` bytes (the last one shorter)."""
    body, _ = stream()
    return [body[i : i + size] for i in range(0, len(body), size)]


@functools.cache
def long_line(size: int) -> list[bytes]:
    """One ``data:`` line of ``size`` bytes (its LF included), then the blank line that
    dispatches it (one event), in 64-byte chunks."""
    head = b"data: "
    body = head + b"x" * (size - len(head) - 1) + b"\n\n"
    return [body[i : i + 64] for i in range(0, len(body), 64)]


def ours(
    stage: ModuleType, chunks: list[bytes], counts: dict[str, int], name: str, **limits: int
) -> Contender:
    """A parser of this kata: a fresh one each round, fed every chunk, then closed."""
    new = functools.partial(stage.EventStreamParser, **limits)

    def run() -> None:
        parser = new()
        feed: Callable[[bytes], list[Any]] = parser.feed
        n = 0
        for chunk in chunks:
            n += len(feed(chunk))
        counts[name] = n + len(parser.close())

    return Contender(run, sum(map(len, chunks)))


def httpx_sse_contender(chunks: list[bytes], counts: dict[str, int], name: str) -> Contender:
    """httpx-sse as ``EventSource.iter_sse`` runs: httpx's ``iter_text`` (an incremental
    UTF-8 decoder, errors replaced, empty texts dropped), then ``SSELineDecoder`` and
    ``SSEDecoder`` on each line stripped of its LF."""
    utf8 = codecs.getincrementaldecoder("utf-8")

    def run() -> None:
        text_of = utf8(errors="replace").decode
        lines_of = SSELineDecoder()
        decode = SSEDecoder().decode
        n = 0
        for chunk in chunks:
            text = text_of(chunk)
            if text:
                for line in lines_of.decode(text):
                    if decode(line.rstrip("\n")) is not None:
                        n += 1
        tail = text_of(b"", True)
        for line in lines_of.decode(tail) if tail else []:
            n += decode(line.rstrip("\n")) is not None
        for line in lines_of.flush():
            n += decode(line.rstrip("\n")) is not None
        counts[name] = n

    return Contender(run, sum(map(len, chunks)))


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    """The reference stage 1, whatever ``--impl`` says."""
    return _impl.resolve("solutions").stage("streaming_parser", 1)


def agree(counts: dict[str, int], expected: int) -> None:
    """Every contender counted ``expected`` events (checked under --benchmark-disable too)."""
    assert counts == dict.fromkeys(counts, expected), (
        f"the contenders disagree on the events (expected {expected}): {counts}"
    )


def throughput(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    capsys: pytest.CaptureFixture[str],
    chunk: int,
    rounds: int,
    target: str,
) -> None:
    chunks, (body, events) = chunked(chunk), stream()
    benchmark.group = (
        f"stage1 {len(body) / MB:.0f} MB of chat chunks, {chunk} B chunks (interleaved)"
    )
    counts: dict[str, int] = {}
    contenders = {
        "EventStreamParser": ours(stage_module, chunks, counts, "EventStreamParser"),
        "reference": ours(reference, chunks, counts, "reference"),
        "httpx-sse": httpx_sse_contender(chunks, counts, "httpx-sse"),
    }
    per_byte = interleaved(benchmark, contenders, rounds=rounds)
    agree(counts, events)
    mine = per_byte["EventStreamParser"]
    if math.isnan(mine):  # --benchmark-disable: nothing was measured
        return
    say(
        capsys,
        "MB/s: "
        + ", ".join(f"{name} {1 / s / MB:.1f}" for name, s in per_byte.items())
        + f"   ({events:,} events each, agree)",
    )
    report(benchmark, capsys, "speedup_vs_httpx_sse", per_byte["httpx-sse"] / mine, target)
    report(benchmark, capsys, "speed_vs_reference", per_byte["reference"] / mine, "~1")


@pytest.mark.core
def test_bench_stage1_throughput_4k_chunks(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    capsys: pytest.CaptureFixture[str],
) -> None:
    throughput(benchmark, stage_module, reference, capsys, 4 * KIB, ROUNDS_4KIB, ">= 1.2")


@pytest.mark.core
def test_bench_stage1_throughput_64b_chunks(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    capsys: pytest.CaptureFixture[str],
) -> None:
    throughput(benchmark, stage_module, reference, capsys, 64, ROUNDS_64B, ">= 1.5")


@pytest.mark.extended
def test_bench_stage1_long_line_1mib_4mib(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = "stage1 one data: line of 1 MiB and of 4 MiB, 64 B chunks (interleaved)"
    counts: dict[str, int] = {}
    contenders: dict[str, Contender] = {}
    for label, stage in (("EventStreamParser", stage_module), ("reference", reference)):
        for mib in (1, 4):
            name = f"{label} {mib} MiB"
            contenders[name] = ours(stage, long_line(mib * MIB), counts, name, **LINE_LIMITS)
    for mib in (1, 4):
        name = f"httpx-sse {mib} MiB"
        contenders[name] = httpx_sse_contender(long_line(mib * MIB), counts, name)
    # One untimed try of the 4 MiB line first: a quadratic parser takes tens of seconds
    # on it, and then a single round (after the warm-up) tells enough.
    start = time.perf_counter()
    contenders["EventStreamParser 4 MiB"].run()
    slow = time.perf_counter() - start > SLOW_S
    if slow:
        say(capsys, f"the 4 MiB line took over {SLOW_S:g} s: one round only")
    per_byte = interleaved(benchmark, contenders, rounds=1 if slow else ROUNDS_LINE)
    agree(counts, 1)
    if math.isnan(per_byte["EventStreamParser 1 MiB"]):
        return
    seconds = {name: s * contenders[name].ops for name, s in per_byte.items()}
    say(capsys, "ms: " + ", ".join(f"{name} {s * 1e3:.1f}" for name, s in seconds.items()))

    def growth(label: str) -> float:
        return seconds[f"{label} 4 MiB"] / seconds[f"{label} 1 MiB"]

    report(benchmark, capsys, "time_4mib_over_1mib", growth("EventStreamParser"), "<= 8")
    report(benchmark, capsys, "reference_time_growth", growth("reference"), "informational")
    report(benchmark, capsys, "httpx_sse_time_growth", growth("httpx-sse"), "informational")
