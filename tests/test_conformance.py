"""Check 6: every stage class meant to implement a Protocol of its kata's ``api.py`` does,
in the stub and in the reference alike — checked by ``mypy --strict`` (tests/test_lint.py),
without building anything.

Each ``conform_*`` function (in ``tests/conform_<kata>.py``, one module a kata) takes an
instance of one stage class and returns it as the Protocol that class implements, so a
missing method, or one whose signature the Protocol's callers could not use, is a type
error there. The tests below keep the list honest at run time: each function's class has
every member of its Protocol, and every Protocol an ``api.py`` defines is implemented by
at least one stub class and one reference class.

Every class a stub builds implements one. Some Protocols describe what the learner's code
calls rather than builds — the dynamic batcher's ``Model`` (the harness's ``FakeModel``)
and the router's replicas, ``ReplicaLink`` and ``Completion`` — and are checked against
the harness's classes instead.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from types import ModuleType

import conform_dynamic_batcher
import conform_job_scheduler
import conform_kv_cache
import conform_rate_limiter
import conform_streaming_parser
import pytest

from katas._registry.catalog import Catalog
from katas._registry.impl import REPO_ROOT

#: The modules holding the ``conform_*`` functions, one a kata.
MODULES: tuple[ModuleType, ...] = (
    conform_dynamic_batcher,
    conform_job_scheduler,
    conform_kv_cache,
    conform_rate_limiter,
    conform_streaming_parser,
)


# --- run time ---------------------------------------------------------------------------

#: Names typing puts on every Protocol class: not members of the contract.
_NOT_MEMBERS = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__"}


def _conformances() -> list[tuple[str, type, type]]:
    """``(function name, stage class, Protocol)`` of every ``conform_*`` function."""
    out = []
    for module in MODULES:
        for name, fn in sorted(vars(module).items()):
            if name.startswith("conform_") and inspect.isfunction(fn):
                hints = typing.get_type_hints(fn)
                out.append((name, hints["x"], hints["return"]))
    return out


def _is_protocol(cls: object) -> bool:
    return inspect.isclass(cls) and bool(getattr(cls, "_is_protocol", False))


def _members(protocol: type) -> set[str]:
    """The methods and properties a Protocol (and the Protocols it extends) declares."""
    return {
        name
        for base in protocol.__mro__
        if _is_protocol(base) and base is not typing.Protocol
        for name, value in vars(base).items()
        if (callable(value) or isinstance(value, property)) and name not in _NOT_MEMBERS
    }


def _api_protocols() -> list[type]:
    """Every Protocol defined (not re-exported) by a kata's ``api.py``."""
    out = []
    for path in sorted((REPO_ROOT / "katas").glob("*/api.py")):
        api = importlib.import_module(f"katas.{path.parent.name}.api")
        out += [
            cls
            for cls in vars(api).values()
            if _is_protocol(cls) and cls.__module__ == api.__name__
        ]
    return out


CONFORMANCES = _conformances()


@pytest.mark.parametrize(
    ("name", "cls", "protocol"), CONFORMANCES, ids=[c[0] for c in CONFORMANCES]
)
def test_stage_class_has_every_member_of_its_protocol(name: str, cls: type, protocol: type) -> None:
    assert _is_protocol(protocol), f"{name} returns {protocol!r}, not a Protocol"
    missing = sorted(m for m in _members(protocol) if not hasattr(cls, m))
    assert not missing, (
        f"{cls.__module__}.{cls.__qualname__} lacks {missing} of {protocol.__name__}"
    )


@pytest.mark.parametrize("protocol", _api_protocols(), ids=lambda p: f"{p.__module__}.{p.__name__}")
def test_every_api_protocol_has_a_stub_and_a_reference_implementing_it(protocol: type) -> None:
    implementers = [cls for _, cls, p in CONFORMANCES if p is protocol]
    if any("._testing." in cls.__module__ for cls in implementers):
        return  # the harness implements it (a model the batcher drives), the learner calls it
    roots = {cls.__module__.split(".")[0] for cls in implementers}
    assert roots >= {"katas", "solutions"}, (
        f"{protocol.__module__}.{protocol.__name__}: no conform_* function for a "
        f"{'stub' if 'katas' not in roots else 'reference'} class in tests/conform_<kata>.py"
    )


def _stub_classes() -> list[type]:
    """Every public class a kata's Python stub defines, errors aside: each a component
    the learner builds."""
    out = []
    for kata in Catalog(REPO_ROOT / "katas").katas():
        for stage in kata.stages:
            if not stage.stub.endswith(".py"):
                continue
            stub = importlib.import_module(f"katas.{kata.name}.{stage.module}")
            out += [
                cls
                for name, cls in vars(stub).items()
                if inspect.isclass(cls)
                and cls.__module__ == stub.__name__
                and not name.startswith("_")
                and not issubclass(cls, BaseException)
            ]
    return out


@pytest.mark.parametrize("cls", _stub_classes(), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_class_a_stub_builds_implements_a_protocol_of_its_api(cls: type) -> None:
    assert any(c is cls for _, c, _ in CONFORMANCES), (
        f"{cls.__module__}.{cls.__name__} implements no Protocol of its api.py: give the "
        "component its Protocol there and conform_* functions in tests/conform_<kata>.py"
    )
