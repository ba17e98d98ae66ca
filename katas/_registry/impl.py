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
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from katas._registry.catalog import default_root, load_kata

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_IMPL = "KATA_IMPL"
ENV_PROFILE = "KATA_PROFILE"  # hypothesis profile: dev (default), ci, thorough
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
    _modules: dict[tuple[str, int], ModuleType] = field(default_factory=dict, compare=False)

    def stage(self, kata: str, stage: int) -> ModuleType:
        """Import ``<package>.<kata>.stage<stage>`` (earlier stages from the base, if set)."""
        key = (kata, stage)
        if key not in self._modules:
            if self.base == "reference" and self.package != "solutions":
                # A stage file imports its previous stage relatively (``from .stage1
                # import ...``); relative imports resolve through sys.modules, so
                # seeding the learner's earlier stages with the reference's swaps them.
                for earlier in range(1, stage):
                    name = f"{self.package}.{kata}.{stage_module(kata, earlier)}"
                    sys.modules[name] = importlib.import_module(
                        f"solutions.{kata}.{stage_module(kata, earlier)}"
                    )
            module = f"{self.package}.{kata}.{stage_module(kata, stage)}"
            self._modules[key] = importlib.import_module(module)
        return self._modules[key]


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


def resolve(spec: str | None = None, base: str | None = None) -> Selection:
    """Resolve ``--impl`` / ``KATA_IMPL`` (default ``katas``) to a :class:`Selection`."""
    named = "--impl" if spec else ENV_IMPL
    spec = spec or os.environ.get(ENV_IMPL) or "katas"
    base = base or os.environ.get(ENV_BASE) or None
    if base not in (None, "own", "reference"):
        raise ValueError(f"base must be 'own' or 'reference', got {base!r}")
    if spec in ("katas", "solutions"):
        return Selection(spec, spec, base if base == "reference" else None)
    path = Path(spec).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(bad_impl(named, spec))
    return Selection(str(path), _import_path_package(path), base if base == "reference" else None)


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
