"""Which public names of a stage module the tests call: the evidence that no stub function
can stay unimplemented while its stage goes green.

With ``KATA_REACHED=FILE`` in the environment, :meth:`katas._registry.impl.Selection.stage`
hands each stage module a suite tests to :func:`watch`. Every public function of the
module, and every public method, property and ``__init__`` of its public classes, is
replaced by a thin wrapper. A call from outside the implementation's own folder (a test,
a driver, the harness) appends ``<kata>/<module>:<Class>.<name>`` to ``FILE`` at once (a
test run in a forked child ends with ``os._exit``, so nothing waits for the exit) and
puts the original back, so each name costs one extra call; a call from the
implementation itself (one public method using another) records nothing, since a stub's
author need not write it that way — except a constructor's: a class the implementation
builds for the tests (a stream a multiplexer opens) is reached once it is built.
``tests/test_suites.py`` reads the file after the reference's run of each suite.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_REACHED = "KATA_REACHED"


def public_names(module: ModuleType) -> dict[str, Any]:
    """The public functions and classes that are the module's own: defined in it, or
    re-exported in its ``__all__`` from a helper module of its package that is no stage."""
    package = module.__name__.rpartition(".")[0]

    def own(name: str, obj: object) -> bool:
        home = getattr(obj, "__module__", None)
        if home in (module.__name__, None):
            return True
        helper = home.startswith(package + ".") and not home.rpartition(".")[2].startswith("stage")
        return helper and name in getattr(module, "__all__", ())

    return {
        name: obj
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj))
        and own(name, obj)
    }


def public_members(cls: type) -> list[str]:
    """The public methods and properties of ``cls`` (inherited ones too), and ``__init__``
    where it is the class's own or a public base's rather than ``object``'s."""
    names = [n for n in dir(cls) if not n.startswith("_")]
    if "__init__" in vars(cls):
        names.append("__init__")
    found = []
    for name in names:
        attr = inspect.getattr_static(cls, name)
        if (
            isinstance(attr, property)
            or callable(attr)
            or isinstance(attr, staticmethod | classmethod)
        ):
            found.append(name)
    return found


def expected(module: ModuleType, label: str) -> set[str]:
    """Every name :func:`watch` would wrap in ``module``, labelled as it records them."""
    names: set[str] = set()
    for name, obj in public_names(module).items():
        if inspect.isclass(obj):
            names.update(f"{label}:{name}.{member}" for member in public_members(obj))
        else:
            names.add(f"{label}:{name}")
    return names


def _recorder(
    original: Callable[..., Any], key: str, own_dir: str, undo: Callable[[], None]
) -> Any:
    anyone = key.endswith(".__init__")  # built by the implementation counts too

    @functools.wraps(original)
    def reached(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        if anyone or not caller.startswith(own_dir):
            undo()
            with open(os.environ[ENV_REACHED], "a", encoding="utf-8") as file:
                file.write(key + "\n")
        return original(*args, **kwargs)

    return reached


def _wrap_member(cls: type, name: str, key: str, own_dir: str) -> None:
    attr = inspect.getattr_static(cls, name)
    had_own = name in vars(cls)

    def undo() -> None:
        if had_own:
            setattr(cls, name, attr)
        elif name in vars(cls):
            delattr(cls, name)

    if isinstance(attr, property):
        if attr.fget is None:
            return
        getter = _recorder(attr.fget, key, own_dir, undo)
        setattr(cls, name, property(getter, attr.fset, attr.fdel, attr.__doc__))
    elif isinstance(attr, staticmethod | classmethod):
        wrapped = _recorder(attr.__func__, key, own_dir, undo)
        setattr(cls, name, type(attr)(wrapped))
    elif inspect.isfunction(attr):
        setattr(cls, name, _recorder(attr, key, own_dir, undo))


def watch(module: ModuleType, label: str) -> None:
    """Wrap the public surface of ``module`` (see the module's docstring)."""
    if not os.environ.get(ENV_REACHED) or getattr(module, "__kata_watched__", False):
        return
    module.__kata_watched__ = True  # type: ignore[attr-defined]
    own_dir = str(Path(module.__file__ or "").resolve().parent)
    for name, obj in public_names(module).items():
        if inspect.isclass(obj):
            for member in public_members(obj):
                _wrap_member(obj, member, f"{label}:{name}.{member}", own_dir)
        elif inspect.isfunction(obj):

            def undo(name: str = name, obj: Any = obj) -> None:
                setattr(module, name, obj)

            setattr(module, name, _recorder(obj, f"{label}:{name}", own_dir, undo))


__all__ = ["ENV_REACHED", "expected", "public_members", "public_names", "watch"]
