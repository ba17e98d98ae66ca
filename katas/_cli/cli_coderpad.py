"""``kata coderpad``: rehearse a kata's C as on an interview pad, a CMake project of its own.

A kata offers a rehearsal with a ``[coderpad]`` table in its kata.toml
(:class:`~katas._registry.catalog.Coderpad`). ``kata coderpad KATA DIR`` lays out the
table's template folder and the kata files it names (a learner file as its pristine stub)
in ``DIR``, records when the clock started, and prints the timebox. Everything after that
happens in ``DIR`` with plain ``cmake`` and ``ctest``: no Python in the loop.
``--check`` runs the same commands, checks the build-system step (the table's ``target``
exists, a test is registered) and reports the time taken against the timebox.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from rich.text import Text

from katas._cli.cliutil import Command, Context, UserError, add_kata
from katas._cli.pristine import PristineError, looks_like_stub, pristine_stub
from katas._registry.catalog import Coderpad, Kata, display_path
from katas._runtime import native
from katas._runtime.children import dies_with_parent

#: In the laid-out folder: when the clock started and the timebox.
CLOCK_FILE = ".coderpad.json"
#: The build tree ``--check`` uses, the one TASK.md's loop uses too.
BUILD_DIR = "build"
#: How many lines of a failed step's output are shown.
SHOWN_LINES = 40


def _configure(parser: argparse.ArgumentParser) -> None:
    add_kata(parser)
    parser.add_argument(
        "dir",
        metavar="DIR",
        nargs="?",
        help="the folder to lay the project out in, new or empty (default: coderpad-KATA "
        "in the current directory)",
    )
    parser.add_argument(
        "--check",
        nargs="?",
        const=True,
        metavar="DIR",
        help="build DIR with plain cmake, run its tests with ctest and report",
    )


def run_coderpad(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    if kata.coderpad is None:
        offered = [k.name for k in ctx.catalog.katas() if k.coderpad is not None]
        raise UserError(
            f"{kata.name} has no coderpad rehearsal (no [coderpad] table in its kata.toml); "
            + (f"katas with one: {', '.join(offered)}" if offered else "no kata has one")
        )
    if isinstance(args.check, str) and args.dir is not None:
        raise UserError(f"two folders: {args.dir} and --check {args.check}; give one")
    where = args.check if isinstance(args.check, str) else args.dir
    folder = Path(where or f"coderpad-{kata.name}").expanduser().resolve()
    if args.check:
        return check(kata.coderpad, folder, ctx)
    lay_out(kata, kata.coderpad, folder, ctx)
    return 0


# --- laying out ------------------------------------------------------------------------------


def lay_out(kata: Kata, pad: Coderpad, folder: Path, ctx: Context) -> None:
    """Write the project into ``folder`` (new or empty) and start the clock."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UserError(f"{display_path(folder)} is not an empty folder: choose a new one")
    template = kata.path / pad.template
    if not template.is_dir():
        raise UserError(f"{display_path(template)} (coderpad.template) is not a folder")
    shutil.copytree(template, folder, dirs_exist_ok=True)
    for pad_path, kata_path in pad.files:
        target = folder / pad_path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_source(kata, kata_path), encoding="utf-8")
    started = ctx.wall()
    clock = {"kata": kata.name, "started": started, "timebox_minutes": pad.timebox_minutes}
    (folder / CLOCK_FILE).write_text(json.dumps(clock) + "\n", encoding="utf-8")

    where = display_path(folder)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    _say(ctx, f"Laid out {where}: {', '.join(f for f in files if f != CLOCK_FILE)}")
    _say(
        ctx,
        (
            f"Timebox {pad.timebox_minutes} min, started at "
            f"{time.strftime('%H:%M', time.localtime(started))}. Read TASK.md first; "
            "the loop, in that folder:"
        ),
    )
    _say(ctx, f"  cd {where}\n  {_loop()}")
    _say(ctx, f"When you are done: kata coderpad {kata.name} --check {where}")


def _source(kata: Kata, kata_path: str) -> str:
    """A kata file's text; a file the learner edits, as its stub (the committed one if the
    working copy is not a stub any more)."""
    path = kata.path / kata_path
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{display_path(path)} (in coderpad.files): cannot read: {exc}") from None
    learners = {name for stage in kata.stages for name in stage.files}
    if kata_path in learners and not looks_like_stub(text, path.suffix):
        try:
            text, _ = pristine_stub(path)
        except PristineError as exc:
            raise UserError(f"{display_path(path)} is not its stub any more: {exc}") from None
    return text


def _say(ctx: Context, text: str) -> None:
    """One message, never wrapped (commands and compiler lines are copied from it)."""
    ctx.out.print(Text(text), soft_wrap=True)


def _loop() -> str:
    return (
        f"cmake -S . -B {BUILD_DIR} && cmake --build {BUILD_DIR} && "
        f"ctest --test-dir {BUILD_DIR} --output-on-failure"
    )


# --- checking -------------------------------------------------------------------------------


def check(pad: Coderpad, folder: Path, ctx: Context) -> int:
    """Build ``folder`` with plain cmake and run ctest; 0 when every step passed."""
    if not (folder / "CMakeLists.txt").is_file():
        raise UserError(
            f"{display_path(folder)} has no CMakeLists.txt: lay a project out first "
            "(kata coderpad KATA DIR)"
        )
    cmake, ctest = native.tool("cmake"), native.tool("ctest")
    if cmake is None or ctest is None:
        raise UserError("cmake and ctest must be on PATH (pip install cmake, or your system's)")
    build = folder / BUILD_DIR
    # CMake's file API: configuring answers with the targets, read back by _targets().
    query = build / ".cmake/api/v1/query/codemodel-v2"
    query.parent.mkdir(parents=True, exist_ok=True)
    query.touch()

    if not _step(ctx, "configure", [cmake, "-S", str(folder), "-B", str(build)], 300):
        return _verdict(ctx, folder, pad, ok=False)
    targets = _targets(build)
    if pad.target not in targets:
        _say(
            ctx,
            (
                f"FAILED: CMakeLists.txt has no target `{pad.target}` — the build-system step "
                f"of TASK.md: add the executable `{pad.target}` and register it with add_test "
                f"(targets now: {', '.join(sorted(targets)) or 'none'})"
            ),
        )
        return _verdict(ctx, folder, pad, ok=False)
    if not _step(ctx, "build", [cmake, "--build", str(build)], 600):
        return _verdict(ctx, folder, pad, ok=False)
    tests = [ctest, "--test-dir", str(build), "--output-on-failure", "--no-tests=error"]
    ok = _step(ctx, "test", [*tests, "--timeout", "60"], 300, show_all=True)
    return _verdict(ctx, folder, pad, ok=ok)


def _step(ctx: Context, what: str, argv: list[str], timeout: int, show_all: bool = False) -> bool:
    """Run one command, print it (and its output when it fails or ``show_all``)."""
    _say(ctx, "$ " + " ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv)))
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            errors="replace",
            **dies_with_parent(),
        )
    except subprocess.TimeoutExpired:
        _say(ctx, f"FAILED: the {what} step ran past {timeout} s")
        return False
    output = (done.stdout + done.stderr).rstrip()
    if done.returncode != 0 or show_all:
        lines = output.splitlines()
        if len(lines) > SHOWN_LINES and done.returncode != 0:
            lines = [f"… ({len(lines) - SHOWN_LINES} lines above)", *lines[-SHOWN_LINES:]]
        if lines:
            _say(ctx, "\n".join(lines))
    if done.returncode != 0:
        hint = (
            ": no test is registered — add_test() for the new target (TASK.md)"
            if "No tests were found" in output
            else ""
        )
        _say(ctx, f"FAILED: the {what} step (exit code {done.returncode}){hint}")
    return done.returncode == 0


def _targets(build: Path) -> set[str]:
    """The project's targets, from the reply to the file-API query of the last configure."""
    reply = build / ".cmake/api/v1/reply"
    indexes = sorted(reply.glob("index-*.json"))
    if not indexes:
        return set()
    index = json.loads(indexes[-1].read_text(encoding="utf-8"))
    names: set[str] = set()
    for entry in index.get("objects", []):
        if entry.get("kind") != "codemodel":
            continue
        model = json.loads((reply / entry["jsonFile"]).read_text(encoding="utf-8"))
        for configuration in model.get("configurations", []):
            names |= {target["name"] for target in configuration.get("targets", [])}
    return names


def _verdict(ctx: Context, folder: Path, pad: Coderpad, *, ok: bool) -> int:
    """The last line: passed or not, and the time against the timebox."""
    took = ""
    try:
        clock = json.loads((folder / CLOCK_FILE).read_text(encoding="utf-8"))
        minutes = (ctx.wall() - float(clock["started"])) / 60
        box = int(clock.get("timebox_minutes", pad.timebox_minutes))
        over = f", {minutes - box:.0f} min over" if minutes > box else ""
        took = f" — {minutes:.0f} min since the layout, timebox {box} min{over}"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no clock (laid out by hand): no time to report
    verdict = "PASSED: built with plain cmake, every test passed" if ok else "NOT YET"
    _say(ctx, verdict + took)
    return 0 if ok else 1


COMMAND = Command(
    "coderpad",
    "rehearse a kata's C on an interview pad: a CMake project of its own",
    "Lay out a kata's C as a standalone CMake project in DIR, as an interview pad has "
    "it: its own CMakeLists.txt (missing one target you add: TASK.md says which), the "
    "header, the stub sources and a test program that prints to the console. Prints the "
    "timebox and starts the clock. Work in DIR with plain cmake and ctest, no Python.\n\n"
    "With --check: build DIR with `cmake -S DIR -B DIR/build`, `cmake --build DIR/build` "
    "and `ctest --test-dir DIR/build`, check the target exists, and report the time "
    "taken.\n\n"
    "exit code: 0 laid out, or (--check) every step passed; 1 a step failed; 2 bad input",
    _configure,
    run_coderpad,
)

__all__ = ["CLOCK_FILE", "COMMAND", "check", "lay_out", "run_coderpad"]
