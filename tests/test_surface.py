"""Check 4: public-surface parity of stubs and references (the import rules: test_layout)."""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

import pytest
from _support import stage_suites

from katas._registry.impl import REPO_ROOT

STAGES = [pytest.param(k, s, id=f"{k}-stage{s}") for k, s in stage_suites()]


def _public(module: ModuleType) -> dict[str, Any]:
    """Names a stage module defines itself (imports excluded), without a leading underscore."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and obj.__module__ == module.__name__
    }


def _members(cls: type) -> dict[str, str]:
    """Public methods and properties, inherited ones included (a private base may hold them)."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") and name != "__init__":
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, property):
            out[name] = "property"
        elif callable(attr) or isinstance(attr, staticmethod | classmethod):
            out[name] = str(inspect.signature(getattr(cls, name)))
    return out


@pytest.mark.parametrize(("kata", "stage"), STAGES)
def test_stub_and_reference_have_the_same_public_surface(kata: str, stage: int) -> None:
    stub = importlib.import_module(f"katas.{kata}.stage{stage}")
    ref = importlib.import_module(f"solutions.{kata}.stage{stage}")
    stub_names, ref_names = _public(stub), _public(ref)
    assert sorted(stub_names) == sorted(ref_names), (
        f"{kata} stage {stage}: public names differ — stub only: "
        f"{sorted(set(stub_names) - set(ref_names))}, reference only: "
        f"{sorted(set(ref_names) - set(stub_names))}"
    )
    for name, ref_obj in ref_names.items():
        stub_obj = stub_names[name]
        if inspect.isclass(ref_obj):
            assert _members(stub_obj) == _members(ref_obj), (
                f"{kata} stage {stage}: {name}'s public methods differ:\n"
                f"  stub:      {_members(stub_obj)}\n  reference: {_members(ref_obj)}"
            )
        else:
            assert str(inspect.signature(stub_obj)) == str(inspect.signature(ref_obj)), (
                f"{kata} stage {stage}: {name} signatures differ"
            )


@pytest.mark.parametrize(("kata", "stage"), STAGES)
def test_stub_marks_where_the_learner_works(kata: str, stage: int) -> None:
    text = (REPO_ROOT / "katas" / kata / f"stage{stage}.py").read_text()
    assert f"# TODO(stage{stage})" in text, (
        f"katas/{kata}/stage{stage}.py lacks # TODO(stage{stage})"
    )
    assert "raise Todo()" in text, f"katas/{kata}/stage{stage}.py: a stub raises Todo()"
