"""Stage 2, extended: automatic prefix caching, ``PrefixCachingBatcher`` (see
katas/dynamic_batcher/README.md, "Stage 2"; ``-k prefix``).

A ``FakeModel(shared_reads=True)`` lets requests share the blocks they only read, and
samples every token from what it reads back, so a block freed while shared, evicted in
use or recomputed into the wrong place changes the output;
:mod:`katas.dynamic_batcher._testing.prefix` holds a run that checks every step and a
model of the rules, written from the prompt alone, that a state machine
(:mod:`katas.dynamic_batcher._testing.prefix_machine`) compares with the batcher.

Map: the worked example · prefix-keys · prefix-hit · prefix-last-token ·
prefix-no-shared-writes · prefix-refcount · prefix-lru · prefix-preemption ·
prefix-transparency · prefix-stage1 · prefix-statistics · prefix-bad-input.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from katas._harness.marks import extended, rule
from katas._harness.profiles import examples
from katas._harness.story import Story, check
from katas._harness.under_test import stage
from katas._harness.walks import walked
from katas.dynamic_batcher._testing.configs import (
    accepted_configurations,
    bad_configurations,
    expect_refused_by_name,
)
from katas.dynamic_batcher._testing.prefix import (
    S,
    prefix_model,
    run_of,
    toks,
)
from katas.dynamic_batcher._testing.prefix_machine import PREFIX_WALKS, PrefixCacheMachine
from katas.dynamic_batcher._testing.rules import BatchingRules, step_of
from katas.dynamic_batcher._testing.trace import (
    STEP_NS,
    ceil_div,
    draw_run_config,
    draw_submission,
    unbatched,
)
from katas.dynamic_batcher._testing.workload import shared_prefixes
from katas.dynamic_batcher.api import (
    PrefixCacheStatistics,
    Request,
    RequestRejected,
)

pytestmark = [pytest.mark.stage(2), pytest.mark.anyio]


# -- prefix caching: the worked example, step by step ----------------------------------


@extended
@rule(
    "prefix-hit", "prefix-last-token", "prefix-keys", "prefix-lru", "prefix-preemption",
    "prefix-statistics",
)  # fmt: skip
def test_stage2_prefix_the_worked_example_step_by_step() -> None:
    t = run_of(prefix_model(num_blocks=9), max_num_seqs=4, max_num_batched_tokens=16)
    arrivals = {
        1: [Request("A", S + toks(200, 3), 2)],
        2: [Request("B", S + toks(300, 5), 5)],
        3: [Request("C", S, 5)],
        4: [Request("D", toks(400, 12), 5)],
    }
    # (scheduled, (lookups, queried, hits, cached blocks, evictions), why) of steps 1-4
    want = [
        ({"A": 11}, (1, 11, 0, 2, 0),
         "nothing is cached yet: A computes its 11 tokens; its blocks 0 and 1 are full and "
         "cached after the step"),
        ({"A": 1, "B": 5}, (2, 24, 8, 4, 0),
         "B's first two blocks are S's, cached: B shares them and computes its 5 tokens"),
        ({"B": 1, "C": 4}, (3, 32, 12, 4, 0),
         "C's prompt is S, all cached, but the block that holds its last token is computed "
         "again: C shares one block and computes 4 tokens into a block of its own, which "
         "stays uncached (its key is cached already)"),
        ({"B": 1, "C": 1, "D": 12}, (4, 44, 12, 6, 1),
         "D takes the two blocks never used, then the least recently freed: A's last "
         "block, whose key is evicted"),
    ]  # fmt: skip
    for n, (scheduled, counts, why) in enumerate(want, 1):
        t.submit(*arrivals[n])
        out = t.step()
        got = (dict(out.scheduled), t.b.cache_statistics())
        check(
            got == (scheduled, PrefixCacheStatistics(*counts)),
            f"prefix-hit: the README's worked example, step {n}: {why}. Expected scheduled "
            f"{scheduled} and {PrefixCacheStatistics(*counts)}; got {got[0]} and {got[1]}\n"
            f"{t.rows()}",
        )
    shared = (t.b.blocks_of("B")[0], t.b.blocks_of("C")[0])
    check(
        shared[0] == shared[1] and t.b.blocks_of("B")[1] != t.b.blocks_of("C")[1],
        f"prefix-last-token: after step 4, B and C share S's first block and not its second "
        f"(C computed its own); B holds {t.b.blocks_of('B')}, C {t.b.blocks_of('C')}",
    )
    t.run()
    t.assert_transparent()
    check(
        t.hits["D"] == [0, 8],
        f"prefix-preemption: D is preempted at step 5 and its recompute finds its first "
        f"two blocks still cached (8 tokens); its admissions were served {t.hits['D']}\n"
        f"{t.rows()}",
    )


# -- prefix caching: keys: chained, full blocks only, one block per key ----------------


@extended
@rule("prefix-keys")
def test_stage2_prefix_the_same_block_after_a_different_prefix_is_no_hit() -> None:
    x, y, z = toks(10, 4), toks(20, 4), toks(30, 4)
    t = run_of()
    t.submit(Request("XY", x + y, 1))
    t.step()
    cases = [("ZY", z + y + (1,), 9, "its block 1 holds XY's block 1's tokens, after a "
              "different block 0: a key names the whole prefix, not the block alone"),
             ("YX", y + x + (1,), 9, "the blocks of XY in the other order"),
             ("XY+", x + y + (1,), 1, "the same prefix: both blocks are hits")]  # fmt: skip
    for rid, prompt, want, why in cases:
        t.submit(Request(rid, prompt, 1))
        got = dict(t.step().scheduled)
        check(
            got == {rid: want},
            f"prefix-keys: after XY ({list(x + y)}) is cached, {rid} ({list(prompt)}) must "
            f"compute {want} tokens — {why}; step scheduled {got}\n{t.rows()}",
        )
    t.assert_transparent()


@extended
@rule("prefix-keys", "prefix-no-shared-writes")
def test_stage2_prefix_a_block_is_cached_once_the_step_that_fills_it_has_run() -> None:
    t = run_of(max_num_batched_tokens=32)
    t.submit(Request("A", (*S, 1), 6), Request("B", (*S, 2), 6))
    got = dict(t.step().scheduled)
    check(
        got == {"A": 9, "B": 9} and not set(t.b.blocks_of("A")) & set(t.b.blocks_of("B")),
        "prefix-no-shared-writes: A and B share S but are admitted in the same step: A's "
        "blocks are written in that step, so B cannot share them (nor A B's); both compute "
        f"9 tokens into blocks of their own. Scheduled {got}, A holds "
        f"{t.b.blocks_of('A')}, B {t.b.blocks_of('B')}",
    )
    t.submit(Request("C", (*S, 3), 2))
    got = dict(t.step().scheduled)
    a, b, c = (t.b.blocks_of(rid) for rid in "ABC")
    check(
        got.get("C") == 1 and c[:2] == a[:2] and not set(c) & set(b),
        "prefix-keys: one block per key, the first to fill it: A, scheduled before B, "
        f"cached S's two blocks; C shares A's, not B's, and computes 1 token. Scheduled "
        f"{got}; A holds {a}, B {b}, C {c}",
    )
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-no-shared-writes", "prefix-keys")
def test_stage2_prefix_a_block_a_decode_fills_is_shared_only_after_its_step() -> None:
    t = run_of(max_num_batched_tokens=32)
    t.submit(Request("A", toks(10, 3), 6))
    t.step()  # A's prompt (3 tokens) and its first output token, not yet in KV
    prefix = (*toks(10, 3), t.streamed["A"][0])  # A's block 0, once step 2 writes it
    t.submit(Request("B", (*prefix, 7, 8), 2))
    got = dict(t.step().scheduled)
    check(
        got == {"A": 1, "B": 6} and t.hits["B"] == [0],
        "prefix-no-shared-writes: at step 2 A's decode writes the 4th token of its block 0, "
        "filling it; B, whose prompt starts with those 4 tokens, is admitted in that same "
        "step: the block is cached only after the step, so B shares nothing and computes "
        f"its 6 tokens. Expected {{'A': 1, 'B': 6}} and B served [0]; got {got} and "
        f"{t.hits['B']}\n{t.rows()}",
    )
    t.submit(Request("C", (*prefix, 9), 2))
    got = dict(t.step().scheduled)
    check(
        got.get("C") == 1 and t.hits["C"] == [4],
        "prefix-keys: after step 2 A's block 0 is cached under the key of its tokens, "
        "prompt and output alike: C, admitted at step 3, shares it and computes its last "
        f"token only; step 3 scheduled {got}, C served {t.hits['C']}\n{t.rows()}",
    )
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-no-shared-writes", "prefix-hit")
def test_stage2_prefix_a_partial_block_is_never_shared() -> None:
    t = run_of()
    t.submit(Request("A", toks(10, 6), 8))  # one full block, one half full
    t.step()
    t.submit(Request("B", (*toks(10, 6), 99), 2), Request("C", toks(10, 6), 2))
    got = dict(t.step().scheduled)
    a = t.b.blocks_of("A")
    check(
        got == {"A": 1, "B": 3, "C": 2},
        "prefix-no-shared-writes: A's prompt is 6 tokens in blocks of 4: block 0 is full "
        "and cached, block 1 is partial — A writes its next tokens there — so it has no key "
        "and is never shared. B (A's prompt + 1) shares block 0 and computes 3 tokens, C "
        f"(A's prompt) shares block 0 and computes 2; scheduled {got}\n{t.rows()}",
    )
    for rid in "BC":
        mine = t.b.blocks_of(rid)
        check(
            mine[0] == a[0] and a[1] not in mine,
            f"prefix-no-shared-writes: {rid} shares A's block 0 ({a[0]}) and not its partial "
            f"block 1 ({a[1]}); it holds {mine}",
        )
    t.run()
    t.assert_transparent()


# -- prefix caching: hits and the last token -------------------------------------------


@extended
@rule("prefix-hit", "prefix-statistics")
def test_stage2_prefix_a_shared_system_prompt_saves_exactly_its_full_blocks() -> None:
    system = toks(100, 10)  # two full blocks of 4, and 2 tokens that share a block
    m = prefix_model(num_blocks=24)
    t = run_of(m, max_num_seqs=8, max_num_batched_tokens=64)
    first = [Request("r0", system + toks(200, 3), 4)]
    rest = [Request(f"r{i}", system + toks(200 + 10 * i, 3), 4) for i in range(1, 6)]
    t.submit(*first)
    t.step()
    t.submit(*rest)
    got = dict(t.step().scheduled)
    want = {"r0": 1, **{r.rid: 5 for r in rest}}
    check(
        got == want,
        "prefix-hit: r0 (a system prompt of 10 tokens + 3 of its own) cached the prompt's "
        "two full blocks; r1..r5 (the same system prompt, 3 tokens of their own) share "
        "them and compute 13 - 8 = 5 tokens each — the system prompt's last 2 tokens share "
        f"a block with each request's own and are computed; expected {want}, got {got}",
    )
    t.run()
    stats = t.b.cache_statistics()
    check(
        (stats.lookups, stats.queried_tokens, stats.hit_tokens) == (6, 78, 40)
        and m.prefill_tokens == 78 - 40,
        "prefix-statistics: 6 admissions queried 6 × 13 = 78 prompt tokens and 5 × 8 = 40 "
        f"were served from the cache, so the model prefilled 38; got {stats}, the model "
        f"prefilled {m.prefill_tokens}",
    )
    t.assert_transparent()


@extended
@rule("prefix-hit")
def test_stage2_prefix_tokens_served_from_the_cache_cost_no_budget() -> None:
    t = run_of(max_num_batched_tokens=8)
    t.submit(Request("A", (*S, 1), 6))
    t.step()
    t.step()  # A's prompt of 9 in chunks of 8 and 1: S's two blocks are cached
    t.submit(Request("B", S + toks(20, 5), 2), Request("C", toks(40, 3), 2))
    got = dict(t.step().scheduled)
    check(
        got == {"A": 1, "B": 5, "C": 2},
        "prefix-hit: budget 8: A decodes (1); B (S + 5 tokens: 13) is served S's 8 tokens "
        "from the cache and computes 5 — only those are charged — so C gets the 2 left; "
        f"expected {{'A': 1, 'B': 5, 'C': 2}}, got {got}\n{t.rows()}",
    )
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-last-token")
@pytest.mark.parametrize(
    ("extra", "want", "why"),
    [
        pytest.param(0, 4, "exactly two full blocks, both cached: the block that holds "
                     "its last token is computed again, all 4 tokens of it", id="full-blocks"),
        pytest.param(1, 1, "two full blocks and one token: both blocks are hits, the last "
                     "token is computed", id="one-past"),
        pytest.param(-1, 3, "a block and 3 tokens: the first block is a hit; the second "
                     "is cached full, but this prompt fills 3 of its slots", id="one-short"),
    ],
)  # fmt: skip
def test_stage2_prefix_the_last_prompt_token_is_always_computed(
    extra: int, want: int, why: str
) -> None:
    t = run_of()
    t.submit(Request("first", (*S, 7), 1))  # caches S's two blocks
    t.step()
    prompt = S + (7,) * extra if extra >= 0 else S[:extra]
    t.submit(Request("again", prompt, 3))
    out = t.step()
    check(
        dict(out.scheduled) == {"again": want} and "again" in out.tokens,
        f"prefix-last-token: a prompt of {len(prompt)} tokens after S ({len(S)} tokens, two "
        f"blocks of 4) is cached — {why}: it computes {want} and the model samples its first "
        f"token; scheduled {dict(out.scheduled)}, emitted {dict(out.tokens)}",
    )
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-hit")
def test_stage2_prefix_a_chat_turn_reuses_the_previous_turn_and_its_answer() -> None:
    t = run_of()
    first = Request("turn1", toks(10, 6), 7)
    t.submit(first)
    t.run()
    answer = tuple(t.streamed["turn1"])  # 6 + 6 tokens were in KV: three full blocks
    second = Request("turn2", first.prompt + answer + toks(50, 3), 2)
    t.submit(second)
    got = dict(t.step().scheduled)
    check(
        got == {"turn2": 4},
        "prefix-hit: turn 1 put its 6-token prompt and 6 of its 7 answer tokens in KV (the "
        "last token is never written): three full blocks, cached as they filled, generated "
        "tokens and all. Turn 2 (turn 1's prompt, its answer, 3 new tokens: 16) shares them "
        f"and computes 16 - 12 = 4 tokens; scheduled {got}",
    )
    t.run()
    t.assert_transparent()


# -- prefix caching: ref counts, the free queue, eviction ------------------------------


@extended
@rule("prefix-lru", "prefix-refcount", "prefix-statistics")
@pytest.mark.parametrize(
    ("again", "want", "why"),
    [
        pytest.param("X", 5, "X's blocks were freed first, so one of them is the one "
                     "evicted — its last block, released before its first: X's first block "
                     "is still a hit (4 tokens), its second is not", id="freed-first"),
        pytest.param("Y", 1, "Y's blocks were freed after X's: both are still cached (8 "
                     "tokens)", id="freed-last"),
    ],
)  # fmt: skip
def test_stage2_prefix_eviction_takes_the_least_recently_freed_block_first(
    again: str, want: int, why: str
) -> None:
    prompts = {"X": toks(10, 8), "Y": toks(30, 8)}
    t = run_of(prefix_model(num_blocks=7))
    t.run({1: [Request("X", prompts["X"], 1)], 2: [Request("Y", prompts["Y"], 1)]})
    # The free queue: the 3 blocks never used, then X's 2 (last first), then Y's 2.
    t.submit(Request("Z", toks(50, 16), 1))  # 4 blocks: the 3 never used, then 1 more
    t.step()
    stats = t.b.cache_statistics()
    check(
        (stats.cached_blocks, stats.evictions, t.b.free_blocks()) == (7, 1, 7),
        "prefix-lru: X and Y (8 tokens each) cached two blocks each and finished, then Z "
        "(16 tokens) took the 3 blocks never used and one cached block: 1 eviction, 7 "
        f"cached blocks (3 + Z's 4), 7 free; got {stats}, free {t.b.free_blocks()}",
    )
    rid = again + "2"
    t.submit(Request(rid, prompts[again] + (5,), 2))
    got = dict(t.step().scheduled)
    check(
        got == {rid: want},
        f"prefix-lru: {rid} is {again}'s prompt and one token more — {why}: it computes "
        f"{want}; scheduled {got}\n{t.rows()}",
    )
    check(
        t.b.free_blocks() == 4,
        f"prefix-lru: {rid} holds 3 blocks now, its hits among them: a cached free block "
        f"that a request reuses leaves the free queue; free_blocks() is "
        f"{t.b.free_blocks()}, expected 7 - 3 = 4",
    )
    t.submit(Request("W", toks(600, 16), 1))  # exactly the 4 blocks left
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-refcount", "prefix-lru")
def test_stage2_prefix_a_reused_free_block_is_never_handed_out_again() -> None:
    t = run_of(prefix_model(num_blocks=6))
    t.run({1: [Request("A", S, 1)]})  # S's two blocks cached, then free
    t.submit(Request("B", S + toks(20, 4), 3))  # shares both, takes 1 + 1 more
    t.step()
    b = t.b.blocks_of("B")
    check(
        t.b.free_blocks() == 6 - len(b) == 3,
        f"prefix-lru: B shares S's two cached blocks, free until now, and takes one "
        f"new block: it holds {b}; the shared blocks left the free queue, so 6 - 3 = 3 "
        f"are free, got {t.b.free_blocks()}",
    )
    t.submit(Request("C", toks(50, 12), 2))  # every free block
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-refcount", "prefix-transparency")
def test_stage2_prefix_aborting_one_of_two_sharers_leaves_the_other_its_blocks() -> None:
    t = run_of(prefix_model(num_blocks=7))
    t.submit(Request("A", (*S, 1), 8))
    t.step()
    t.submit(Request("B", (*S, 2), 8))
    t.step()
    a, b = t.b.blocks_of("A"), t.b.blocks_of("B")
    check(a[:2] == b[:2], f"prefix-hit: B shares S's two blocks with A: A {a}, B {b}")
    t.abort("A")  # checks held + free = num_blocks
    check(
        t.b.blocks_of("B") == b and t.b.free_blocks() == 7 - len(b),
        f"prefix-refcount: A is aborted: its own block goes back to the free queue, the "
        f"two it shares stay B's (their ref count drops to 1, not 0): B holds "
        f"{t.b.blocks_of('B')} (was {b}), free {t.b.free_blocks()}, expected {7 - len(b)}",
    )
    t.submit(Request("C", toks(300, 16), 2))  # needs every free block
    t.run()
    t.assert_transparent()  # B read its shared blocks to the end


# -- prefix caching: preemption --------------------------------------------------------


@extended
@rule("prefix-preemption", "prefix-lru", "prefix-transparency")
def test_stage2_prefix_a_preempted_request_recomputes_from_the_cache() -> None:
    t = run_of(prefix_model(num_blocks=5), max_num_batched_tokens=8)
    t.submit(Request("A", toks(10, 4), 9))
    t.step()
    t.submit(Request("B", toks(20, 9), 5))
    for _ in range(4):
        t.step()
    out = t.step()
    check(
        out.preempted == ("B",),
        f"prefix-stage1 (preemption): at step 6 A needs a block and none is free: B, the "
        f"newest, gives way\n{t.rows()}",
    )
    t.run()
    resumed = t.outputs[9]  # step 10: A finished at step 9, and its blocks are free
    check(
        dict(resumed.scheduled) == {"B": 4} and t.hits["B"] == [0, 8],
        "prefix-preemption: B held two full blocks and a partial one when it was "
        "preempted; it released them last first, so A took the partial one and the two "
        "full ones stayed cached. B's recompute (its 9 prompt tokens and 3 it generated) "
        "shares them and computes 12 - 8 = 4 tokens, where stage 1 recomputes all 12; "
        f"step 10 scheduled {dict(resumed.scheduled)}, B's admissions were served "
        f"{t.hits['B']}\n{t.rows()}",
    )
    t.assert_transparent()
    check(
        {m.rid: m.preemptions for m in t.b.metrics()} == {"A": 0, "B": 1},
        f"prefix-stage1 (metrics): B was preempted once: {t.b.metrics()}",
    )


@extended
@rule("prefix-preemption", "prefix-hit", "prefix-statistics")
def test_stage2_prefix_a_preempted_request_shares_the_blocks_its_own_tokens_filled() -> None:
    t = run_of(prefix_model(num_blocks=5), max_num_batched_tokens=8)
    t.submit(Request("A", toks(10, 4), 9))
    t.step()
    t.submit(Request("B", toks(20, 2), 12))  # a prompt of 2: its full blocks are mostly its output
    t.run()
    step9, step10 = t.outputs[8], t.outputs[9]
    check(
        step9.preempted == ("B",),
        f"prefix-stage1 (preemption): at step 9 A needs a block and none is free: B, the "
        f"newest, gives way\n{t.rows()}",
    )
    check(
        dict(step10.scheduled) == {"B": 1} and t.hits["B"] == [0, 8],
        "prefix-preemption: B (prompt of 2) had 7 tokens out when it was preempted at "
        "step 9: its KV held 8 tokens, two full blocks filled by its prompt and its own "
        "generated tokens, cached and kept by the release. Its next admission (step 10) "
        "looks up the keys of its known tokens — prompt and generated — shares both blocks "
        "(8 tokens) and computes only its last known token. Expected step 10 to schedule "
        f"{{'B': 1}} and B's admissions served [0, 8]; got {dict(step10.scheduled)} and "
        f"{t.hits['B']}\n{t.rows()}",
    )
    stats = t.b.cache_statistics()
    check(
        (stats.lookups, stats.queried_tokens, stats.hit_tokens) == (3, 4 + 2 + 9, 8),
        "prefix-statistics: three admissions (A, B, B again) of 4, 2 and 9 known tokens, 8 "
        f"of them served from the cache; got {stats}",
    )
    t.assert_transparent()


@extended
@rule("prefix-hit", "prefix-transparency")
def test_stage2_prefix_a_lookup_stops_at_the_first_block_not_cached() -> None:
    """A key can stay cached behind one that is gone: B's third block (after the shared
    prefix P) outlives A's copies of P's blocks, which D evicts. C = P + B's next block +
    more must then share nothing: its lookup misses at block 0 and stops there."""
    t = run_of(prefix_model(num_blocks=10), max_num_seqs=4, max_num_batched_tokens=32)
    p, q, r = toks(100, 8), toks(50, 4), toks(60, 4)
    t.run(
        {
            1: [Request("A", p, 1), Request("B", (*p, *q, 9), 10)],
            2: [Request("D", toks(300, 24), 1)],
            3: [Request("C", (*p, *q, *r, 7), 3)],
        }
    )
    check(
        t.hits["C"] == [0],
        "prefix-hit: C's first block (P's first) is no longer cached, so its lookup stops "
        "there and shares nothing — not a later block whose key happens to be cached; C's "
        f"admissions were served {t.hits['C']} tokens\n{t.rows()}",
    )
    t.assert_transparent()


@extended
@rule("prefix-preemption", "prefix-stage1")
def test_stage2_prefix_victims_give_way_until_the_chunk_has_its_blocks() -> None:
    """Under priority, U's chunk needs two blocks and none is free: Y (the least
    important) frees one, which is not enough, so X gives way too."""
    t = run_of(
        prefix_model(num_blocks=6), max_num_seqs=4, max_num_batched_tokens=16, policy="priority"
    )
    t.run(
        {
            1: [Request("X", (1, 2), 10, priority=5), Request("Y", (3, 4), 10, priority=6)],
            2: [Request("U", toks(10, 24), 1, priority=0)],
        }
    )
    step3 = t.outputs[2]
    check(
        (dict(step3.scheduled), step3.preempted) == ({"U": 10}, ("Y", "X")),
        "prefix-preemption: at step 3 U's chunk (10 tokens) needs 2 blocks and none is "
        "free; victims are taken one at a time until it has them — Y, then X — expected "
        f"scheduled {{'U': 10}}, preempted ('Y', 'X'); got {dict(step3.scheduled)}, "
        f"{step3.preempted}\n{t.rows()}",
    )
    t.assert_transparent()


@extended
@rule("prefix-preemption", "prefix-stage1")
def test_stage2_prefix_a_victim_scheduled_earlier_gives_its_tokens_back() -> None:
    """Under priority, with nothing shared: at step 4 H's decode needs a block and none is
    free. V (the least important) was scheduled first in that step: it gives way, and its
    1 token goes back to the budget, so X's prompt, scheduled after H, gets 7 - 1 = 6
    tokens, as in stage 1 — not 5."""
    t = run_of(
        prefix_model(num_blocks=5), max_num_seqs=4, max_num_batched_tokens=7, policy="priority"
    )
    t.run(
        {
            1: [Request("V", toks(10, 4), 10, priority=9)],
            2: [Request("H", toks(20, 3), 10, priority=0)],
            3: [Request("X", toks(40, 16), 2, priority=0)],
        }
    )
    step4 = t.outputs[3]
    check(
        (dict(step4.scheduled), step4.preempted) == ({"H": 1, "X": 6}, ("V",)),
        "prefix-stage1: at step 4 H (priority 0) needs a block and none is free; V "
        "(priority 9), scheduled first in the step, gives way and its chunk leaves the step, "
        "its token back to the budget of those scheduled after: expected scheduled "
        f"{{'H': 1, 'X': 6}}, preempted ('V',); got {dict(step4.scheduled)}, "
        f"{step4.preempted}\n{t.rows()}",
    )
    t.assert_transparent()


# -- prefix caching: any workload ------------------------------------------------------

Case = tuple[dict[str, Any], dict[int, list[Request]], dict[int, str]]


@st.composite
def shared_prefix_workloads(draw: st.DrawFn) -> Case:
    """The harness's ``shared_prefixes`` workload (a few common prefixes, suffixes of
    their own), arriving over a few steps, on a pool from barely enough for the largest
    request (preemptions) to plenty, with a few aborts."""
    block_size = draw(st.integers(1, 4), label="block_size")
    seqs = draw(st.integers(1, 4), label="max_num_seqs")
    budget = draw(st.integers(seqs, 16), label="max_num_batched_tokens")
    n = draw(st.integers(2, 8), label="requests")
    workload = shared_prefixes(
        n, n_prefixes=draw(st.integers(1, 2)), prefix_len=draw(st.integers(0, 12)),
        mean_output=4, max_output=8, suffix_len=(1, 6), vocab_size=50,
        seed=draw(st.integers(0, 2**16), label="seed"),
    )  # fmt: skip
    arrivals: dict[int, list[Request]] = {}
    for r in workload:
        arrivals.setdefault(draw(st.integers(1, 6)), []).append(r)
    worst = max(ceil_div(len(r.prompt) + r.max_new_tokens - 1, block_size) for r in workload)
    config = {
        "num_blocks": draw(st.integers(worst, worst * 3), label="num_blocks"),
        "block_size": block_size,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": budget,
        "policy": draw(st.sampled_from(["fcfs", "priority"]), label="policy"),
    }
    rids = [r.rid for r in workload]
    aborts = draw(st.dictionaries(st.integers(1, 12), st.sampled_from(rids), max_size=2))
    return config, arrivals, aborts


def _config(num_blocks: int, budget: int = 16, block_size: int = 4) -> dict[str, Any]:
    return {"num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": 4,
            "max_num_batched_tokens": budget, "policy": "fcfs"}  # fmt: skip


#: The preemption test's run: B is preempted holding two full blocks and a partial one.
PREEMPTED: Case = (
    _config(5, budget=8),
    {1: [Request("A", toks(10, 4), 9)], 2: [Request("B", toks(20, 9), 5)]},
    {},
)
#: The abort test's run: A, sharing S with B, is aborted while both decode.
ABORTED: Case = (
    _config(7),
    {1: [Request("A", (*S, 1), 8)], 2: [Request("B", (*S, 2), 8)],
     3: [Request("C", toks(300, 16), 2)]},
    {3: "A"},
)  # fmt: skip
#: Three sharers of S on a pool so tight that they preempt one another.
CROWDED: Case = (
    _config(6, budget=8),
    {1: [Request("A", (*S, 1), 9)], 2: [Request("B", (*S, 2), 9), Request("C", S, 9)]},
    {},
)  # fmt: skip


@extended
@rule("prefix-transparency", "prefix-stage1", "prefix-refcount", "prefix-no-shared-writes")
@given(case=shared_prefix_workloads())
@example(case=PREEMPTED)
@example(case=ABORTED)
@example(case=CROWDED)
@settings(max_examples=examples(at_ci=100))
def test_stage2_prefix_any_shared_prefix_workload_keeps_every_output(case: Case) -> None:
    config, arrivals, aborts = case
    config = dict(config)  # an explicit example's dict is reused
    t = run_of(prefix_model(config.pop("num_blocks"), config.pop("block_size")), **config)
    t.run(arrivals, aborts, max_steps=600)
    never = set(t.submitted) - set(t.finished)
    check(not never, f"prefix-stage1 (finish): every request finishes once; never: {never}")
    reasons = {m.rid: m.finish_reason for m in t.b.metrics()}
    check(
        reasons == t.finished and len(t.b.metrics()) == len(t.finished),
        f"prefix-stage1 (metrics): metrics() lists each finished request once, with its "
        f"reason: expected {t.finished}, got {reasons}",
    )
    check(
        t.b.free_blocks() == t.m.num_blocks,
        f"prefix-refcount: with every request finished, every block is free (cached or "
        f"not): free_blocks() is {t.b.free_blocks()} of {t.m.num_blocks}",
    )
    t.assert_transparent()


@st.composite
def distinct_prompt_runs(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[int, str, Any]]]:
    """Requests whose prompts share no first token, on a pool with room for all of them
    at their longest (nobody is preempted, so nothing is ever looked up twice): what
    happens before each step — submissions (some with a priority, a stop token or a
    deadline) and aborts."""
    config = draw_run_config(draw)
    block_size = config["block_size"]
    events: list[tuple[int, str, Any]] = []
    pool = 0
    for i in range(draw(st.integers(1, 8), label="requests")):
        prompt, new = toks(100 * i + 1, draw(st.integers(1, 14))), draw(st.integers(1, 8))
        pool += ceil_div(len(prompt) + new - 1, block_size)
        at = draw(st.integers(1, 8))
        r = draw_submission(draw, Request(f"r{i}", prompt, new), at, block_size)
        events.append((at, "submit", r))
        if draw(st.integers(0, 4)) == 0:
            events.append((at + draw(st.integers(0, 6)), "abort", r.rid))
    config["num_blocks"] = pool
    return config, sorted(events, key=lambda e: (e[0], e[1] == "abort"))


@extended
@rule("prefix-hit", "prefix-stage1")
def test_stage2_prefix_a_waiting_request_that_does_not_fit_holds_back_those_behind_it() -> None:
    """4 blocks of 4. r0 runs and takes its third block at step 2; r1, whose first chunk
    needs 3 blocks, waits at the head of the queue with one block free. r2 behind it would
    fit that block — but admissions end at the first request that does not fit, as in
    stage 1: nobody overtakes."""
    t = run_of(prefix_model(4, 4), max_num_seqs=4, max_num_batched_tokens=16)
    t.submit(Request("r0", toks(1, 8), 4))
    t.step()  # r0's prompt, 2 blocks
    t.submit(Request("r1", toks(100, 12), 4), Request("r2", toks(200, 2), 2))
    t.step()  # r0 decodes into a third block: 1 free, r1 needs 3
    check(
        (t.b.running(), t.b.waiting()) == (["r0"], ["r1", "r2"]),
        "prefix-hit: after step 2, r0 runs (3 of 4 blocks) and r1 (3 blocks to start) "
        "waits at the head: admissions end there, so r2 waits too, though it would fit the "
        f"free block. Expected running ['r0'], waiting ['r1', 'r2']; got running "
        f"{t.b.running()}, waiting {t.b.waiting()}\n{t.rows()}",
    )


@extended
@rule("prefix-stage1")
@given(case=distinct_prompt_runs())
@settings(max_examples=examples(at_ci=60))
def test_stage2_prefix_with_nothing_shared_every_step_is_stage_ones(
    case: tuple[dict[str, Any], list[tuple[int, str, Any]]],
) -> None:
    config, events = case
    config = dict(config)
    block_size = config["block_size"]
    outputs = {r.rid: unbatched(r, block_size) for _, kind, r in events if kind == "submit"}
    rules = BatchingRules(outputs, **config)
    story = Story(f"a run of {config}, each step at n * {STEP_NS} ns:", lambda: n * STEP_NS)
    t = run_of(prefix_model(config.pop("num_blocks"), config.pop("block_size")), **config)
    last = max(at for at, _, _ in events)
    for n in range(1, 400):
        for at, kind, what in events:
            if at == n and kind == "submit":
                t.submit(what)
                rules.submit(what)
                story.add(f"before step {n}: submit {what}")
            elif at == n and what not in t.finished:
                t.abort(what)
                rules.abort(what)
                story.add(f"before step {n}: abort {what}")
        if n > last and not t.b.has_unfinished():
            break
        got = step_of(t.step())
        want = rules.step(n * STEP_NS)
        story.expect(
            got,
            want,
            f"prefix-stage1: with no prompt sharing a block, step {n} must be the one stage 1's "
            "rules make",
        )
        story.add(f"step {n}: scheduled {want.scheduled}, preempted {list(want.preempted)}, "
                  f"emitted {want.emitted}, finished {want.finished}")  # fmt: skip
    check(not t.b.has_unfinished(), f"liveness: unfinished after 400 steps\n{t.rows()[-2000:]}")


TestStage2PrefixCacheMatchesTheModel = extended(
    rule(
        "prefix-keys", "prefix-hit", "prefix-last-token", "prefix-no-shared-writes",
        "prefix-refcount", "prefix-lru", "prefix-preemption", "prefix-statistics",
        "prefix-stage1",
    )(walked(PrefixCacheMachine, PREFIX_WALKS))
)  # fmt: skip
TestStage2PrefixCacheMatchesTheModel.settings = settings(stateful_step_count=40)


# -- prefix caching: bad input ---------------------------------------------------------


@extended
@rule("prefix-bad-input")
@pytest.mark.parametrize(
    ("name", "options"),
    [
        *bad_configurations(num_blocks=16),
        pytest.param("max_num_seqs", {"max_num_seqs": True}, id="seqs-a-bool"),
    ],
)
def test_stage2_prefix_bad_configurations_are_refused_by_name(
    name: str, options: dict[str, Any]
) -> None:
    config = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "num_blocks": 16, "block_size": 4}
    batcher = partial(stage().PrefixCachingBatcher, prefix_model())
    expect_refused_by_name(batcher, config, name, options, "prefix-bad-input")


@extended
@rule("prefix-bad-input", "prefix-stage1")
@pytest.mark.parametrize(("options", "requests"), accepted_configurations())
def test_stage2_prefix_configurations_at_the_boundary_are_accepted_and_serve(
    options: dict[str, Any], requests: int
) -> None:
    config = {"max_num_seqs": 4, "max_num_batched_tokens": 16, **options}
    try:
        t = run_of(prefix_model(), **config)
    except (ValueError, TypeError) as exc:
        raise AssertionError(
            f"prefix-bad-input: {config} is a valid configuration (max_num_batched_tokens "
            f"may equal max_num_seqs, as in stage 1), got {exc!r}"
        ) from None
    t.run({1: [Request(f"r{i}", (*S, i), 4) for i in range(requests)]})
    check(len(t.finished) == requests, f"every request finishes: {t.finished}")
    t.assert_transparent()


@extended
@rule("prefix-bad-input")
def test_stage2_prefix_submit_rejects_duplicates_and_requests_that_could_never_finish() -> None:
    t = run_of(prefix_model(num_blocks=4))
    t.submit(Request("A", S, 9))  # 8 + 9 - 1 = 16 tokens in KV at most: the whole pool
    with pytest.raises(RequestRejected, match="A"):
        t.b.submit(Request("A", S, 2))
    with pytest.raises(RequestRejected, match="big"):
        t.b.submit(Request("big", S, 10))  # 17 tokens: 5 blocks of 4 > 4
    t.run()
    t.submit(Request("again", S, 9))  # S is cached: the same bound, and it still just fits
    with pytest.raises(RequestRejected, match="A"):
        t.b.submit(Request("A", S, 1))  # finished, still an id already submitted
    t.run()
    check(
        t.finished == {"A": "length", "again": "length"} and t.hits["again"] == [4],
        f"prefix-bad-input: a refused request changes nothing; A and again finish, again "
        f"served S's first block from the cache; finished {t.finished}, hits {t.hits}",
    )
    t.assert_transparent()
