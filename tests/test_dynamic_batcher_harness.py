"""The dynamic batcher's harness checks itself: the fake model's KV reads, the unbatched
oracle, the workloads, the simulator's clock and metrics, and the charts."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import httpx
import pytest
from _support import committed_stubs

from katas._registry import impl
from katas._registry.impl import REPO_ROOT
from katas._runtime.clock import NS_PER_MS, NS_PER_S, NS_PER_US, ManualClock
from katas.dynamic_batcher._testing import (
    engine,
    fleet_charts,
    fleet_pictures,
    pictures,
    replica,
    workload,
)
from katas.dynamic_batcher._testing.http_link import HttpLink, probe_health
from katas.dynamic_batcher._testing.model import (
    DECODE_SEQ_NS,
    PREFILL_TOKEN_NS,
    STEP_OVERHEAD_NS,
    FakeModel,
    reference_generation,
    reference_outputs,
    step_cost_ns,
)
from katas.dynamic_batcher._testing.replica_client import stream_completion
from katas.dynamic_batcher._testing.simulate import (
    Report,
    distribution_chart,
    occupancy_chart,
    save_png,
    simulate,
)
from katas.dynamic_batcher.api import (
    FinishReason,
    Overloaded,
    ReplicaError,
    ReplicaLink,
    Request,
    RequestMetrics,
    SeqSlice,
    StepOutput,
)

VOCAB, SEED, BS = 50_000, 7, 4
PROMPT = (11, 12, 13, 14, 15, 16)  # a block and a half at BS = 4


def model(num_blocks: int = 8, *, seed: int = SEED, shared_reads: bool = False) -> FakeModel:
    return FakeModel(VOCAB, seed, num_blocks, BS, shared_reads=shared_reads)


def compute(
    m: FakeModel, rid: str, tokens: tuple[int, ...], table: tuple[int, ...], start: int = 0
) -> int:
    """One ``last`` slice alone; the token it samples."""
    token = m.forward([SeqSlice(rid, tokens, start, table)])[rid]
    assert token is not None
    return token


def prefill(m: FakeModel, rid: str, prompt: tuple[int, ...], table: tuple[int, ...]) -> int:
    return compute(m, rid, prompt, table)


# -- the model ----------------------------------------------------------------------------
def test_the_model_is_deterministic_for_a_seed() -> None:
    def run(m: FakeModel) -> dict[str, int | None]:
        return m.forward(
            [SeqSlice("a", PROMPT, 0, (0, 1)), SeqSlice("b", (9,), 0, (2,)),
             SeqSlice("c", (1, 2, 3), 0, (3,), last=False)]
        )  # fmt: skip

    first = run(model())
    assert first == run(model())
    assert first["c"] is None  # a chunk that is not last samples nothing
    assert run(model(seed=SEED + 1)) != first


def test_the_next_token_ignores_block_ids_and_chunking() -> None:
    whole = prefill(model(), "a", PROMPT, (0, 1))
    m = model()
    assert m.forward([SeqSlice("a", PROMPT[:3], 0, (5, 2), last=False)]) == {"a": None}
    assert m.forward([SeqSlice("a", PROMPT[3:], 3, (5, 2))]) == {"a": whole}


def test_a_wrong_block_table_changes_the_next_token() -> None:
    m = model()
    first = prefill(m, "a", PROMPT, (0, 1))
    prefill(m, "b", (21, 22, 23, 24, 25, 26), (2, 3))  # another request's KV in block 3
    right = m.forward([SeqSlice("a", (first,), 6, (0, 1))])["a"]
    wrong = model()
    prefill(wrong, "a", PROMPT, (0, 1))
    prefill(wrong, "b", (21, 22, 23, 24, 25, 26), (2, 3))
    # a's table now names block 3 (b's) for positions 4..7: its tail is read from there
    assert wrong.forward([SeqSlice("a", (first,), 6, (0, 3))])["a"] != right


def test_a_block_overwritten_under_a_request_changes_its_next_token() -> None:
    clean = model()
    first = prefill(clean, "a", PROMPT, (0, 1))
    expected = clean.forward([SeqSlice("a", (first,), 6, (0, 1))])["a"]
    m = model()
    prefill(m, "a", PROMPT, (0, 1))
    writes = m.writes(0)
    m.forward([SeqSlice("b", (99,), 0, (0,))])  # b reuses block 0 while a still holds it
    assert m.writes(0) == writes + 1 and m.block_tokens(0)[0] == 99
    assert m.forward([SeqSlice("a", (first,), 6, (0, 1))])["a"] != expected


def test_the_chain_hash_of_a_full_block_is_computed_once() -> None:
    m = model()
    token = prefill(m, "a", (1, 2, 3, 4, 5, 6, 7, 8), (0, 1, 2))
    assert m.hashed_blocks == 2
    for pos in range(8, 12):  # four decodes: the last one fills block 2
        token = compute(m, "a", (token,), (0, 1, 2), start=pos)
    assert m.hashed_blocks == 3


def test_forward_records_prefill_tokens_and_decodes() -> None:
    m = model()
    first = prefill(m, "a", PROMPT, (0, 1))
    m.forward([SeqSlice("a", (first,), 6, (0, 1)), SeqSlice("b", (1, 2, 3), 0, (2,), last=False)])
    assert [(r.prefill_tokens, r.decode_seqs, r.sampled) for r in m.steps] == [(6, 0, 1), (3, 1, 1)]
    assert (m.forward_calls, m.prefill_tokens, m.decode_seqs) == (2, 9, 1)


@pytest.mark.parametrize(
    ("slices", "message"),
    [
        ([SeqSlice("a", PROMPT, 0, (0,))], r"'a' writes positions 0\.\.5.*position 4 has no block"),
        ([SeqSlice("a", (1,), 0, (8,))], r"'a': block_table\[0\] = 8 .*not a block of the pool"),
        ([SeqSlice("a", PROMPT, 0, (1, 1))], r"'a': block 1 is in its block table twice"),
        (
            [SeqSlice("a", PROMPT, 0, (0, 1)), SeqSlice("b", (1,), 0, (1,))],
            r"block 1 is owned by two requests .*'a' \(its positions 4\.\.7\) and 'b' "
            r"\(its positions 0\.\.3\)",
        ),
        ([SeqSlice("a", (1,), 0, (0,)), SeqSlice("a", (2,), 1, (0,))], r"'a' has two slices"),
        ([SeqSlice("a", (), 0, (0,))], r"'a': an empty slice"),
        ([SeqSlice("a", (2,), 1, (0,))], r"'a' reads position 0 \(block 0, slot 0\).*never"),
    ],
)
def test_forward_rejects_a_broken_step_and_names_the_request(
    slices: list[SeqSlice], message: str
) -> None:
    m = model()
    with pytest.raises(AssertionError, match=message):
        m.forward(slices)


def test_a_rejected_step_writes_nothing() -> None:
    m = model()
    with pytest.raises(AssertionError):
        m.forward([SeqSlice("a", (1,), 0, (0,)), SeqSlice("b", (2,), 0, (0,))])
    assert m.block_tokens(0) == (None,) * BS and m.forward_calls == 0


def test_shared_reads_allow_a_common_prefix_block_but_not_writing_it() -> None:
    m = model(shared_reads=True)
    prefill(m, "a", (1, 2, 3, 4, 5), (0, 1))
    m.forward([SeqSlice("b", (1, 2, 3, 4), 0, (2,))])  # b's own copy, to compare
    shared = m.forward([SeqSlice("a", (9,), 5, (0, 1)), SeqSlice("c", (7,), 4, (0, 3))])
    assert shared["c"] == m.forward([SeqSlice("b", (7,), 4, (2, 4))])["b"]
    with pytest.raises(AssertionError, match=r"block 0 is owned by two requests"):
        m.forward([SeqSlice("a", (9,), 1, (0, 1)), SeqSlice("c", (8,), 5, (0, 3))])


# -- the oracle ---------------------------------------------------------------------------
def test_reference_generation_is_one_request_stepped_alone() -> None:
    ref = reference_generation(PROMPT, 5, vocab_size=VOCAB, seed=SEED, block_size=BS)
    assert ref == reference_generation(PROMPT, 5, vocab_size=VOCAB, seed=SEED, block_size=BS)
    assert len(ref) == 5
    # the same generation by hand, in chunks, through other blocks
    m = model()
    assert m.forward([SeqSlice("x", PROMPT[:5], 0, (7, 3), last=False)]) == {"x": None}
    got = [compute(m, "x", PROMPT[5:], (7, 3), start=5)]
    for pos in range(6, 10):
        got.append(compute(m, "x", (got[-1],), (7, 3, 0), start=pos))
    assert tuple(got) == ref


def test_reference_generation_ends_with_the_first_stop_token() -> None:
    full = reference_generation(PROMPT, 12, vocab_size=VOCAB, seed=SEED, block_size=BS)
    stop = full[3]
    cut = full[: full.index(stop) + 1]
    assert (
        reference_generation(PROMPT, 12, {stop}, vocab_size=VOCAB, seed=SEED, block_size=BS) == cut
    )
    r = Request("r", PROMPT, 12, stop_tokens=frozenset({stop}))
    assert reference_outputs([r], model()) == {"r": cut}


# -- workloads ----------------------------------------------------------------------------
def _workloads(seed: int) -> dict[str, list[Request]]:
    return {
        "exponential": workload.exponential(40, mean_output=32, seed=seed, max_output=100),
        "poisson": workload.exponential(40, mean_output=32, seed=seed, rate_per_s=50.0),
        "long_tailed": workload.long_tailed(40, median_output=16, sigma=1.5, seed=seed,
                                            max_output=100),
        "bursts": workload.bursts(4, 10, gap_ns=NS_PER_S, mean_output=32, seed=seed),
        "shared_prefixes": workload.shared_prefixes(40, n_prefixes=3, prefix_len=8,
                                                    mean_output=32, seed=seed),
    }  # fmt: skip


def test_workloads_are_deterministic_per_seed_and_bounded() -> None:
    first, again, other = _workloads(1), _workloads(1), _workloads(2)
    for name, requests in first.items():
        assert requests == again[name], name
        assert requests != other[name], name
        assert len({r.rid for r in requests}) == len(requests) == 40, name
        arrivals = [r.arrival_ns for r in requests]
        assert arrivals == sorted(arrivals) and arrivals[0] == 0, name
        assert all(1 <= r.max_new_tokens <= workload.DEFAULT_MAX_OUTPUT for r in requests)
        assert all(0 <= t < workload.DEFAULT_VOCAB for r in requests for t in r.prompt)
    lo, hi = workload.DEFAULT_PROMPT_LEN
    assert all(lo <= len(r.prompt) <= hi for r in first["exponential"])
    assert all(r.max_new_tokens <= 100 for r in first["exponential"] + first["long_tailed"])
    assert set(r.arrival_ns for r in first["exponential"]) == {0}
    assert len(set(r.arrival_ns for r in first["poisson"])) == 40
    assert sorted(set(r.arrival_ns for r in first["bursts"])) == [k * NS_PER_S for k in range(4)]
    prefixes = {r.prompt[:8] for r in first["shared_prefixes"]}
    assert len(prefixes) <= 3 and all(9 <= len(r.prompt) <= 40 for r in first["shared_prefixes"])


# -- the simulator ------------------------------------------------------------------------
class SerialBatcher:
    """One request at a time: its whole prompt in one step, then one token per step."""

    def __init__(self, m: FakeModel) -> None:
        self.model = m
        self.queue: deque[Request] = deque()
        self.current: Request | None = None
        self.out: list[int] = []
        self.first_ns: int | None = None
        self.done: list[RequestMetrics] = []

    def submit(self, request: Request) -> None:
        self.queue.append(request)

    def abort(self, rid: str) -> None:
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        return self.current is not None or bool(self.queue)

    def metrics(self) -> list[RequestMetrics]:
        return list(self.done)

    def step(self, now_ns: int) -> StepOutput:
        if self.current is None:
            self.current, self.out, self.first_ns = self.queue.popleft(), [], None
        r = self.current
        piece = r.prompt if not self.out else (self.out[-1],)
        start = 0 if not self.out else len(r.prompt) + len(self.out) - 1
        table = tuple(range(self.model.num_blocks))
        token = self.model.forward([SeqSlice(r.rid, piece, start, table)])[r.rid]
        assert token is not None
        self.out.append(token)
        self.first_ns = now_ns if self.first_ns is None else self.first_ns
        finished: dict[str, FinishReason] = {}
        if len(self.out) == r.max_new_tokens:
            finished[r.rid] = "length"
            self.done.append(
                RequestMetrics(r.rid, r.arrival_ns, self.first_ns, now_ns, len(self.out),
                               "length", 0)
            )  # fmt: skip
            self.current = None
        return StepOutput(now_ns, {r.rid: len(piece)}, {r.rid: (token,)}, finished)


A = Request("a", (1, 2, 3, 4), 3)
B = Request("b", (5, 6), 2, arrival_ns=1 * NS_PER_MS)


def test_step_cost_is_overhead_plus_prefill_tokens_plus_decodes() -> None:
    assert (STEP_OVERHEAD_NS, PREFILL_TOKEN_NS, DECODE_SEQ_NS) == (
        5 * NS_PER_MS, 100 * NS_PER_US, 50 * NS_PER_US,
    )  # fmt: skip
    assert step_cost_ns(0, 0) == 5 * NS_PER_MS
    assert step_cost_ns(100, 10) == 5 * NS_PER_MS + 10 * NS_PER_MS + 500 * NS_PER_US


def test_simulate_two_requests_exactly() -> None:
    m = model(4)
    report = simulate(SerialBatcher(m), [B, A], slots=1)
    # a: prefill 4 at 0 (5.4 ms), decodes at 5.4 and 10.45 ms (5.05 ms each);
    # b (arrived at 1 ms): prefill 2 at 15.5 ms (5.2 ms), decode at 20.7 ms
    starts = [0, 5_400_000, 10_450_000, 15_500_000, 20_700_000]
    assert [s.now_ns for s in report.series] == starts
    costs = [5_400_000, 5_050_000, 5_050_000, 5_200_000, 5_050_000]
    assert [s.cost_ns for s in report.series] == costs
    occupied = [(1, 0), (1, 1), (1, 1), (1, 0), (1, 0)]  # b waits while a runs
    assert [(s.running, s.waiting) for s in report.series] == occupied
    assert (report.steps, report.start_ns, report.end_ns) == (5, 0, 25_750_000)
    assert report.makespan_ns == 25_750_000
    assert (report.prefill_tokens, report.decode_seqs, report.preemptions) == (6, 3, 0)
    assert report.ttft_ns == (0, 14_500_000)  # arrival order: a, then b
    assert report.tpot_ns == (5_225_000.0, 5_200_000.0)
    assert report.mean_occupancy == 1.0 and report.occupancy_while_queued == 1.0
    assert report.output_tokens == 5
    assert report.throughput == 5 * NS_PER_S / 25_750_000
    assert report.outputs == reference_outputs([A, B], m)
    assert report.finish_reasons == {"a": "length", "b": "length"}
    by_rid = {x.rid: x for x in report.metrics}
    assert [by_rid[rid].ttft_ns for rid in "ab"] == list(report.ttft_ns)
    assert [by_rid[rid].tpot_ns for rid in "ab"] == list(report.tpot_ns)
    summary = report.summary()
    assert "2 requests, 5 output tokens in 5 steps over 25.8 ms (194 tokens/s)" in summary
    assert len(summary.splitlines()) == 4


def test_simulate_jumps_an_idle_clock_to_the_next_arrival() -> None:
    late = Request("b", (5, 6), 2, arrival_ns=100 * NS_PER_MS)
    report = simulate(SerialBatcher(model(4)), [A, late], slots=1)
    assert [s.now_ns for s in report.series][3:] == [100 * NS_PER_MS, 105_200_000]
    assert report.end_ns == 110_250_000 and report.ttft_ns == (0, 0)
    assert [s.waiting for s in report.series] == [0] * 5


class StuckBatcher(SerialBatcher):
    def step(self, now_ns: int) -> StepOutput:
        return StepOutput(now_ns)


def test_simulate_fails_a_batcher_that_never_finishes() -> None:
    with pytest.raises(AssertionError, match=r"liveness — 3 steps .* 1 requests still unfinished"):
        simulate(StuckBatcher(model(4)), [A], slots=1, max_steps=3)


class ForgetfulBatcher(SerialBatcher):
    def has_unfinished(self) -> bool:
        return False


def test_simulate_fails_a_batcher_that_drops_a_request() -> None:
    with pytest.raises(AssertionError, match=r"never reported finished"):
        simulate(ForgetfulBatcher(model(4)), [A], slots=1)


# -- the pictures -------------------------------------------------------------------------
def _report(seed: int) -> Report:
    requests = workload.exponential(6, mean_output=4, seed=seed, prompt_len=(2, 6), max_output=8)
    return simulate(SerialBatcher(model(8)), requests, slots=1)


def test_charts_are_text_of_bounded_width() -> None:
    reports = {"serial": _report(1), "again": _report(2)}
    for width, height in ((72, 10), (40, 3)):
        chart = occupancy_chart(reports, width=width, height=height)
        lines = chart.splitlines()
        assert "serial" in chart and "again" in chart
        assert max(len(line) for line in lines) <= width
        assert len(lines) == 1 + 2 * (height + 4) + 1
    for values in (reports["serial"].ttft_ns, reports["serial"].tpot_ns, [3.0, 3.0]):
        text = distribution_chart(values, title="TTFT", width=50)
        assert text.startswith("TTFT: n=") and max(len(x) for x in text.splitlines()) <= 50
    assert distribution_chart([], title="TPOT") == "TPOT: no values"
    with pytest.raises(ValueError):
        occupancy_chart(reports, width=10)


#: A stage 1 whose static batcher is a stub again (appended, it replaces the reference's).
_STATIC_STUB = """

from katas._runtime.todo import Todo


class StaticBatcher:
    def __init__(self, model: Model, *, batch_size: int) -> None:
        raise Todo()
"""


def test_the_pictures_of_the_stubs_say_in_one_line_what_they_need(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stubs = committed_stubs(tmp_path / "stubs")
    assert pictures.main(["--impl", str(stubs)]) == 1
    assert capsys.readouterr() == (
        "",
        "the picture needs ContinuousBatcher (stage 1, core) — not implemented yet: "
        "ContinuousBatcher.__init__\n",
    )


def test_the_pictures_without_a_static_batcher_say_in_one_line_what_they_need(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kata = tmp_path / "impl" / "dynamic_batcher"
    source = REPO_ROOT / "solutions" / "dynamic_batcher"
    shutil.copytree(source, kata, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    stage1 = kata / "stage1.py"
    stage1.write_text(stage1.read_text() + _STATIC_STUB)
    assert pictures.main(["--impl", str(tmp_path / "impl")]) == 1
    assert capsys.readouterr() == (
        "",
        "the picture needs StaticBatcher (stage 1, extended) — not implemented yet: "
        "StaticBatcher.__init__\n",
    )


def test_the_pictures_say_what_occupancy_measures_against_the_90_percent_bar() -> None:
    found = {"static": _report(1), "continuous": _report(2)}
    note = pictures.occupancy_note(found, width=72)
    waiting = [f"{name} {r.occupancy_while_queued:.0%}" for name, r in found.items()]
    assert (
        "every step" in note
        and "90%" in note
        and all(w in note.replace("\n", " ") for w in waiting)
    )
    assert max(len(line) for line in note.splitlines()) <= 72


def test_save_png_without_matplotlib_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match=r"pip install 'infra-katas\[plot\]'"):
        save_png({"serial": _report(1)}, "unused.png")


# -- the replica server and its client (stage 3's harness) -------------------------------
#: Every wait on a replica, in real seconds: a hang fails a test, it never stalls it.
REPLICA_DEADLINE_S = 5.0
LONG = Request("long", PROMPT, 800)  # 800 steps of 1 ms: still running when the test acts


def _replica_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stats", timeout=REPLICA_DEADLINE_S) as answer:
        found: dict[str, Any] = json.loads(answer.read())
    return found


async def _collect(url: str, request: Request) -> list[tuple[tuple[int, ...], str | None]]:
    with anyio.fail_after(REPLICA_DEADLINE_S):
        return [item async for item in stream_completion(url, request)]


def test_a_replica_streams_the_reference_tokens_of_concurrent_requests() -> None:
    requests = [
        Request("r1", PROMPT, 12),
        Request("r2", (7, 8, 9), 30, stop_tokens={reference_outputs(
            [Request("x", (7, 8, 9), 30)], replica.model())["x"][9]}),
        Request("r3", tuple(range(40)), 5),
    ]  # fmt: skip
    expected = reference_outputs(requests, replica.model())
    with replica.running(impl.resolve("solutions")) as server:

        async def main() -> dict[str, list[tuple[tuple[int, ...], str | None]]]:
            got: dict[str, list[tuple[tuple[int, ...], str | None]]] = {}

            async def one(request: Request) -> None:
                got[request.rid] = await _collect(server.url, request)

            async with anyio.create_task_group() as tg:
                for request in requests:
                    tg.start_soon(one, request)
            return got

        got = anyio.run(main)
        stats = _replica_stats(server.url)
    for request in requests:
        items = got[request.rid]
        assert tuple(t for tokens, _ in items for t in tokens) == expected[request.rid]
        assert [reason for _, reason in items[:-1]] == [None] * (len(items) - 1)
    assert [got[r.rid][-1][1] for r in requests] == ["length", "stop", "length"]
    assert stats["finished"] == {"r1": "length", "r2": "stop", "r3": "length"}
    assert stats["engine"]["streams"] == 0 and stats["replica"]["streamed"] == 3


def test_a_replica_answers_429_with_retry_after_past_max_waiting() -> None:
    with replica.running(impl.resolve("solutions"), max_num_seqs=1, max_waiting=1) as server:

        async def main() -> tuple[httpx.Response, Overloaded]:
            with anyio.fail_after(REPLICA_DEADLINE_S):
                async with stream_completion(server.url, LONG) as running:
                    await running.__anext__()  # admitted: it is running, not waiting
                    queued = stream_completion(server.url, Request("queued", PROMPT, 5))
                    async with queued, anyio.create_task_group() as tg:
                        tg.start_soon(queued.__anext__)  # waits behind "long"
                        while not server.process.lines("request queued"):
                            await anyio.sleep(0.001)
                        async with httpx.AsyncClient() as client:
                            raw = await client.post(
                                server.url + "/v1/completions",
                                json=replica.request_body(Request("raw", PROMPT, 5)),
                            )
                        with pytest.raises(Overloaded) as refused:
                            await stream_completion(
                                server.url, Request("refused", PROMPT, 5)
                            ).__anext__()
                        tg.cancel_scope.cancel()
            return raw, refused.value

        raw, refused = anyio.run(main)
    assert raw.status_code == 429
    assert raw.headers["retry-after"] == "1"
    assert 0 < int(raw.headers["x-retry-after-ns"]) <= NS_PER_MS  # within the step in flight
    assert 0 < refused.retry_after_ns <= NS_PER_MS


def test_a_replica_killed_mid_stream_is_a_replica_error_at_once() -> None:
    with replica.running(impl.resolve("solutions")) as server:

        async def main() -> tuple[ReplicaError, float, int]:
            got, killed = 0, 0.0
            with anyio.fail_after(REPLICA_DEADLINE_S):
                try:
                    async with stream_completion(server.url, LONG) as completion:
                        async for _ in completion:
                            got += 1
                            if got == 3:
                                await anyio.to_thread.run_sync(server.kill)
                                killed = time.monotonic()
                except ReplicaError as error:
                    return error, time.monotonic() - killed, got
            raise AssertionError(f"the stream of a killed replica ended cleanly after {got}")

        error, after_s, got = anyio.run(main)
        assert not server.process.alive()
    assert got < LONG.max_new_tokens and after_s < 1.0
    assert "died" in str(error) or "broke" in str(error), error


def test_a_client_that_leaves_mid_stream_aborts_its_request_at_the_replica() -> None:
    with replica.running(impl.resolve("solutions")) as server:

        async def main() -> int:
            got = 0
            with anyio.fail_after(REPLICA_DEADLINE_S):
                async with stream_completion(server.url, LONG) as completion:
                    async for tokens, _ in completion:
                        got += len(tokens)
                        if got >= 3:
                            break
            return got

        taken = anyio.run(main)
        server.wait_for("disconnected long")
        deadline = time.monotonic() + REPLICA_DEADLINE_S
        while (stats := _replica_stats(server.url))["finished"] != {"long": "abort"}:
            assert time.monotonic() < deadline, f"the request was never aborted: {stats}"
            time.sleep(0.01)
    assert stats["engine"]["streams"] == 0 and stats["engine"]["running"] == 0
    assert stats["replica"]["disconnected"] == 1
    assert taken <= stats["engine"]["output_tokens"] < LONG.max_new_tokens


def test_a_replica_answers_400_to_a_body_that_is_not_a_request() -> None:
    with replica.running(impl.resolve("solutions")) as server:
        for body in (b"{not json", b'{"prompt": [1], "max_tokens": 2, "request_id": "x"}'):
            answer = httpx.post(
                server.url + "/v1/completions", content=body, timeout=REPLICA_DEADLINE_S
            )
            assert answer.status_code == 400, body
        assert httpx.get(server.url + "/health", timeout=REPLICA_DEADLINE_S).status_code == 200
        with pytest.raises(ReplicaError, match="status 404"):
            anyio.run(_collect, server.url + "/v2/nothing", Request("x", PROMPT, 2))


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello", "not an event stream"),
        (b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n", "status 503"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
            b'data: {"id": "x", "choi',
            "truncated",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
            b"garbage\n\n",
            "garbled",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
            b'data: {"id": "x", "choices": [{"tokens": [1], "finish_reason": null}]}\n\n',
            "no \\[DONE\\]",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
            b'data: {"id": "x", "choices": [{"tokens": [1], "finish_reason": "length"}]}\n\n'
            b"data: [DONE]\n\n",
            None,
        ),
    ],
    ids=["text", "503", "truncated", "garbled", "no-done", "whole"],
)
def test_the_replica_client_names_every_broken_answer(answer: bytes, why: str | None) -> None:
    async def main() -> list[tuple[tuple[int, ...], str | None]] | ReplicaError:
        async def handle(sock: anyio.abc.SocketStream) -> None:
            async with sock:
                await sock.receive()
                await sock.send(answer)

        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handle)
            try:
                return await _collect(f"http://127.0.0.1:{port}", Request("x", PROMPT, 2))
            except ReplicaError as error:
                return error
            finally:
                tg.cancel_scope.cancel()
        raise AssertionError("unreachable: the block returns")

    got = anyio.run(main)
    if why is None:
        assert got == [((1,), "length")]
    else:
        assert isinstance(got, ReplicaError) and re.search(why, str(got)), got


# -- the fleet's pictures (stage 3) ------------------------------------------------------
#: A stage 3 whose Router is a stub again (appended, it replaces the reference's).
_ROUTER_STUB = """

from katas._runtime.todo import Todo


class Router:  # type: ignore[no-redef]
    def __init__(self, replicas: object, **settings: object) -> None:
        raise Todo()
"""


def test_the_fleet_pictures_of_the_stubs_say_in_one_line_what_they_need(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stubs = committed_stubs(tmp_path / "stubs")
    assert fleet_pictures.main(["--impl", str(stubs)]) == 1
    assert capsys.readouterr() == (
        "",
        "the picture needs ReplicaSet and Router (stage 3, core) — not implemented yet: "
        "Router.__init__\n",
    )


def test_the_fleet_pictures_of_a_stub_router_say_in_one_line_what_they_need(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kata = tmp_path / "impl" / "dynamic_batcher"
    source = REPO_ROOT / "solutions" / "dynamic_batcher"
    shutil.copytree(source, kata, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    stage3 = kata / "stage3.py"
    stage3.write_text(stage3.read_text() + _ROUTER_STUB)
    assert fleet_pictures.main(["--impl", str(tmp_path / "impl")]) == 1
    assert capsys.readouterr() == (
        "",
        "the picture needs ReplicaSet and Router (stage 3, core) — not implemented yet: "
        "Router.__init__\n",
    )


@pytest.fixture(scope="module")
def fleet_load() -> dict[str, fleet_charts.LoadRun]:
    return fleet_pictures.load_runs(impl.resolve("solutions"))


def test_the_reference_router_evens_the_load_and_hits_the_cache_more_than_round_robin(
    fleet_load: dict[str, fleet_charts.LoadRun],
) -> None:
    rr, router = fleet_load["round-robin"], fleet_load["router"]
    for run in (rr, router):
        assert run.whole == run.requests == 200 and run.refused == 0, run.name
        assert run.samples[-1][1] == dict.fromkeys(run.replicas, 0), "a charge never released"
        assert len(run.samples) > 100
    # the reference: 1.37 against 2.12, and 66% against 42% (deterministic, in virtual time)
    assert router.max_over_mean < 0.8 * rr.max_over_mean
    assert router.hit_rate > rr.hit_rate + 0.1
    assert "by affinity" in router.routes and not rr.routes
    chart = fleet_charts.load_chart(fleet_load, width=72)
    assert max(len(line) for line in chart.splitlines()) <= 72
    assert f"max/mean {router.max_over_mean:.2f} vs {rr.max_over_mean:.2f}" in chart
    assert f"({router.hit_rate:.0%})" in chart and f"({rr.hit_rate:.0%})" in chart


def test_the_meter_charges_a_request_its_prompt_and_budget_until_its_first_token() -> None:
    clock = ManualClock(engine.T0)
    r = Request("r", PROMPT, 5)

    class Link:
        name = "x"

        def stream(self, request: Request) -> Any:
            return Events([((7,), None), ((8, 9), None), ((1, 2), "length")])

        async def healthy(self) -> bool:
            return True

    class Events:
        def __init__(self, items: list[tuple[tuple[int, ...], FinishReason | None]]) -> None:
            self.items = items

        async def __anext__(self) -> tuple[tuple[int, ...], FinishReason | None]:
            if not self.items:
                raise StopAsyncIteration
            return self.items.pop(0)

        async def aclose(self) -> None:
            pass

    meter = fleet_pictures.Meter(clock, {"r": r})
    link = meter.link(Link())

    async def main() -> list[int]:
        seen = []
        completion = link.stream(r)
        seen.append(meter.loads["x"])  # charged when the router asks, before any read
        async for _ in completion:
            seen.append(meter.loads["x"])
        return seen

    assert anyio.run(main) == [6 + 5, 4, 2, 0]
    # a failover's attempt: the prompt and the tokens accepted, under the id or another
    for rid in ("r", "r#1"):
        resubmitted = link.stream(Request(rid, (*PROMPT, 7, 8), 3))
        assert resubmitted.attempt.rid == "r" and resubmitted.attempt.offset == 2
        assert meter.loads["x"] == 8 + 3
        anyio.run(resubmitted.aclose)
        assert meter.loads["x"] == 0
    with pytest.raises(LookupError, match="continues none of the requests"):
        link.stream(Request("r#2", (1, 2, 3), 3))


def test_the_failover_timeline_letters_each_token_by_its_replica_and_marks_the_kill() -> None:
    t = fleet_pictures.timeline(impl.resolve("solutions"), kill_step=12)
    assert not t.broken and t.failovers == 2
    kill_col = t.kill_ns // t.step_ns
    assert kill_col == 12
    moved = []
    for rid in t.outputs:
        placed = t.tokens_of(rid)
        assert None not in placed and len(placed) == 32
        before = {who for at, who in (x for x in placed if x) if at <= t.kill_ns}
        after = {who for at, who in (x for x in placed if x) if at > t.kill_ns}
        assert t.killed not in after, f"{rid}: a token from the dead replica"
        if t.killed in before:
            moved.append(rid)
            assert len(after) == 1 and placed[12] is not None and placed[12][1] != t.killed
    assert "r0" in moved and len(moved) == 2
    chart = fleet_charts.timeline_chart(t, width=72)
    lines = chart.splitlines()
    assert max(len(line) for line in lines) <= 72
    marker = next(line for line in lines if "▼ kill" in line)
    row = next(line for line in lines if line.startswith("r0 "))
    bar = row.index("│")
    assert marker.index("▼") == bar + 1 + kill_col
    letter = t.killed
    assert row[bar + 1 : bar + 1 + kill_col] == letter * kill_col and row[bar + 1 + kill_col] == "·"
    assert "every stream whole" in chart
    painted = fleet_charts.timeline_chart(t, width=72, color=True)
    assert "\x1b[" in painted and painted.replace("\x1b[0m", "").count("\x1b[") >= 6 * 32


def test_save_fleet_png_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, fleet_load: dict[str, fleet_charts.LoadRun]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    timeline = fleet_charts.Timeline(("a",), 1, "a", 0, (), {}, {}, {}, 0)
    with pytest.raises(RuntimeError, match=r"pip install 'infra-katas\[plot\]'"):
        fleet_charts.save_png(fleet_load, timeline, "unused.png")


# -- the replica over HTTP as a router's link (stage 3's harness) ------------------------
def test_an_http_link_streams_from_a_real_replica_and_probes_its_health() -> None:
    wanted = Request("r1", PROMPT, 12)
    expected = reference_outputs([wanted], replica.model())["r1"]
    with replica.running(impl.resolve("solutions")) as server:
        link: ReplicaLink = HttpLink("a", server.url)

        async def main() -> tuple[list[tuple[tuple[int, ...], FinishReason | None]], bool]:
            with anyio.fail_after(REPLICA_DEADLINE_S):
                completion = link.stream(wanted)
                try:
                    items = [item async for item in completion]
                finally:
                    await completion.aclose()
                return items, await link.healthy()

        items, healthy = anyio.run(main)
        assert link.name == "a" and healthy is True
        assert tuple(t for tokens, _ in items for t in tokens) == expected
        assert items[-1][1] == "length"
        server.kill()

        async def dead() -> None:
            with anyio.fail_after(REPLICA_DEADLINE_S):
                await link.healthy()

        with pytest.raises(ReplicaError, match="health probe: cannot connect"):
            anyio.run(dead)
        with pytest.raises(ReplicaError, match="cannot connect"):
            anyio.run(_collect, server.url, wanted)


@pytest.mark.parametrize(
    ("answer", "verdict"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n", True),
        (b"HTTP/1.1 503 Draining\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\nok", "the answer broke HTTP/1.1"),
        (b"", "the answer broke HTTP/1.1"),
        (b"garbage\r\n\r\n", "the answer broke HTTP/1.1"),
    ],
    ids=["200", "503", "cut-short", "no-answer", "garbage"],
)
def test_the_health_probe_names_every_answer(answer: bytes, verdict: bool | str) -> None:
    asked: list[bytes] = []

    async def main() -> bool | ReplicaError:
        async def handle(sock: anyio.abc.SocketStream) -> None:
            async with sock:
                asked.append(await sock.receive())
                if answer:
                    await sock.send(answer)

        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handle)
            try:
                with anyio.fail_after(REPLICA_DEADLINE_S):
                    return await probe_health(f"http://127.0.0.1:{port}")
            except ReplicaError as error:
                return error
            finally:
                tg.cancel_scope.cancel()
        raise AssertionError("unreachable: the block returns")

    got = anyio.run(main)
    assert asked and asked[0].startswith(b"GET /health HTTP/1.1\r\n")
    if isinstance(verdict, bool):
        assert got is verdict
    else:
        assert isinstance(got, ReplicaError) and verdict in str(got), got
