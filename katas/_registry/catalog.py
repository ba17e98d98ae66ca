"""The kata catalogue: every ``<root>/<kata>/kata.toml``, read into typed, validated records.

A new kata needs only its folder and a ``kata.toml``; nothing here or in the CLI names a
kata. The file (every field is checked, unknown fields are errors so typos surface)::

    title = "Rate limiter"                 # required
    summary = "one line"                   # required
    order = 1                              # optional: position in `kata list` (then by name)
    tags = ["token-bucket", "redis"]       # optional
    anchors = ["limits", "redis-cell"]     # optional: real systems the kata imitates

    [[stages]]                             # one table per stage, numbered 1, 2, 3 …
    number = 1
    title = "Single-threaded: token bucket and sliding log"
    timebox_minutes = 45
    core = "what a strong candidate finishes in the timebox (tests marked core)"
    extended = "what deepens the kata afterwards (tests marked extended)"   # optional
    stub = "stage1.py"                     # optional, default stage<N>.py: the file the
                                           # stage's work starts in (.py or C)
    module = "stage1"                      # optional, default the stub's name without .py
                                           # (required for a C stub): the module the suite
                                           # tests, a C extension module for C
    files = ["stage1.py", "csrc/x.c"]      # optional, default [stub]: every file the
                                           # learner edits (.py, .c, .h), which kata
                                           # reset restores and kata reveal compares
    suite = "test_stage1.py"               # optional, default test_stage<N>.py; or a list
                                           # of files when the stage has several subjects
                                           # (["test_stage3.py", "test_stage3_routes.py"])
    bench = "bench_stage1.py"              # optional, default bench_<first suite without test_>
    redis = true                           # optional, default false: the suite needs Redis
    cluster = true                         # optional, default false: the prompt promises a
                                           # Redis Cluster; the suite also runs on one
                                           # (KATA_REDIS_CLUSTER)
    section = "Stage 1"                    # optional, default "Stage <N>": the `## Stage 1`
                                           # heading in README.md, HINTS.md, INTERVIEWER.md

    [[stages.units]]                       # optional: the parts of a stage a learner may
    name = "hotpath"                       # practise alone (kata test/start --unit NAME)
    keyword = "hotpath"                    # pytest's -k expression selecting its tests
    file = "csrc/hotpath.c"                # the learner file it is written in (in files)
    core = "what the unit asks, in one line"

A stage's units, if it declares any, between them select each of its tests exactly once
(the repository's checks hold every suite to that).

    [coderpad]                             # optional: `kata coderpad` lays out a standalone
                                           # C project of the kata, as on an interview pad
    timebox_minutes = 45
    template = "coderpad"                  # a folder of the kata, laid out as it is
    target = "test_x"                      # the CMake target the learner adds
    [coderpad.files]                       # the rest, laid out from the kata's own files:
    "src/x.c" = "csrc/x.c"                 # path in the pad = path in the kata folder

The root is the directory holding the kata folders: ``KATA_ROOT`` if set, else the
checkout around the working directory (a directory with ``katas/_registry/``), else the
directory of the installed ``katas`` package.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_ROOT = "KATA_ROOT"
MANIFEST = "kata.toml"
#: What a learner's file may be: Python, or C and its headers.
LEARNER_SUFFIXES = (".py", ".c", ".h")
PROMPT = "README.md"
HINTS = "HINTS.md"
INTERVIEWER = "INTERVIEWER.md"

#: The ``katas`` package directory this module belongs to.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]

_T = TypeVar("_T")


class CatalogError(Exception):
    """Bad input the user can fix: an unknown kata, a broken kata.toml, a missing file.

    ``str()`` is one line meant for the user.
    """


def display_path(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Unit:
    """A part of a stage practised alone: its tests (pytest's ``-k keyword``) and its file."""

    name: str
    keyword: str
    file: str
    core: str


@dataclass(frozen=True)
class Stage:
    """One stage of a kata: what to build, in how long, and where its files are."""

    number: int
    title: str
    timebox_minutes: int
    core: str
    extended: str
    stub: str
    suites: tuple[str, ...]  # the suite files, in the order a run lists them
    section: str
    files: tuple[str, ...] = ()
    bench: str = ""
    redis: bool = False
    #: The prompt promises a Redis Cluster: the suite also runs on one.
    cluster: bool = False
    #: The module the suite tests, inside the kata package: ``stage1``, or a C extension
    #: module (``_hotpath``) built from the stage's C files.
    module: str = ""
    #: The parts practised alone (``--unit``); none: the stage is one unit.
    units: tuple[Unit, ...] = ()

    @property
    def suite(self) -> str:
        """The stage's first suite file: the one whose docstring maps all of them."""
        return self.suites[0]

    def unit(self, name: str) -> Unit:
        """The unit called ``name``; a :class:`CatalogError` naming the ones there are."""
        for unit in self.units:
            if unit.name == name:
                return unit
        known = ", ".join(u.name for u in self.units)
        raise CatalogError(
            f"stage {self.number} has the units {known}, got {name!r}"
            if known
            else f"stage {self.number} has no units: it is practised whole"
        )

    def file_for(self, not_implemented: str) -> str:
        """The learner file a "not implemented yet" message points into: the C file of the
        header it names (``… see katas/k/csrc/hotpath.h`` → ``csrc/hotpath.c``), else the
        stub (a Python stub's message names the prompt)."""
        for c_file in (f for f in self.files if f.endswith(".c")):
            header = c_file.removesuffix(".c") + ".h"
            if re.search(rf"(^|[\s/]){re.escape(header)}\b", not_implemented):
                return c_file
        return self.stub


@dataclass(frozen=True)
class Coderpad:
    """A kata's standalone C project for ``kata coderpad`` (its ``[coderpad]`` table)."""

    timebox_minutes: int
    template: str  # a folder inside the kata, copied as it is
    target: str  # the CMake target the learner's build-system step adds
    files: tuple[tuple[str, str], ...]  # (path in the pad, path in the kata folder)


@dataclass(frozen=True)
class Kata:
    """A kata folder and its metadata; ``name`` is the folder (and Python package) name."""

    name: str
    path: Path
    title: str
    summary: str
    order: int | None
    tags: tuple[str, ...]
    anchors: tuple[str, ...]
    stages: tuple[Stage, ...]
    coderpad: Coderpad | None = None

    @property
    def manifest(self) -> Path:
        return self.path / MANIFEST

    @property
    def prompt(self) -> Path:
        return self.path / PROMPT

    @property
    def hints(self) -> Path:
        return self.path / HINTS

    @property
    def interviewer(self) -> Path:
        return self.path / INTERVIEWER

    def stage(self, number: int) -> Stage:
        """The stage numbered ``number``; a :class:`CatalogError` if there is none."""
        for stage in self.stages:
            if stage.number == number:
                return stage
        raise CatalogError(
            f"{self.name} has stages 1–{len(self.stages)}, got stage {number}"
            if self.stages
            else f"{self.name} has no stages"
        )

    def stub_path(self, stage: Stage) -> Path:
        return self.path / stage.stub

    def learner_paths(self, stage: Stage) -> list[Path]:
        """Every file of ``stage`` the learner edits, the stage module first."""
        return [self.path / name for name in stage.files]

    def suite_paths(self, stage: Stage) -> list[Path]:
        return [self.path / name for name in stage.suites]

    def bench_path(self, stage: Stage) -> Path:
        return self.path / stage.bench


# --- reading and validating one kata.toml -------------------------------------------------

_KATA_FIELDS = {"title", "summary", "order", "tags", "anchors", "stages", "coderpad"}
_CODERPAD_FIELDS = {"timebox_minutes", "template", "target", "files"}
_STAGE_FIELDS = {
    "number",
    "title",
    "timebox_minutes",
    "core",
    "extended",
    "stub",
    "module",
    "files",
    "bench",
    "redis",
    "cluster",
    "suite",
    "section",
    "units",
}
_UNIT_FIELDS = {"name", "keyword", "file", "core"}


class _Fields:
    """Typed access to one TOML table; every error names the file and the field."""

    def __init__(self, file: Path, table: Mapping[str, Any], where: str, known: set[str]):
        self.file = file
        self.table = table
        self.where = where
        unknown = sorted(set(table) - known)
        if unknown:
            hint = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            also = f" (did you mean {hint[0]!r}?)" if hint else ""
            self.fail(unknown[0], f"is not a known field{also}; known: {', '.join(sorted(known))}")

    def fail(self, name: str, problem: str) -> NoReturn:
        raise CatalogError(f"{display_path(self.file)}: {self.where}{name} {problem}")

    def _get(self, name: str, default: _T | None, check: Callable[[Any], bool], what: str) -> Any:
        if name not in self.table:
            if default is None:
                self.fail(name, "is missing")
            return default
        value = self.table[name]
        if not check(value):
            self.fail(name, f"must be {what}, got {value!r}")
        return value

    def text(self, name: str, default: str | None = None) -> str:
        value: str = self._get(
            name, default, lambda v: isinstance(v, str) and "\n" not in v, "a one-line string"
        )
        if not value.strip() and default is None:
            self.fail(name, "must not be empty")
        return value.strip()

    def positive_int(self, name: str) -> int:
        value: int = self._get(
            name,
            None,
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
            "a positive integer",
        )
        return value

    def optional_int(self, name: str) -> int | None:
        if name not in self.table:
            return None
        return self.positive_int(name)

    def words(self, name: str) -> tuple[str, ...]:
        value: list[str] = self._get(
            name,
            [],
            lambda v: isinstance(v, list) and all(isinstance(s, str) and s.strip() for s in v),
            "a list of non-empty strings",
        )
        return tuple(s.strip() for s in value)

    def file_name(self, name: str, default: str) -> str:
        value = self.text(name, default)
        if not value.endswith(".py") or Path(value).name != value or value.startswith("."):
            self.fail(name, f"must be a .py file name inside the kata folder, got {value!r}")
        return value

    def file_names(self, name: str, default: str) -> tuple[str, ...]:
        """One ``.py`` file name, or a non-empty list of distinct ones."""
        value: str | list[str] = self._get(
            name,
            default,
            lambda v: (
                isinstance(v, str)
                or (isinstance(v, list) and bool(v) and all(isinstance(s, str) for s in v))
            ),
            "a .py file name or a non-empty list of them",
        )
        names = [value] if isinstance(value, str) else value
        for v in names:
            if not v.endswith(".py") or Path(v).name != v or v.startswith("."):
                self.fail(name, f"must be a .py file name inside the kata folder, got {v!r}")
        if len(set(names)) != len(names):
            self.fail(name, f"names a file twice: {names!r}")
        return tuple(names)

    def learner_file(self, name: str, default: str) -> str:
        """One path inside the kata folder, a Python or C file."""
        value = self.text(name, default)
        self.inside_the_kata(name, value)
        return value

    def identifier(self, name: str, default: str) -> str:
        value = self.text(name, default if default.isidentifier() else None)
        if not value.isidentifier():
            self.fail(name, f"must be a Python module name, got {value!r}")
        return value

    def learner_files(self, name: str, default: list[str]) -> tuple[str, ...]:
        """Paths inside the kata folder, each a Python or C file."""
        value: list[str] = self._get(
            name,
            default,
            lambda v: isinstance(v, list) and bool(v) and all(isinstance(s, str) for s in v),
            "a non-empty list of file paths",
        )
        for v in value:
            self.inside_the_kata(name, v)
        return tuple(value)

    def inside_the_kata(self, name: str, value: str) -> None:
        """Fail unless ``value`` names a Python or C file inside the kata folder."""
        if not _relative(value) or Path(value).suffix not in LEARNER_SUFFIXES:
            self.fail(
                name,
                f"must name files inside the kata folder ending in "
                f"{', '.join(LEARNER_SUFFIXES)}, got {value!r}",
            )

    def flag(self, name: str, default: bool) -> bool:
        value: bool = self._get(name, default, lambda v: isinstance(v, bool), "true or false")
        return value


def _units(stage: _Fields, files: tuple[str, ...]) -> tuple[Unit, ...]:
    """The ``[[stages.units]]`` of one stage (its fields ``stage``), validated."""
    raw_units = stage.table.get("units", [])
    if not isinstance(raw_units, list) or not all(isinstance(u, dict) for u in raw_units):
        stage.fail("units", "must be [[stages.units]] tables")
    units: list[Unit] = []
    for index, raw in enumerate(raw_units):
        fields = _Fields(stage.file, raw, f"{stage.where}units[{index}].", _UNIT_FIELDS)
        name = fields.text("name")
        if not name.replace("-", "_").isidentifier():
            fields.fail("name", f"must be one word (letters, digits, - and _), got {name!r}")
        if name in {u.name for u in units}:
            fields.fail("name", f"{name!r} names two units")
        unit_file = fields.text("file")
        if unit_file not in files:
            fields.fail(
                "file", f"must be one of the stage's files {list(files)}, got {unit_file!r}"
            )
        units.append(Unit(name, fields.text("keyword"), unit_file, fields.text("core")))
    return tuple(units)


def load_kata(path: Path) -> Kata:
    """Read and validate ``path/kata.toml``; raise :class:`CatalogError` on any problem."""
    file = path / MANIFEST
    name = path.name
    if not name.isidentifier():
        raise CatalogError(
            f"{display_path(path)}: a kata folder name must be a Python identifier "
            f"(it is imported as a package), got {name!r}"
        )
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogError(f"{display_path(file)} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CatalogError(f"{display_path(file)}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{display_path(file)}: invalid TOML: {exc}") from None

    top = _Fields(file, data, "", _KATA_FIELDS)
    raw_stages = data.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        top.fail("stages", "must be one or more [[stages]] tables")
    stages: list[Stage] = []
    for index, raw in enumerate(raw_stages):
        if not isinstance(raw, dict):
            top.fail("stages", "must be [[stages]] tables")
        fields = _Fields(file, raw, f"stages[{index}].", _STAGE_FIELDS)
        number = fields.positive_int("number")
        if number != index + 1:
            fields.fail("number", f"must be {index + 1} (stages are numbered 1, 2, … in order)")
        stages.append(
            Stage(
                number=number,
                title=fields.text("title"),
                timebox_minutes=fields.positive_int("timebox_minutes"),
                core=fields.text("core"),
                extended=fields.text("extended", ""),
                stub=(stub := fields.learner_file("stub", f"stage{number}.py")),
                suites=(suites := fields.file_names("suite", f"test_stage{number}.py")),
                section=fields.text("section", f"Stage {number}"),
                files=fields.learner_files("files", [stub]),
                bench=fields.file_name("bench", "bench_" + suites[0].removeprefix("test_")),
                redis=fields.flag("redis", False),
                cluster=fields.flag("cluster", False),
                module=fields.identifier("module", stub.removesuffix(".py")),
            )
        )
        if stages[-1].stub not in stages[-1].files:
            fields.fail("files", f"must include the stage module {stages[-1].stub!r}")
        units = _units(fields, stages[-1].files)
        stages[-1] = dataclasses.replace(stages[-1], units=units)
    return Kata(
        coderpad=_coderpad(file, data["coderpad"]) if "coderpad" in data else None,
        name=name,
        path=path,
        title=top.text("title"),
        summary=top.text("summary"),
        order=top.optional_int("order"),
        tags=top.words("tags"),
        anchors=top.words("anchors"),
        stages=tuple(stages),
    )


def _coderpad(file: Path, raw: object) -> Coderpad:
    """The ``[coderpad]`` table: every path relative and inside its folder."""
    if not isinstance(raw, dict):
        raise CatalogError(f"{display_path(file)}: coderpad must be a [coderpad] table")
    fields = _Fields(file, raw, "coderpad.", _CODERPAD_FIELDS)
    files = raw.get("files", {})
    if not isinstance(files, dict) or not files:
        fields.fail("files", 'must be a [coderpad.files] table of "pad path" = "kata path"')
    pairs: list[tuple[str, str]] = []
    for pad_path, kata_path in files.items():
        if not isinstance(kata_path, str) or not _relative(pad_path):
            fields.fail("files", f"must map relative paths to kata files, got {pad_path!r}")
        fields.inside_the_kata("files", kata_path)
        pairs.append((pad_path, kata_path))
    template = fields.text("template")
    if not _relative(template):
        fields.fail("template", f"must be a folder inside the kata, got {template!r}")
    target = fields.text("target")
    if not target.replace("_", "").replace("-", "").isalnum():
        fields.fail("target", f"must be a CMake target name, got {target!r}")
    return Coderpad(fields.positive_int("timebox_minutes"), template, target, tuple(pairs))


def _relative(value: str) -> bool:
    """Whether ``value`` is a path relative to its folder and never above it."""
    path = Path(value)
    return bool(value.strip()) and not path.is_absolute() and ".." not in path.parts


# --- the catalogue ------------------------------------------------------------------------


def _checkout_around(start: Path) -> Path | None:
    """The ``katas`` directory of a checkout containing ``start``, if any."""
    for directory in (start, *start.parents):
        candidate = directory / "katas"
        if (candidate / "_registry").is_dir() and (candidate / "__init__.py").is_file():
            return candidate
    return None


def default_root() -> Path:
    """``KATA_ROOT``, else the checkout around the working directory, else the package."""
    env = os.environ.get(ENV_ROOT)
    if env:
        root = Path(env).expanduser().resolve()
        if not root.is_dir():
            raise CatalogError(f"{ENV_ROOT}={env} is not a directory")
        return root
    # In a checkout (installed editable or not) the learner's files are the checkout's.
    return _checkout_around(Path.cwd().resolve()) or PACKAGE_ROOT


@dataclass(frozen=True)
class Catalog:
    """The katas under ``root`` (a directory of kata folders, like ``katas/``)."""

    root: Path

    @classmethod
    def discover(cls, root: Path | None = None) -> Catalog:
        return cls((root or default_root()).resolve())

    @property
    def is_package(self) -> bool:
        """Whether the root is the ``katas`` package (so ``--impl katas`` imports from it)."""
        return self.root.name == "katas" and (self.root / "__init__.py").is_file()

    @property
    def project_root(self) -> Path:
        """Where suites run from: the directory holding the root (the repository root)."""
        return self.root.parent

    def names(self) -> list[str]:
        """Folder names with a kata.toml, sorted (no file is parsed)."""
        return sorted(p.parent.name for p in self.root.glob(f"*/{MANIFEST}"))

    def katas(self) -> list[Kata]:
        """Every kata, validated, in ``order`` then name order."""
        katas = [load_kata(self.root / name) for name in self.names()]
        return sorted(katas, key=lambda k: (k.order is None, k.order or 0, k.name))

    def get(self, name: str) -> Kata:
        """The kata called ``name`` (``-`` is read as ``_``), or a :class:`CatalogError`."""
        # Accept what tab completion gives too: ``katas/rate_limiter/``.
        wanted = Path(name.strip()).name.replace("-", "_")
        if wanted.isidentifier() and (self.root / wanted / MANIFEST).is_file():
            return load_kata(self.root / wanted)
        names = self.names()
        close = difflib.get_close_matches(wanted, names, n=3, cutoff=0.5)
        hint = (
            f"did you mean {' or '.join(close)}?"
            if close
            else f"known: {', '.join(names)}"
            if names
            else f"no kata.toml under {display_path(self.root)}"
        )
        raise CatalogError(f"unknown kata {name!r}; {hint}")


__all__ = [
    "ENV_ROOT",
    "HINTS",
    "INTERVIEWER",
    "MANIFEST",
    "PACKAGE_ROOT",
    "PROMPT",
    "Catalog",
    "CatalogError",
    "Coderpad",
    "Kata",
    "Stage",
    "Unit",
    "display_path",
    "load_kata",
]
