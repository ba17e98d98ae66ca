"""A broken setup is a few lines, not one traceback per test (katas/_harness/preflight.py),
and a crash in C is one failed test, not a dead run (katas/_harness/isolation.py).

Each check plants the fault in a copy of the reference (or points at a server that is
not there), runs plain ``pytest`` on a stage suite as a learner would, and reads what it
printed: the one line that says what is wrong, and how many lines the run took.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
from _support import kata_process, learner_pytest

from katas._registry.impl import REPO_ROOT
from katas._runtime import native

#: What pytest prints around any run: its header, the progress lines, the summary.
FRAME_LINES = 20


def pytest_run(
    *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Plain ``pytest ARGS`` from the repository root, as a learner types it."""
    return learner_pytest(*args, env=env, quiet=False)


def reference_copy(tmp_path: Path) -> Path:
    dest = tmp_path / "impl"
    shutil.copytree(REPO_ROOT / "solutions", dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


#: The line of the reference's hp_fill_token_budget where the C faults are planted.
C_LINE = "hp_int left = token_budget;"


def c_with(tmp_path: Path, line: str) -> tuple[Path, Path]:
    """A copy of the reference whose hotpath.c has :data:`C_LINE` replaced by ``line``:
    ``(the implementation, its hotpath.c)``."""
    impl = reference_copy(tmp_path)
    source = impl / "dynamic_batcher" / "csrc" / "hotpath.c"
    plant(source, C_LINE, line)
    return impl, source


def plant(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: the line to plant the bug in has moved: {old!r}"
    path.write_text(text.replace(old, new, 1))


def test_a_syntax_error_in_a_stage_file_is_one_line_and_no_test_runs(tmp_path: Path) -> None:
    impl = reference_copy(tmp_path)
    stage1 = impl / "rate_limiter" / "stage1.py"
    stage1.write_text(stage1.read_text() + "\ndef broken(:\n")
    run = pytest_run("katas/rate_limiter", "-k", "stage1", f"--impl={impl}")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    lines = out.splitlines()
    said = [ln for ln in lines if "SyntaxError" in ln]
    assert len(said) == 1, f"the syntax error must be said once, got {len(said)}:\n{out[-3000:]}"
    assert f"{stage1}:{len(stage1.read_text().splitlines())}: SyntaxError" in said[0], said[0]
    assert len(lines) <= FRAME_LINES, f"{len(lines)} lines for one syntax error:\n{out}"


def test_a_dead_redis_url_is_one_line_and_exit_code_2() -> None:
    run = pytest_run(
        "katas/rate_limiter", "-k", "stage3", "--impl=solutions",
        env={"KATA_REDIS_URL": "redis://127.0.0.1:1/0"},
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-3000:]
    assert "ERROR: KATA_REDIS_URL=redis://127.0.0.1:1/0: nothing answers at 127.0.0.1:1" in out
    assert len(out.splitlines()) <= FRAME_LINES, out


def test_a_cluster_command_that_is_not_installed_is_one_line_and_exit_code_2() -> None:
    run = pytest_run(
        "katas/rate_limiter", "-k", "stage3", "--impl=solutions",
        env={"KATA_REDIS_CLUSTER": "no-such-redis-server"},
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-3000:]
    assert "ERROR: KATA_REDIS_CLUSTER=no-such-redis-server: no such program on PATH" in out, out
    assert len(out.splitlines()) <= FRAME_LINES, out


def test_a_compile_error_is_said_once_and_one_line_per_test(tmp_path: Path) -> None:
    impl, source = c_with(tmp_path, "hp_int left =")
    run = pytest_run("katas/dynamic_batcher", "-k", "hotpath", f"--impl={impl}")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    first_error = next((ln for ln in out.splitlines() if "error:" in ln), out[:3000])
    assert f"{source}:" in first_error and "does not build" in first_error, first_error
    failed = out.count("\nFAILED ")
    assert failed >= 10, out[-3000:]
    # the line before the tests, then per test: its header, the one line, and FAILED
    assert len(out.splitlines()) <= FRAME_LINES + 3 * failed, out[-6000:]
    assert "Traceback" not in out and "cmake in" not in out, out[-3000:]


def test_a_stage_whose_units_are_python_builds_no_c(tmp_path: Path) -> None:
    """The batcher's stages 2 and 3 never reach the C hot path: their runs do not build
    it (a second of CMake a run), so stage 1's broken C says nothing there."""
    impl, _ = c_with(tmp_path, "hp_int left =")
    run = pytest_run(
        "katas/dynamic_batcher", "-k", "stage2 and full_batch_is_sent_at_once",
        f"--impl={impl}",
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "does not build" not in out, out[-3000:]


def test_a_broken_build_is_tried_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    impl = reference_copy(tmp_path)
    source = impl / "dynamic_batcher" / "csrc" / "hotpath.c"
    # C of its own: a copy with the reference's C to the byte loads the reference's build.
    source.write_text(source.read_text() + "\n/* a copy of its own */\n")
    tries = []

    def failing(tree: Path, kata: str, module: str, implementation: Path) -> Path:
        tries.append(tree)
        raise native.BuildError("the C of dynamic_batcher._hotpath does not build: planted")

    monkeypatch.setattr(native, "_build", failing)
    for _ in range(3):
        with pytest.raises(native.BuildError, match="planted"):
            native.build("dynamic_batcher", "_hotpath", impl)
    assert len(tries) == 1, f"built {len(tries)} times"
    source.write_text(source.read_text() + "\n")  # an edit: built again
    with pytest.raises(native.BuildError):
        native.build("dynamic_batcher", "_hotpath", impl)
    assert len(tries) == 2, "an edited C must be built again"


def test_a_segfault_in_c_fails_the_tests_that_reach_it_and_the_rest_run(tmp_path: Path) -> None:
    impl, _ = c_with(tmp_path, C_LINE + "\n    if (n > 1) *(volatile int *)0 = 0; /* planted */")
    run = pytest_run("katas/dynamic_batcher", f"--impl={impl}", "-k", "stage1")
    out = run.stdout + run.stderr
    assert run.returncode == 1, f"the run must end with its summary:\n{out[-3000:]}"
    crashed = [ln for ln in out.splitlines() if ln.startswith("crashed: ")]
    assert crashed, out[-3000:]
    for line in crashed:  # the signal, and the call into C that never returned
        assert re.search(r"SIGSEGV at \S+:\d+ in \w+: .*(fill_token_budget|schedule)\(", line), line
    summary = out.splitlines()[-1]
    assert " passed" in summary and " failed" in summary, summary
    # kata test: one "crashed" line a test, and the tally counts them
    shown = kata_process("test", "dynamic_batcher", "1", "--impl", str(impl))
    lines = shown.stdout.splitlines()
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert len([ln for ln in lines if ln.startswith("! crashed: ")]) == len(crashed), lines
    assert f"{len(crashed)} crashed" in lines[-1], lines[-1]


def test_a_loop_in_c_past_its_deadline_is_a_timeout_that_says_where(tmp_path: Path) -> None:
    # Stuck in C, the test never returns to Python to meet its deadline: it is killed,
    # and its line says which call into C never came back.
    impl, _ = c_with(tmp_path, C_LINE + "\n    for (volatile int spin = 1; spin;) {} /* planted */")
    test = "test_hotpath_a_smaller_request_never_jumps_the_queue"
    run = pytest_run("katas/dynamic_batcher", f"--impl={impl}", "-k", test,
                     env={"KATA_TEST_TIMEOUT": "1"})  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith(f"timeout: {test}")]
    assert re.search(r"it was at \S+:\d+ in \w+: .*fill_token_budget\(", line), line
