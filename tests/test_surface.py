"""Check 4: public-surface parity of stubs and references (the import rules: test_layout)."""

from __future__ import annotations

import importlib
import inspect

import pytest
from _support import committed_stubs, committed_text, stage_suites

from katas._cli.pristine import looks_like_stub
from katas._registry.catalog import Catalog
from katas._registry.impl import REPO_ROOT, Selection, resolve
from katas._registry.reach import public_names

CATALOG = Catalog(REPO_ROOT / "katas")

STAGES = [pytest.param(k, s, id=f"{k}-stage{s}") for k, s in stage_suites()]


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


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Selection:
    """The committed stubs (a learner's edits are their own business: see test_lint)."""
    return resolve(str(committed_stubs(tmp_path_factory.mktemp("stubs"))))


@pytest.mark.parametrize(("kata", "stage"), STAGES)
def test_stub_and_reference_have_the_same_public_surface(
    kata: str, stage: int, stubs: Selection
) -> None:
    module = CATALOG.get(kata).stage(stage).module
    stub = stubs.stage(kata, stage)
    ref = importlib.import_module(f"solutions.{kata}.{module}")
    stub_names, ref_names = public_names(stub), public_names(ref)
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
    entry = CATALOG.get(kata)
    path = entry.stub_path(entry.stage(stage))
    shown, text = path.relative_to(REPO_ROOT), committed_text(path)
    assert f"TODO(stage{stage})" in text, f"{shown} lacks TODO(stage{stage})"
    # What kata reset takes for the pristine stub (Python: every function raises Todo();
    # C: every body only discards its parameters and returns the not-implemented code).
    assert looks_like_stub(text, path.suffix), f"{shown}: a function of the stub does work"
