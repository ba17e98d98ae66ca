"""The C hot path's build chain: both ``_hotpath`` modules import, the reference is right.

These are repository checks, so they may import ``solutions``. They need the extension
modules built (``pip install -e .``); the C unit test itself runs under ``ctest``.
"""

from __future__ import annotations

import filecmp
import os
from array import array
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from katas._registry.impl import REPO_ROOT

try:
    from katas.dynamic_batcher import _hotpath as stub
    from solutions.dynamic_batcher import _hotpath as reference
except ImportError as exc:
    # Say what to do, not just which name is missing. CI must have built the modules; a
    # checkout that has not yet skips this file instead of stopping the whole run.
    hint = f"{exc}: build the C hot path first (`pip install -e .` from the repository root)"
    if os.environ.get("CI"):
        raise ImportError(hint) from exc
    pytest.skip(hint, allow_module_level=True)

INT_MAX = 2**31 - 1
#: Where the stub's error sends the learner: the contract of the unwritten function.
CONTRACT = "katas/dynamic_batcher/csrc/hotpath.h"


def column(values: list[int]) -> array[int]:
    return array("i", values)


def fill(need: list[int], token_budget: int, max_seqs: int) -> tuple[list[int], int, int]:
    """Run the reference; return (chunks, requests scheduled, tokens scheduled)."""
    chunk = column([-1] * len(need))
    seqs, tokens = reference.fill_token_budget(
        column(need), chunk, token_budget=token_budget, max_seqs=max_seqs
    )
    return chunk.tolist(), seqs, tokens


def model(need: list[int], token_budget: int, max_seqs: int) -> tuple[list[int], int, int]:
    """The contract in plain Python: FCFS, each request clamped to the budget left."""
    chunks: list[int] = []
    left, seqs = token_budget, 0
    for tokens in need:
        if seqs == max_seqs or left == 0:
            chunks.append(0)
            continue
        granted = min(tokens, left)
        chunks.append(granted)
        left -= granted
        seqs += 1
    return chunks, seqs, token_budget - left


# --- the build ------------------------------------------------------------------------


def test_both_modules_import_from_their_own_package() -> None:
    assert stub.__name__ == "katas.dynamic_batcher._hotpath"
    assert reference.__name__ == "solutions.dynamic_batcher._hotpath"
    stub_file, reference_file = Path(str(stub.__file__)), Path(str(reference.__file__))
    assert stub_file != reference_file, "the stub and the reference must be two builds"
    assert stub_file.parent.name == reference_file.parent.name == "dynamic_batcher"
    assert (
        (stub.TYPECODE, stub.INT_MAX) == (reference.TYPECODE, reference.INT_MAX) == ("i", INT_MAX)
    )


@pytest.mark.parametrize("name", ["_hotpath.pyi"])
def test_stub_and_reference_share_the_abi_and_binding(name: str) -> None:
    # The learner writes only csrc/hotpath.c; hotpath.h and module.c exist once (CMake
    # builds both modules from katas/dynamic_batcher/csrc), and the type stubs match.
    katas_file = REPO_ROOT / "katas" / "dynamic_batcher" / name
    solutions_file = REPO_ROOT / "solutions" / "dynamic_batcher" / name
    assert filecmp.cmp(katas_file, solutions_file, shallow=False), (
        f"katas/dynamic_batcher/{name} and solutions/dynamic_batcher/{name} differ"
    )


def test_stub_raises_not_implemented_naming_the_function_and_the_contract() -> None:
    with pytest.raises(NotImplementedError) as excinfo:
        stub.fill_token_budget(column([1, 2]), column([0, 0]), token_budget=3, max_seqs=2)
    message = str(excinfo.value)
    assert message == f"dynamic_batcher._hotpath.fill_token_budget — hotpath, see {CONTRACT}"
    assert (REPO_ROOT / CONTRACT).is_file(), f"the stub's message points at {CONTRACT}, not a file"


# --- the reference: examples ------------------------------------------------------------


@pytest.mark.parametrize(
    ("need", "token_budget", "max_seqs", "expected"),
    [
        pytest.param([5, 1, 1], 4, 8, ([4, 0, 0], 1, 4), id="long-prefill-gets-a-partial-chunk"),
        pytest.param([1, 1, 1, 1], 10, 3, ([1, 1, 1, 0], 3, 3), id="max-seqs-caps-the-batch"),
        pytest.param([3, 2], 5, 2, ([3, 2], 2, 5), id="exact-fit"),
        pytest.param([8, 1], 8, 4, ([8, 0], 1, 8), id="no-skipping-ahead-of-a-big-request"),
        pytest.param([1, 1, 100, 7], 10, 4, ([1, 1, 8, 0], 3, 10), id="decodes-then-a-chunk"),
        pytest.param([1, 1, 100, 7], 0, 4, ([0, 0, 0, 0], 0, 0), id="zero-budget"),
        pytest.param([1, 1, 100, 7], 10, 0, ([0, 0, 0, 0], 0, 0), id="zero-max-seqs"),
        pytest.param([], 10, 4, ([], 0, 0), id="no-requests"),
        pytest.param([INT_MAX, 1], INT_MAX, INT_MAX, ([INT_MAX, 0], 1, INT_MAX), id="int32-max"),
    ],
)
def test_reference_fills_the_token_budget_in_order(
    need: list[int], token_budget: int, max_seqs: int, expected: tuple[list[int], int, int]
) -> None:
    got = fill(need, token_budget, max_seqs)
    assert got == expected, (
        f"need={need} token_budget={token_budget} max_seqs={max_seqs}: "
        f"expected (chunks, seqs, tokens)={expected}, got {got}"
    )


def test_reference_accepts_any_int32_buffer() -> None:
    # Raw bytes are accepted once cast to int32; the output may be any writable buffer.
    need = memoryview(array("i", [2, 3]).tobytes()).cast("i")
    out = bytearray(8)
    assert reference.fill_token_budget(
        need, memoryview(out).cast("i"), token_budget=4, max_seqs=2
    ) == (2, 4)
    assert array("i", bytes(out)).tolist() == [2, 2]


# --- the reference: properties ----------------------------------------------------------

token_counts = st.one_of(st.integers(1, 3), st.integers(1, 600), st.integers(1, INT_MAX))
cases = st.tuples(
    st.lists(token_counts, max_size=64),
    st.one_of(st.integers(0, 3), st.integers(0, 2_000), st.integers(0, INT_MAX)),
    st.integers(0, 80),
)


@given(cases)
def test_reference_matches_the_python_model(case: tuple[list[int], int, int]) -> None:
    need, token_budget, max_seqs = case
    got, expected = fill(need, token_budget, max_seqs), model(need, token_budget, max_seqs)
    assert got == expected, (
        f"need={need} token_budget={token_budget} max_seqs={max_seqs}: "
        f"model says {expected}, C says {got}"
    )


@given(cases)
def test_reference_respects_the_caps_and_serves_a_prefix(case: tuple[list[int], int, int]) -> None:
    need, token_budget, max_seqs = case
    chunks, seqs, tokens = fill(need, token_budget, max_seqs)
    where = f"need={need} token_budget={token_budget} max_seqs={max_seqs} -> {chunks}"
    assert sum(chunks) == tokens <= token_budget, f"token budget exceeded: {where}"
    assert seqs <= max_seqs, f"more than max_seqs requests scheduled: {where}"
    assert all(c > 0 for c in chunks[:seqs]) and not any(chunks[seqs:]), (
        f"the scheduled requests are not the first {seqs}: {where}"
    )
    assert all(chunks[i] == need[i] for i in range(seqs - 1)), (
        f"only the last scheduled request may get a partial chunk: {where}"
    )
    if seqs < min(len(need), max_seqs):
        assert tokens == token_budget, f"a request waits while budget is left: {where}"


# --- the reference: bad input -----------------------------------------------------------

# (argument, a maker of its bad value — buffers are made fresh per test, exception, message)
BAD_INPUT: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("token_budget", lambda: -1, ValueError, r"token_budget must be an int in \[0, 2147483647\]"),
    ("max_seqs", lambda: -1, ValueError, r"max_seqs must be an int in \[0, 2147483647\], got -1"),
    (
        "token_budget",
        lambda: 2**31,
        ValueError,
        r"token_budget must be an int in \[0, 2147483647\]",
    ),
    ("max_seqs", lambda: True, TypeError, "max_seqs must be an int, got bool"),
    ("token_budget", lambda: 4.0, TypeError, "token_budget must be an int, got float"),
    ("need", lambda: [1, 2, 3], TypeError, r"need must be a buffer of int32 items .*got list"),
    ("need", lambda: array("q", [1, 2, 3]), ValueError, "need must hold native int32 .*size 8"),
    ("need", lambda: array("I", [1, 2, 3]), ValueError, "need must hold native int32 .*'I'"),
    ("need", lambda: bytes(12), ValueError, r"need must hold native int32 .*cast\('i'\)"),
    ("need", lambda: column([1, 0, 3]), ValueError, r"need\[1\] must be >= 1 .*got 0"),
    ("need", lambda: column([1, 2, -5]), ValueError, r"need\[2\] must be >= 1 .*got -5"),
    ("chunk", lambda: column([0, 0]), ValueError, r"chunk must have as many items as need \(3\)"),
    ("chunk", lambda: memoryview(bytes(12)).cast("i"), ValueError, "chunk must be a writable"),
    ("chunk", lambda: memoryview(column([0] * 6))[::2], ValueError, "chunk must be a C-contig"),
    (
        "chunk",
        lambda: memoryview(column([0] * 6)).cast("B").cast("i", [3, 2]),
        ValueError,
        "chunk must be one-dimensional, got 2 dimensions",
    ),
]


@pytest.mark.parametrize(
    ("name", "make_value", "error", "match"),
    [pytest.param(*case, id=f"{case[0]}-{i}") for i, case in enumerate(BAD_INPUT)],
)
def test_reference_rejects_bad_input_naming_the_parameter(
    name: str, make_value: Callable[[], object], error: type[Exception], match: str
) -> None:
    out = column([-1, -1, -1])
    call: dict[str, object] = {"need": column([1, 2, 3]), "chunk": out}
    call |= {"token_budget": 4, "max_seqs": 2, name: make_value()}
    with pytest.raises(error, match=match):
        reference.fill_token_budget(**call)  # type: ignore[arg-type]
    assert out.tolist() == [-1, -1, -1], f"a call rejected for {name} must not write chunk"


def test_reference_rejects_an_output_that_overlaps_the_input() -> None:
    need = column([1, 2, 3, 4])
    view = memoryview(need)
    with pytest.raises(ValueError, match="chunk must not share memory with need"):
        reference.fill_token_budget(view[:3], view[1:], token_budget=4, max_seqs=2)
    assert need.tolist() == [1, 2, 3, 4], "a rejected call must not write its output"
