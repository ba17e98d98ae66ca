"""Finding the pristine stub of a stage file in git, for ``kata reset``.

HEAD is not always pristine: a learner may commit their own work in their working copy.
So the stub is the newest committed version of the file that still *looks* like a stub
— every function's first statement (after its docstring) raises ``Todo`` (or, in a
version from before the sentinel, NotImplementedError); in C, every function body only
discards its parameters and returns the ``…NOT_IMPLEMENTED`` code —
and, if no version does, the file's first committed version.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

#: How far back in a file's history to look for a pristine version.
MAX_VERSIONS = 200


class PristineError(Exception):
    """No committed stub can be found; ``str()`` is one line for the user."""


#: A C function definition's opening line, up to its brace: ``int f(int a) {``.
_C_FUNCTION = re.compile(r"^[A-Za-z_][\w \t\*]*\([^;{}]*\)\s*\{", re.MULTILINE)
_C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
#: What a C stub's body may say: discard a parameter, return the not-implemented code.
_C_STUB_STATEMENT = re.compile(r"\(void\)\s*\w+|return\s+\w*NOT_IMPLEMENTED")


def looks_like_stub(source: str, suffix: str = ".py") -> bool:
    """Whether every function in ``source`` (a ``suffix`` file) is a stub's."""
    if suffix in (".c", ".h"):
        return _c_looks_like_stub(source)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for function in functions:
        body = list(function.body)
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body = body[1:]
        if not body or not isinstance(body[0], ast.Raise) or body[0].exc is None:
            return False
        exc = body[0].exc
        target = exc.func if isinstance(exc, ast.Call) else exc
        if not (isinstance(target, ast.Name) and target.id in ("Todo", "NotImplementedError")):
            return False
    return bool(functions)


def _c_looks_like_stub(source: str) -> bool:
    code = _C_COMMENT.sub(" ", source)
    for match in _C_FUNCTION.finditer(code):
        body = code[match.end() : code.find("\n}", match.end())]
        statements = [s.strip() for s in body.split(";") if s.strip()]
        if not statements or not all(_C_STUB_STATEMENT.fullmatch(s) for s in statements):
            return False
    return True  # a header (no bodies) is as its kata left it


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PristineError(f"cannot run git: {exc}") from None


def pristine_stub(path: Path) -> tuple[str, str]:
    """``(text, which commit)`` of the pristine committed version of ``path``."""
    path = path.resolve()
    top = _git(path.parent, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise PristineError(
            f"{path.parent} is not in a git checkout, so there is no committed stub to restore"
        )
    root = Path(top.stdout.strip())
    rel = path.relative_to(root.resolve()).as_posix()
    log = _git(root, "log", "--format=%H", f"-n{MAX_VERSIONS}", "--", rel)
    commits = log.stdout.split() if log.returncode == 0 else []
    if not commits:
        raise PristineError(f"{rel} was never committed, so there is no stub to restore")
    oldest: tuple[str, str] | None = None
    for commit in commits:
        shown = _git(root, "show", f"{commit}:{rel}")
        if shown.returncode != 0:  # deleted in that commit
            continue
        if looks_like_stub(shown.stdout, path.suffix):
            return shown.stdout, commit[:12]
        oldest = (shown.stdout, commit[:12])  # the log runs newest first
    if oldest is not None:
        return oldest
    raise PristineError(f"no committed version of {rel} could be read")


__all__ = ["PristineError", "looks_like_stub", "pristine_stub"]
