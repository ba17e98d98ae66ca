"""``kata coderpad``: a kata's C laid out as a standalone CMake project, checked with plain
cmake and ctest (the C hot path of the dynamic batcher, the kata that offers one)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from _support import private_state, write

from katas._cli.cli import main
from katas._cli.cli_coderpad import CLOCK_FILE
from katas._cli.pristine import looks_like_stub
from katas._registry.catalog import Catalog, CatalogError, load_kata
from katas._registry.impl import REPO_ROOT

KATA = "dynamic_batcher"
#: The build-system step TASK.md asks for: the test target, built and registered.
ADDED_TARGET = """
add_executable(test_hotpath tests/test_hotpath.c)
target_link_libraries(test_hotpath PRIVATE hotpath)
add_test(NAME test_hotpath COMMAND test_hotpath)
"""


@pytest.fixture(autouse=True)
def _the_repositorys_katas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    private_state(tmp_path, monkeypatch)
    monkeypatch.setenv("KATA_ROOT", str(REPO_ROOT / "katas"))


def lay_out(pad: Path, capsys: pytest.CaptureFixture[str], started: float = 1000.0) -> str:
    assert main(["coderpad", KATA, str(pad)], wall=lambda: started) == 0
    return capsys.readouterr().out


def run(*argv: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_layout_draws_its_c_from_the_kata_and_starts_the_clock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kata = Catalog.discover().get(KATA)
    assert kata.coderpad is not None
    pad = tmp_path / "pad"
    out = lay_out(pad, capsys)
    assert f"Timebox {kata.coderpad.timebox_minutes} min" in out, out
    assert f"kata coderpad {KATA} --check {pad}" in out, out
    for pad_path, kata_path in kata.coderpad.files:
        source = (kata.path / kata_path).read_text()
        if looks_like_stub(source, Path(kata_path).suffix):  # else a learner's edits
            assert (pad / pad_path).read_text() == source, pad_path
    template = kata.path / kata.coderpad.template
    for file in template.iterdir():
        assert (pad / file.name).read_text() == file.read_text(), file.name
    assert kata.coderpad.target in (pad / "TASK.md").read_text()
    assert (pad / CLOCK_FILE).is_file()

    assert main(["coderpad", KATA, str(pad)]) == 2, "laid out over a folder with files"
    assert "is not an empty folder" in capsys.readouterr().err


def test_the_untouched_layout_fails_the_check_naming_the_missing_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pad = tmp_path / "pad"
    lay_out(pad, capsys)
    assert main(["coderpad", KATA, "--check", str(pad)], wall=lambda: 1060.0) == 1
    out = capsys.readouterr().out
    assert "FAILED: CMakeLists.txt has no target `test_hotpath`" in out, out
    assert "cmake --build" not in out, "built a project whose build-system step is missing"
    assert out.rstrip().splitlines()[-1] == "NOT YET — 1 min since the layout, timebox 45 min"

    # The target alone, not registered with ctest: the test step says so.
    with (pad / "CMakeLists.txt").open("a") as cmake_lists:
        cmake_lists.write(ADDED_TARGET.replace("add_test(", "# add_test("))
    assert main(["coderpad", KATA, str(pad), "--check"]) == 1
    out = capsys.readouterr().out
    assert "no test is registered" in out, out


def test_the_reference_and_the_added_target_pass_with_plain_cmake(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pad = tmp_path / "pad"
    lay_out(pad, capsys, started=1000.0)
    shutil.copy(REPO_ROOT / "solutions" / KATA / "csrc/hotpath.c", pad / "src/hotpath.c")
    with (pad / "CMakeLists.txt").open("a") as cmake_lists:
        cmake_lists.write(ADDED_TARGET)

    # The learner's loop: plain cmake, and the test program's console.
    for step in (("cmake", "-S", ".", "-B", "build"), ("cmake", "--build", "build")):
        done = run(*step, cwd=pad)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    console = run(pad / "build/test_hotpath", cwd=pad)
    assert console.returncode == 0 and console.stdout.endswith(" passed, 0 failed\n"), (
        console.stdout + console.stderr
    )

    assert main(["coderpad", KATA, "--check", str(pad)], wall=lambda: 1000.0 + 50 * 60) == 0
    out = capsys.readouterr().out
    assert "100% tests passed" in out, out
    assert out.rstrip().splitlines()[-1] == (
        "PASSED: built with plain cmake, every test passed — 50 min since the layout, "
        "timebox 45 min, 5 min over"
    )


def test_a_kata_without_a_rehearsal_names_the_ones_with_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    others = [k.name for k in Catalog.discover().katas() if k.coderpad is None]
    assert others, "every kata has a rehearsal"
    assert main(["coderpad", others[0], str(tmp_path / "pad")]) == 2
    err = capsys.readouterr().err
    assert "no coderpad rehearsal" in err and KATA in err, err
    assert not (tmp_path / "pad").exists()


#: A valid [coderpad] table, then one broken field at a time (and the field named).
TABLE = 'timebox_minutes = 45\ntemplate = "pad"\ntarget = "t"\nfiles = {"a.c" = "x.c"}'


@pytest.mark.parametrize(
    ("table", "field"),
    [
        (TABLE.replace('\nfiles = {"a.c" = "x.c"}', ""), "files"),
        (TABLE.replace('"x.c"', '"../x.c"'), "files"),
        (TABLE.replace('"pad"', '"/pad"'), "template"),
        (TABLE.replace('"t"', '"a b"'), "target"),
        (TABLE.replace("timebox_minutes", "timebox"), "timebox"),
    ],
)
def test_a_broken_coderpad_table_names_the_field(tmp_path: Path, table: str, field: str) -> None:
    stage = '[[stages]]\nnumber = 1\ntitle = "t"\ntimebox_minutes = 5\ncore = "c"\n'
    write(
        tmp_path / "calc/kata.toml", f'title = "t"\nsummary = "s"\n{stage}\n[coderpad]\n{table}\n'
    )
    with pytest.raises(CatalogError, match=f"coderpad.{field}"):
        load_kata(tmp_path / "calc")


def test_a_stub_the_learner_has_edited_is_laid_out_as_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A checkout of the kata's files whose stub holds the learner's work: the pad gets the
    # committed stub, not the work.
    kata = Catalog.discover().get(KATA)
    assert kata.coderpad is not None
    project = tmp_path / "project"
    copy = project / "katas" / KATA
    shutil.copytree(kata.path, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    git = ("git", "-c", "user.name=kata", "-c", "user.email=kata@example.com")
    for step in (("init", "-q"), ("add", "."), ("commit", "-q", "-m", "the kata")):
        assert run(*git, *step, cwd=project).returncode == 0
    stub = dict(kata.coderpad.files)["src/hotpath.c"]
    committed = (copy / stub).read_text()
    shutil.copy(REPO_ROOT / "solutions" / KATA / stub, copy / stub)
    monkeypatch.setenv("KATA_ROOT", str(project / "katas"))

    lay_out(tmp_path / "pad", capsys)
    assert (tmp_path / "pad/src/hotpath.c").read_text() == committed
