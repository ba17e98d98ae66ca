"""Which implementation the suites test: the learner's ``katas``, the ``solutions``, or a PATH.

This is the only place that imports stage modules for tests. A PATH is any directory
laid out like ``solutions/`` (``<kata>/stageN.py``); it is imported as a package of its
own under a synthetic, unique name, so a modified copy of ``solutions/`` is what gets
tested even though ``solutions`` is installed, and relative imports between its stage
modules keep working.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from katas._registry import reach
from katas._registry.catalog import default_root, load_kata
from katas._runtime import native

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_IMPL = "KATA_IMPL"
ENV_PROFILE = "KATA_PROFILE"  # hypothesis profile: dev (default), ci, thorough
#: The ``redis-server`` the harness starts private servers of (katas/_harness/redis_fixture.py)
ENV_REDIS_SERVER = "KATA_REDIS_SERVER"
#: The ``redis-server`` the harness builds a Redis Cluster of
ENV_REDIS_CLUSTER = "KATA_REDIS_CLUSTER"
#: The hypothesis profiles :mod:`katas._harness.profiles` registers (``mutant``: the catalogue's).
PROFILES = ("dev", "ci", "thorough", "mutant")
#: How a stub's ``Todo`` reads in a report: one line, no traceback.
NOT_IMPLEMENTED = "not implemented yet: "
ENV_BASE = "KATA_BASE"


@dataclass(frozen=True)
class Selection:
    """A resolved choice of implementation: a package name to import stage modules from."""

    spec: str  # what the user said: "katas", "solutions" or a path
    package: str  # the importable package holding <kata>/stageN.py
    base: str | None = None  # "reference": earlier stages come from ``solutions``
    _modules: dict[tuple[str, int, int], ModuleType] = field(default_factory=dict, compare=False)

    def stage(self, kata: str, stage: int, top: int | None = None) -> ModuleType:
        """The module of ``kata``'s stage ``stage``, as the suite of stage ``top`` (default
        ``stage``) tests it: with ``base="reference"``, stage ``top`` is this
        implementation's and every stage below it the reference's."""
        top = stage if top is None else top
        key = (kata, stage, top)
        if key not in self._modules:
            package = f"{self.package}.{kata}"
            if self.base == "reference" and self.package != "solutions" and top > 1:
                package = _based_package(self.package, kata, top)
            module = importlib.import_module(f"{package}.{stage_module(kata, stage)}")
            if stage == top:  # the stage a suite tests: which of its names it calls
                reach.watch(module, f"{kata}/stage{stage}")
            self._modules[key] = module
        return self._modules[key]


class _Based(importlib.abc.MetaPathFinder):
    """Finds the modules of the packages :func:`_based_package` names.

    Such a package is one kata's stage ``top`` of an implementation over the reference's
    earlier stages: its stage ``top`` is read from the implementation's folder, every
    stage below from ``solutions/``, any other module (a helper) from the implementation's
    folder first, then the reference's. A stage file imports the previous stage
    relatively (``from .stage1 import …``), so it meets the reference's there, while the
    implementation's own package stays untouched: a run may test stage 1 as written and
    stage 2 over the reference's stage 1, side by side.
    """

    def __init__(self) -> None:
        self.packages: dict[str, tuple[str, int, Path, Path]] = {}  # name -> kata, top, dirs

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.packages:
            spec = importlib.machinery.ModuleSpec(fullname, _EmptyPackage(), is_package=True)
            spec.submodule_search_locations = []
            return spec
        parent, _, leaf = fullname.rpartition(".")
        if parent not in self.packages:
            return None
        kata, top, own, reference = self.packages[parent]
        stages = {stage_module(kata, n): n for n in range(1, top + 1)}
        if leaf in stages:
            folders = [own if stages[leaf] == top else reference]
        else:
            folders = [own, reference]
        for folder in folders:
            file = folder / f"{leaf}.py"
            if file.is_file():
                return importlib.util.spec_from_file_location(fullname, file)
            if native.declared(kata, leaf) and (folder / "csrc").is_dir():
                return native.spec_for(fullname, folder)  # a C module, built from there
        return None


class _EmptyPackage(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        return None


_BASED = _Based()


def _source_dir(package: str) -> Path:
    """The folder of ``package`` that holds its stage files. An editable install puts a
    built C module's folder (in site-packages) before the source folder in ``__path__``."""
    folders = [Path(p) for p in importlib.import_module(package).__path__]
    return next((f for f in folders if any(f.glob("stage*.py"))), folders[0])


def _based_package(package: str, kata: str, top: int) -> str:
    """The package holding ``package``'s stage ``top`` of ``kata`` over the reference's."""
    digest = hashlib.sha1(package.encode()).hexdigest()[:10]
    name = f"_kata_based_{digest}_{kata}_{top}"
    if name not in _BASED.packages:
        own = _source_dir(f"{package}.{kata}")
        reference = _source_dir(f"solutions.{kata}")
        _BASED.packages[name] = (kata, top, own, reference)
        if _BASED not in sys.meta_path:
            sys.meta_path.insert(0, _BASED)
    return name


#: The options that choose what a run tests, declared once for every parser that takes
#: them: pytest's (``group.addoption``), the child runner's and the kata command's
#: (``parser.add_argument``).
SELECTION_OPTIONS: dict[str, dict[str, Any]] = {
    "--impl": {
        "default": None,
        "metavar": "katas|solutions|PATH",
        "help": "what to test: your working copy 'katas' (default; env KATA_IMPL), the "
        "reference 'solutions', or a directory laid out like solutions/",
    },
    "--base": {
        "default": None,
        "choices": ["own", "reference"],
        "help": "earlier stages: the tested implementation's own (default) or the reference's "
        "(env KATA_BASE)",
    },
}


def add_selection_options(add: Callable[..., object], *, base: bool = True) -> None:
    """Declare ``--impl`` (and ``--base``) with ``add`` (``add_argument``/``addoption``)."""
    for name, options in SELECTION_OPTIONS.items():
        if base or name != "--base":
            add(name, **options)


@functools.cache
def stage_module(kata: str, stage: int) -> str:
    """The module name of ``kata``'s stage ``stage`` (its kata.toml ``stub``, ``stage1``)."""
    found = load_kata(default_root() / kata)
    return found.stage(stage).module


def bad_impl(named: str, spec: str) -> str:
    """The one line for an ``--impl`` (or ``KATA_IMPL``) that names nothing to test."""
    return (
        f"{named} must be 'katas', 'solutions' or a directory laid out like solutions/, "
        f"got {spec!r}"
    )


def _import_path_package(path: Path) -> str:
    """Import the directory ``path`` as a fresh top-level package; return its name."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_kata_impl_{digest}"
    if name not in sys.modules:
        init = path / "__init__.py"
        if init.exists():
            spec = importlib.util.spec_from_file_location(
                name, init, submodule_search_locations=[str(path)]
            )
        else:  # a bare directory of kata folders is a namespace-like package
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(path)]
        if spec is None:  # pragma: no cover - defensive
            raise ImportError(f"cannot import implementation directory {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        if spec.loader is not None:
            spec.loader.exec_module(module)
    return name


def implementation(spec: str | None, default: str = "katas") -> str:
    """The one reading of ``--impl`` (else ``KATA_IMPL``, else ``default``): ``katas``,
    ``solutions``, or a directory made absolute; ValueError, one line, for anything else."""
    named = "--impl" if spec else ENV_IMPL
    spec = spec or os.environ.get(ENV_IMPL) or default
    if spec in ("katas", "solutions"):
        return spec
    path = Path(spec).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(bad_impl(named, spec))
    return str(path)


def resolve(spec: str | None = None, base: str | None = None) -> Selection:
    """Resolve ``--impl`` / ``KATA_IMPL`` (default ``katas``) to a :class:`Selection`."""
    spec = implementation(spec)
    base = base or os.environ.get(ENV_BASE) or None
    if base not in (None, "own", "reference"):
        raise ValueError(f"base must be 'own' or 'reference', got {base!r}")
    package = spec if spec in ("katas", "solutions") else _import_path_package(Path(spec))
    return Selection(spec, package, base if base == "reference" else None)


def profile_name() -> str:
    """``KATA_PROFILE`` (default ``dev``); ValueError, one line, if it names no profile."""
    name = os.environ.get(ENV_PROFILE) or "dev"
    if name not in PROFILES:
        raise ValueError(f"{ENV_PROFILE} must be one of {', '.join(PROFILES)}, got {name!r}")
    return name


def selection_argv(selection: Selection) -> list[str]:
    """The arguments that give a worker process the same selection as this process."""
    argv = ["--impl", selection.spec]
    if selection.base:
        argv += ["--base", selection.base]
    return argv
