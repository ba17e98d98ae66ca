"""The import graph: katas are parallel packages over the runtime, the registry, the
harness and the CLI, and nothing shared reaches into a kata (an AST check of every module).

What each module may import, by where it lives (the standard library always):

- ``katas/_runtime``: itself, anyio, redis.
- ``katas/_registry``: itself (tomli on old Pythons).
- ``katas/_harness``: the runtime, the registry, itself, the test tools, and h11 (the
  replicas' HTTP).
- ``katas/_cli``: the runtime, the registry, itself, rich, and bm25s and snowballstemmer
  (interview mode's question matching) — never pytest or hypothesis, which run in child
  processes.
- ``katas/<kata>/api.py``: the runtime.
- a kata's stubs and ``solutions/<kata>/``: the runtime, their kata's ``api``, their own
  package (earlier stages), third-party libraries.
- a kata's suites, benchmarks and ``_testing/``: the runtime, the harness, the registry,
  their kata's ``api`` and ``_testing`` — never a stage module (the harness hands it
  over) and never another suite.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from katas._registry.impl import REPO_ROOT

SHARED = ("_runtime", "_registry", "_harness", "_cli")
TEST_TOOLS = ("pytest", "_pytest", "hypothesis", "fakeredis", "redis", "anyio", "trio")


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path`` (relative ones resolved)."""
    package = path.relative_to(REPO_ROOT).with_suffix("").parts[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


ANY = None  # any third-party library
#: Per layer: the shared packages it may import, and the third-party libraries.
LAYERS: dict[str, tuple[set[str], set[str] | None]] = {
    "_runtime": ({"_runtime"}, {"anyio", "redis"}),
    "_registry": ({"_runtime", "_registry"}, {"tomli"}),
    "_harness": ({"_runtime", "_registry", "_harness"}, {*TEST_TOOLS, "exceptiongroup", "h11"}),
    "_cli": ({"_runtime", "_registry", "_cli"}, {"rich", "bm25s", "snowballstemmer"}),
    "api": ({"_runtime"}, set()),
    "stage": ({"_runtime"}, ANY),
    "solution": ({"_runtime"}, ANY),
    "suite": ({"_runtime", "_registry", "_harness"}, ANY),
}


def _layer(rel: tuple[str, ...]) -> str:
    if rel[0] == "katas" and rel[1] in SHARED:
        return rel[1]
    if rel[0] == "solutions":
        return "solution"
    if rel[-1] == "api.py":
        return "api"
    if rel[-1].startswith(("test_", "bench_")) or "_testing" in rel:
        return "suite"
    return "stage"


def _kata_modules_allowed(layer: str, rel: tuple[str, ...], parts: list[str]) -> bool:
    """Whether a module of kata ``rel[1]`` in ``layer`` may import the kata module ``parts``."""
    if len(parts) < 2 or parts[1] != rel[1]:
        return False  # another kata's, or a bare package name (handled by the caller)
    leaf = parts[2] if len(parts) > 2 else ""
    if layer == "stage":
        return parts[0] == "katas" and (leaf == "api" or leaf.startswith("stage"))
    if layer == "solution":
        return (parts[0] == "katas" and leaf == "api") or parts[0] == "solutions"
    if layer == "suite":
        return parts[0] == "katas" and leaf in ("api", "_testing")
    return False


def _allowed(path: Path, name: str) -> bool:
    """Whether the module at ``path`` may import ``name``."""
    rel = path.relative_to(REPO_ROOT).parts
    layer = _layer(rel)
    shared_ok, third_ok = LAYERS[layer]
    parts = name.split(".")
    top = parts[0]
    if top in sys.stdlib_module_names or top == "__future__" or name in ("katas", "solutions"):
        return True
    if top == "katas" and parts[1] in SHARED:
        return parts[1] in shared_ok
    if top in ("katas", "solutions"):
        return layer not in SHARED and _kata_modules_allowed(layer, rel, parts)
    return third_ok is ANY or top in third_ok


def _checked() -> list[Path]:
    return sorted(
        p
        for base in ("katas", "solutions")
        for p in (REPO_ROOT / base).rglob("*.py")
        if "__pycache__" not in p.parts
    )


@pytest.mark.parametrize("path", _checked(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_module_imports_only_what_its_layer_may(path: Path) -> None:
    bad = [(line, name) for line, name in _imports(path) if not _allowed(path, name)]
    rel = path.relative_to(REPO_ROOT).as_posix()
    assert not bad, (
        f"{rel} imports what its layer may not (see tests/test_layout.py): "
        + ", ".join(f"line {line}: {name}" for line, name in bad)
    )


def _suites() -> list[Path]:
    return sorted((REPO_ROOT / "katas").glob("*/test_stage*.py"))


@pytest.mark.parametrize("path", _suites(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_a_suites_example_counts_follow_the_profile(path: Path) -> None:
    """``max_examples`` in a suite is never a number: a number runs that many examples under
    dev, ci and thorough alike (``profiles.examples(at_ci=…)`` scales one)."""
    fixed = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.keyword)
        and node.arg == "max_examples"
        and isinstance(node.value, ast.Constant)
    ]
    rel = path.relative_to(REPO_ROOT).as_posix()
    assert not fixed, (
        f"{rel}: max_examples is a fixed number on line(s) {', '.join(map(str, fixed))}; it "
        "must follow the profile: katas._harness.profiles.examples(at_ci=N) or heavy_examples()"
    )
