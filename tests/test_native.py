"""C katas: the build chain and the CPython binding (the learner's rules: the kata suite).

Each implementation's C module is built from its own sources on import
(:mod:`katas._runtime.native`), so the stub and the reference are two builds, a compile
error in one never reaches the other, and the stub says "not implemented" in one line.
The binding (``module.c``, shared by both) checks every buffer and scalar itself: those
checks run here, on the reference. The C unit test runs under ``ctest``.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from katas._registry.impl import REPO_ROOT, Selection, resolve
from katas._runtime import native
from katas._runtime.todo import Todo
from katas.dynamic_batcher import _hotpath as stub
from solutions.dynamic_batcher import _hotpath as reference

INT_MAX = 2**31 - 1
#: Where the stub's error sends the learner: the contract of the unwritten function.
CONTRACT = "katas/dynamic_batcher/csrc/hotpath.h"


def column(values: list[int]) -> array[int]:
    return array("i", values)


# --- the build ------------------------------------------------------------------------


def test_both_modules_import_from_their_own_build() -> None:
    assert stub.__name__ == "katas.dynamic_batcher._hotpath"
    assert reference.__name__ == "solutions.dynamic_batcher._hotpath"
    stub_file, reference_file = Path(str(stub.__file__)), Path(str(reference.__file__))
    assert stub_file.is_relative_to(native.BUILD_ROOT / "katas"), stub_file
    assert reference_file.is_relative_to(native.BUILD_ROOT / "solutions"), reference_file
    assert (
        (stub.TYPECODE, stub.INT_MAX) == (reference.TYPECODE, reference.INT_MAX) == ("i", INT_MAX)
    )


def test_one_type_stub_and_the_contract_in_the_header() -> None:
    # The reference's .pyi only re-exports the kata's: the contract is hotpath.h.
    kata_dir, reference_dir = (
        REPO_ROOT / "katas/dynamic_batcher",
        REPO_ROOT / "solutions/dynamic_batcher",
    )
    assert (
        (reference_dir / "_hotpath.pyi")
        .read_text()
        .strip()
        .endswith("from katas.dynamic_batcher._hotpath import *  # noqa: F403")
    )
    assert "see csrc/hotpath.h" in (kata_dir / "_hotpath.pyi").read_text()
    assert not (reference_dir / "csrc/hotpath.h").exists()
    assert not (reference_dir / "csrc/module.c").exists()


def test_stub_raises_todo_naming_the_function_and_the_contract() -> None:
    with pytest.raises(Todo) as excinfo:
        stub.fill_token_budget(column([1, 2]), column([0, 0]), token_budget=3, max_seqs=2)
    message = str(excinfo.value)
    assert message == f"hp_fill_token_budget — see {CONTRACT}"
    assert (REPO_ROOT / CONTRACT).is_file(), f"the stub's message points at {CONTRACT}, not a file"


def hotpath(selection: Selection) -> Any:
    """The implementation's C module (importing it builds it)."""
    return importlib.import_module(f"{selection.package}.dynamic_batcher._hotpath")


def test_a_compile_error_is_its_own_implementations_import_error(tmp_path: Path) -> None:
    # A copy of the reference whose C does not compile: importing its module fails with
    # the compiler's words, and the reference (built in a tree of its own) still loads.
    broken = tmp_path / "impl"
    shutil.copytree(REPO_ROOT / "solutions", broken, ignore=shutil.ignore_patterns("__pycache__"))
    source = broken / "dynamic_batcher/csrc/hotpath.c"
    source.write_text(source.read_text().replace("hp_int left = token_budget;", "hp_int left ="))
    selection = resolve(str(broken))
    with pytest.raises(native.BuildError) as excinfo:
        hotpath(selection)
    message = str(excinfo.value)
    assert "does not build" in message and "error" in message, message
    assert str(source.parent) in message, f"the error must name the C it built: {message}"
    assert hotpath(resolve("solutions")).fill_token_budget(
        column([2]), column([0]), token_budget=1, max_seqs=1
    ) == (1, 1)


#: Run in a fresh process (a process keeps the first build of a module it loaded): the
#: chunk the implementation at argv[1] grants a request needing 5 under a budget of 4.
CHUNK_OF = """
import importlib
import sys
from array import array
from katas._registry.impl import resolve
chunk = array("i", [0])
package = resolve(sys.argv[1]).package
importlib.import_module(package + ".dynamic_batcher._hotpath").fill_token_budget(
    array("i", [5]), chunk, token_budget=4, max_seqs=1)
print(chunk[0])
"""


def test_an_edit_is_rebuilt_before_the_next_import(tmp_path: Path) -> None:
    impl = tmp_path / "impl"
    shutil.copytree(REPO_ROOT / "solutions", impl, ignore=shutil.ignore_patterns("__pycache__"))
    source = impl / "dynamic_batcher/csrc/hotpath.c"
    got = []
    for edit in ("hp_int left = token_budget;", "hp_int left = token_budget - 1;"):
        source.write_text(source.read_text().replace("hp_int left = token_budget;", edit))
        run = subprocess.run(
            [sys.executable, "-c", CHUNK_OF, str(impl)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        got.append(int(run.stdout))
    assert got == [4, 3], f"the second import ran the C as first built: {got}"


# --- the binding: buffers and scalars ----------------------------------------------------


def test_reference_accepts_any_int32_buffer() -> None:
    # Raw bytes are accepted once cast to int32; the output may be any writable buffer.
    need = memoryview(array("i", [2, 3]).tobytes()).cast("i")
    out = bytearray(8)
    assert reference.fill_token_budget(
        need, memoryview(out).cast("i"), token_budget=4, max_seqs=2
    ) == (2, 4)
    assert array("i", bytes(out)).tolist() == [2, 2]


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


# --- the C unit tests -----------------------------------------------------------------


def tool(name: str) -> str:
    """``name`` (cmake, ctest) as the build on import finds it."""
    return native.tool(name) or name


def run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def test_ctest_passes_on_the_reference_and_says_not_implemented_on_the_stub(
    tmp_path: Path,
) -> None:
    # No `cmake --build`: ctest builds what it runs.
    tree = str(tmp_path / "build")
    configured = run(tool("cmake"), "-S", str(REPO_ROOT), "-B", tree, "-DKATAS_BUILD_TESTS=ON")
    assert configured.returncode == 0, configured.stdout[-2000:] + configured.stderr[-2000:]
    reference = run(tool("ctest"), "--test-dir", tree, "--output-on-failure")
    assert reference.returncode == 0, reference.stdout[-3000:]
    stub = run(tool("ctest"), "--test-dir", tree, "-C", "kata", "-L", "kata", "--output-on-failure")
    assert stub.returncode != 0, "the C unit test passes on the untouched stub"
    assert "not implemented yet: hp_fill_token_budget" in stub.stdout, stub.stdout[-3000:]


def test_ctest_alone_after_an_edit_runs_the_edited_c(tmp_path: Path) -> None:
    # A tree of one implementation (a copy of the reference) with its C unit test: ctest
    # alone builds it, and after an edit rebuilds it before running it.
    impl = tmp_path / "impl"
    shutil.copytree(REPO_ROOT / "solutions", impl, ignore=shutil.ignore_patterns("__pycache__"))
    tree = str(tmp_path / "build")
    configured = run(
        tool("cmake"), "-S", str(REPO_ROOT), "-B", tree,
        f"-DKATAS_IMPLEMENTATION={impl}", "-DKATAS_BUILD_TESTS=ON",
    )  # fmt: skip
    assert configured.returncode == 0, configured.stdout[-2000:] + configured.stderr[-2000:]
    first = run(tool("ctest"), "--test-dir", tree, "--output-on-failure")
    assert first.returncode == 0, first.stdout[-3000:]
    assert "hotpath_impl_build" in first.stdout, first.stdout[-3000:]
    source = impl / "dynamic_batcher/csrc/hotpath.c"
    text = source.read_text()
    assert "hp_int left = token_budget;" in text
    source.write_text(
        text.replace("hp_int left = token_budget;", "hp_int left = token_budget - 1;")
    )
    second = run(tool("ctest"), "--test-dir", tree, "--output-on-failure")
    assert second.returncode != 0, "ctest ran the C as first built:\n" + second.stdout[-3000:]
    assert "FAIL" in second.stdout and "hotpath_impl " in second.stdout, second.stdout[-3000:]


def c_checkout(into: Path) -> Path:
    """A copy of what the repository's CMake reads: its lists, presets and every csrc/."""
    for name in ("CMakeLists.txt", "CMakePresets.json"):
        shutil.copy2(REPO_ROOT / name, into / name)
    for csrc in [*REPO_ROOT.glob("katas/*/csrc"), *REPO_ROOT.glob("solutions/*/csrc")]:
        shutil.copytree(csrc, into / csrc.relative_to(REPO_ROOT))
    return into


#: A one-past-the-end write: clearing chunk[rows] too, after the last row.
CLEAR_CHUNKS = "    for (hp_int i = seqs; i < s->rows; i++) {\n        chunk[i] = 0;"


def test_the_sanitize_workflow_names_a_write_that_plain_ctest_passes(tmp_path: Path) -> None:
    # The learner's C is the reference with one write past the end of chunk: the C unit
    # test passes it, and the one-command sanitizer run fails naming the function.
    checkout = c_checkout(tmp_path)
    reference_c = (REPO_ROOT / "solutions/dynamic_batcher/csrc/hotpath.c").read_text()
    assert CLEAR_CHUNKS in reference_c
    planted = reference_c.replace(CLEAR_CHUNKS, CLEAR_CHUNKS.replace("i < s->rows", "i <= s->rows"))
    (checkout / "katas/dynamic_batcher/csrc/hotpath.c").write_text(planted)

    plain = run(tool("cmake"), "--workflow", "--preset", "dev", cwd=checkout)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-2000:]
    assert "hotpath_kata " in plain.stdout, plain.stdout[-3000:]
    sanitized = run(tool("cmake"), "--workflow", "--preset", "sanitize", cwd=checkout)
    report = sanitized.stdout + sanitized.stderr
    assert sanitized.returncode != 0, "the sanitizer run passed a write past the end"
    assert "AddressSanitizer: stack-buffer-overflow" in report, report[-3000:]
    assert "in hp_schedule" in report and "hotpath.c:" in report, report[-3000:]
