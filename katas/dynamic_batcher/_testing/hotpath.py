"""Drivers for the C hot path's suite (``-k hotpath``): csrc/hotpath.h's three calls
through the binding, and the same rules in plain Python to compare them with.

:func:`c_fill`, :func:`c_schedule` and :func:`c_apply` call the implementation's
``_hotpath`` module on ``array("i")`` columns, every output column filled first with
:data:`UNWRITTEN` (a value no correct call leaves behind), and read back what it wrote;
:func:`fill_model`, :func:`schedule_model` and :func:`apply_model` are
``hp_fill_token_budget``, ``hp_schedule`` and ``hp_apply`` written from the rules,
slowly and plainly, on a :class:`HotState` (the columns of ``hp_state`` as lists). The
strategies draw valid states and steps around every boundary; the fixed states below
are the boundaries random draws reach only sometimes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from hypothesis import strategies as st

from katas._harness.story import check, expect
from katas._harness.under_test import module

INT_MAX = 2**31 - 1
#: What an output column holds before a call: a value no correct call leaves behind.
UNWRITTEN = -7


def c_fill(need: list[int], token_budget: int, max_seqs: int) -> tuple[list[int], int, int]:
    """Call the implementation; return (chunks, requests scheduled, tokens scheduled)."""
    chunk = array("i", [UNWRITTEN] * len(need))
    seqs, tokens = module("_hotpath").fill_token_budget(
        array("i", need), chunk, token_budget=token_budget, max_seqs=max_seqs
    )
    return chunk.tolist(), seqs, tokens


def fill_model(need: list[int], token_budget: int, max_seqs: int) -> tuple[list[int], int, int]:
    """The rules in plain Python: in order, each request clamped to the budget left."""
    chunks = [0] * len(need)
    left = token_budget
    seqs = 0
    for i, tokens in enumerate(need):
        if seqs == max_seqs or left == 0:
            break
        chunks[i] = min(tokens, left)
        left -= chunks[i]
        seqs += 1
    return chunks, seqs, token_budget - left


def check_fill(need: list[int], token_budget: int, max_seqs: int, expected: object) -> None:
    """``fill_token_budget`` on these columns returns ``expected`` (chunk, seqs, tokens)."""
    expect(
        c_fill(need, token_budget, max_seqs),
        expected,
        f"fill_token_budget(need={need}, token_budget={token_budget}, max_seqs={max_seqs}): "
        "(chunk, seqs, tokens)",
    )


# -- random columns

token_counts = st.one_of(st.integers(1, 3), st.integers(1, 600), st.integers(1, INT_MAX))
budgets = st.one_of(st.integers(0, 3), st.integers(0, 2_000), st.integers(0, INT_MAX))


@st.composite
def hot_steps(draw: st.DrawFn) -> tuple[list[int], int, int]:
    """A step: the columns, a budget, and a cap drawn around the number of requests (so
    the cap, the budget and the end of the array each end some steps)."""
    need = draw(st.lists(token_counts, max_size=64))
    cap = draw(st.one_of(st.integers(0, len(need) + 1), st.integers(0, 80)))
    return need, draw(budgets), cap


# -- schedule, blocks included


@dataclass
class HotState:
    """The columns of csrc/hotpath.h's hp_state, as plain lists (row i: the i-th running)."""

    known: list[int]
    computed: list[int]
    held: list[int]
    table: list[int]
    free_ids: list[int]
    n: int
    free_top: int
    stride: int
    block_size: int

    def copy(self) -> HotState:
        return HotState(list(self.known), list(self.computed), list(self.held),
                        list(self.table), list(self.free_ids), self.n, self.free_top,
                        self.stride, self.block_size)  # fmt: skip


#: What hp_schedule returns: (chunk, rows scheduled, tokens, rows preempted).
Scheduled = tuple[list[int], int, int, int]


def schedule_model(s: HotState, token_budget: int, max_seqs: int) -> tuple[Scheduled, HotState]:
    """hp_schedule's rules in plain Python, on a copy of the state."""
    s = s.copy()
    chunk = [0] * len(s.known)
    left, seqs, preempted = token_budget, 0, 0
    while seqs < s.n and seqs < max_seqs and left > 0:
        i = seqs
        granted = min(s.known[i] - s.computed[i], left)
        missing = -(-(s.computed[i] + granted) // s.block_size) - s.held[i]
        while missing > s.free_top:
            s.n -= 1
            victim = s.n
            row = s.table[victim * s.stride : victim * s.stride + s.held[victim]]
            for block in reversed(row):
                s.free_ids[s.free_top] = block
                s.free_top += 1
            s.held[victim] = s.computed[victim] = 0
            preempted += 1
            if victim == i:
                return (chunk, seqs, token_budget - left, preempted), s
        for _ in range(missing):
            s.free_top -= 1
            s.table[i * s.stride + s.held[i]] = s.free_ids[s.free_top]
            s.held[i] += 1
        chunk[i] = granted
        left -= granted
        seqs += 1
    return (chunk, seqs, token_budget - left, preempted), s


def c_columns(s: HotState) -> list[array[int]]:
    """The state's columns as the binding takes them (known, computed, held, table, free_ids)."""
    return [array("i", c) for c in (s.known, s.computed, s.held, s.table, s.free_ids)]


def c_state(cols: list[array[int]], s: HotState, n: int, free_top: int) -> HotState:
    """The state the binding left in ``cols`` (``s`` for the sizes)."""
    known, computed, held, table, free_ids = (c.tolist() for c in cols)
    return HotState(known, computed, held, table, free_ids, n, free_top, s.stride, s.block_size)


def c_schedule(s: HotState, token_budget: int, max_seqs: int) -> tuple[Scheduled, HotState]:
    cols = c_columns(s)
    chunk = array("i", [UNWRITTEN] * len(s.known))
    seqs, tokens, preempted, n, free_top = module("_hotpath").schedule(
        *cols, chunk, n=s.n, free_top=s.free_top, stride=s.stride, block_size=s.block_size,
        token_budget=token_budget, max_seqs=max_seqs,
    )  # fmt: skip
    return (chunk.tolist(), seqs, tokens, preempted), c_state(cols, s, n, free_top)


#: Row 1 needs a block with none free: row 2 gives way (it holds none), then row 1 itself.
OWN_VICTIM = HotState([5, 3, 1], [4, 2, 0], [2, 1, 0], [0, 1, 0, 2, 0, 0, 0, 0, 0],
                      [3, 0, 0, 0], n=3, free_top=1, stride=3, block_size=2)  # fmt: skip
#: Row 0 is missing 3 blocks with 1 free: row 1 gives back its two, 7 then 6, so 6 is on
#: top; row 0's table must then read 5, 6, 7, 8 (the order of the pushes and the pops).
RELEASE_ORDER = HotState([4, 3], [1, 2], [1, 2], [5, 0, 0, 0, 6, 7, 0, 0], [8, 0, 0, 0],
                         n=2, free_top=1, stride=4, block_size=1)  # fmt: skip


@st.composite
def hot_states(draw: st.DrawFn) -> tuple[HotState, int, int]:
    """A valid state: running rows part-way through their tokens, the pool's other blocks
    on the free stack (sometimes none to spare), a budget and a cap."""
    block_size = draw(st.integers(1, 4))
    rows = draw(st.integers(0, 8))
    n = draw(st.integers(0, rows))
    known = [draw(st.integers(1, 12)) for _ in range(rows)]
    computed = [draw(st.integers(0, k - 1)) for k in known]
    stride = max([-(-k // block_size) for k in known], default=1)
    held = [-(-c // block_size) if i < n else 0 for i, c in enumerate(computed)]
    computed = [c if i < n else 0 for i, c in enumerate(computed)]
    spare = draw(st.integers(0, 6))
    ids = draw(st.permutations(range(sum(held) + spare)))
    table = [0] * (rows * stride)
    at = 0
    for i in range(n):
        table[i * stride : i * stride + held[i]] = ids[at : at + held[i]]
        at += held[i]
    free_ids = list(ids[at:]) + [0] * (len(ids) - len(ids[at:]))
    state = HotState(known, computed, held, table, free_ids, n, spare, stride, block_size)
    return state, draw(st.integers(0, 30)), draw(st.integers(0, rows + 1))


def schedule_is_accepted() -> None:
    """The state as it should be is not refused: the refusal was for the broken entry.

    Whether it is then scheduled right is the schedule-blocks and schedule-preempt rules'
    (test_hotpath_schedule_matches_the_model_on_random_states runs this very state), so
    a bug in the blocks is reported there, not as a broken validation."""
    refused: ValueError | None = None
    try:
        c_schedule(OWN_VICTIM, 10, 4)
    except ValueError as exc:
        refused = exc
    check(
        refused is None,
        f"schedule-invalid: the valid state {OWN_VICTIM} (token_budget=10, max_seqs=4) "
        f"must be scheduled, not refused: {refused}",
    )


# -- apply


def apply_model(s: HotState, seqs: int, chunk: list[int], finished: list[int]) -> HotState:
    """hp_apply's rules in plain Python, on a copy of the state."""
    s = s.copy()
    for i in range(seqs):
        s.computed[i] += chunk[i]
        if s.computed[i] == s.known[i] and not finished[i]:
            s.known[i] += 1  # the token sampled after the known ones
    for i in range(s.n):
        if finished[i]:
            for block in reversed(s.table[i * s.stride : i * s.stride + s.held[i]]):
                s.free_ids[s.free_top] = block
                s.free_top += 1
    kept = [i for i in range(s.n) if not finished[i]]
    rows = [(s.known[i], s.computed[i], s.held[i], s.table[i * s.stride : i * s.stride + s.held[i]])
            for i in kept]  # fmt: skip
    for j, (known, computed, held, blocks) in enumerate(rows):
        s.known[j], s.computed[j], s.held[j] = known, computed, held
        s.table[j * s.stride : j * s.stride + held] = blocks
    s.n = len(kept)
    return s


def live(s: HotState) -> dict[str, object]:
    """What hp_apply specifies of a state: the rows in use, their blocks, the free stack."""
    rows = range(s.n)
    return {
        "n": s.n,
        "known": s.known[: s.n],
        "computed": s.computed[: s.n],
        "held": s.held[: s.n],
        "blocks": [s.table[i * s.stride : i * s.stride + s.held[i]] for i in rows],
        "free": s.free_ids[: s.free_top],
    }


def c_apply(s: HotState, seqs: int, chunk: list[int], finished: list[int]) -> HotState:
    cols = c_columns(s)
    n, free_top = module("_hotpath").apply(
        *cols, array("i", chunk), array("i", finished), n=s.n, free_top=s.free_top,
        stride=s.stride, block_size=s.block_size, seqs=seqs,
    )  # fmt: skip
    return c_state(cols, s, n, free_top)


#: After a schedule of rows 0-2 (bs 2): row 0 samples at its table row's end and finishes
#: (its length), row 1 samples and goes on, row 2 is part-way through its prompt and
#: aborted, row 3 was not scheduled. The stack must read 7, 8, 2, 1, 5 (row 0's blocks last
#: first, then row 2's), and rows 1 and 3 move down to 0 and 1 with their blocks.
APPLY_STEP = (
    HotState([6, 3, 6, 2], [3, 2, 0, 1], [3, 2, 1, 1], [1, 2, 8, 3, 4, 0, 5, 0, 0, 6, 0, 0],
             [7, 0, 0, 0, 0, 0, 0, 0], n=4, free_top=1, stride=3, block_size=2),
    3, [3, 1, 2, 0], [1, 0, 1, 0],
)  # fmt: skip


@st.composite
def hot_steps_done(draw: st.DrawFn) -> tuple[HotState, int, list[int], list[int]]:
    """A state right after hp_schedule (by the model), the chunks it granted and the rows
    that finish; a row that samples at its table row's end always finishes (its length)."""
    state, token_budget, max_seqs = draw(hot_states())
    (chunk, seqs, _, _), s = schedule_model(state, token_budget, max_seqs)
    finished = [draw(st.integers(0, 1)) for _ in s.known]
    for i in range(seqs):
        samples = s.computed[i] + chunk[i] == s.known[i]
        if samples and -(-(s.known[i] + 1) // s.block_size) > s.stride:
            finished[i] = 1
    return s, seqs, chunk, finished


def apply_is_accepted() -> None:
    """The step as it should be is not refused: the refusal was for the broken entry.

    (Whether it is applied right is the apply-compute and apply-release rules': the model
    test runs this very step, and reports a bug there, not as a broken validation.)"""
    refused: ValueError | None = None
    try:
        c_apply(*APPLY_STEP)
    except ValueError as exc:
        refused = exc
    check(
        refused is None,
        f"apply-invalid: the valid step {APPLY_STEP} must be applied, not refused: {refused}",
    )


#: One row a token short of INT32_MAX in a single block of INT32_MAX tokens, and one that
#: knows INT32_MAX tokens in blocks of 2**30 (so ceil needs no + block_size - 1).
EDGE = HotState([INT_MAX, INT_MAX], [INT_MAX - 1, 0], [2, 0], [0, 1, 0, 0], [3, 2, 0, 0],
                n=2, free_top=2, stride=2, block_size=2**30)  # fmt: skip


__all__ = [
    "APPLY_STEP",
    "EDGE",
    "INT_MAX",
    "OWN_VICTIM",
    "RELEASE_ORDER",
    "UNWRITTEN",
    "HotState",
    "Scheduled",
    "apply_is_accepted",
    "apply_model",
    "budgets",
    "c_apply",
    "c_columns",
    "c_fill",
    "c_schedule",
    "c_state",
    "check_fill",
    "fill_model",
    "hot_states",
    "hot_steps",
    "hot_steps_done",
    "live",
    "schedule_is_accepted",
    "schedule_model",
    "token_counts",
]
