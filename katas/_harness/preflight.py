"""What a run checks once, before any test runs, so a broken setup is one line, not one
traceback per test.

- **The code under test imports.** A syntax error or an import error in a stage file
  would fail every test of the stage with the same traceback (a hundred of them, and
  thousands of lines). The stage modules the selection needs are imported here: one
  that does not import is one line — ``stage1.py:12: SyntaxError: invalid syntax`` —
  every selected test of its stage is recorded as failing with it, and the run ends.
- **The C builds, once.** When a C unit's test is selected, the kata's C modules are
  built and imported here too, in this process, so every test (and every forked child,
  see :mod:`isolation`) finds them loaded. A compile error is printed once, the
  compiler's first error line whole; the tests that need the module fail with that
  line, and nothing is built again.
- **The Redis server answers.** With ``KATA_REDIS_URL`` set and a Redis test selected,
  a server that does not answer is a configuration error: one line, exit code 2.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import traceback
from pathlib import Path
from urllib.parse import urlparse

import pytest
from _pytest.mark import KeywordMatcher
from _pytest.mark.expression import Expression

from katas._harness.failures import shown_path
from katas._harness.under_test import KataUnderTest
from katas._registry.catalog import CatalogError, load_kata
from katas._runtime.native import BuildError
from katas._runtime.todo import Todo

#: Real seconds a server has to answer a PING.
PING_DEADLINE_S = 2.0


def import_failure(exc: BaseException) -> str:
    """One line for an exception raised while importing the code under test: where (the
    innermost frame of the code, not of importlib), what."""
    if isinstance(exc, SyntaxError):
        where = f"{shown_path(exc.filename)}:{exc.lineno}: " if exc.filename else ""
        text = (exc.text or "").strip()
        return f"{where}{type(exc).__name__}: {exc.msg}" + (f" — {text}" if text else "")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    where = f"{shown_path(frames[-1].filename)}:{frames[-1].lineno}: " if frames else ""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{where}{type(exc).__name__}: {first}".rstrip(": ")


def stage_failure(kata: KataUnderTest, stage: int) -> Exception | None:
    """What stage ``stage`` of ``kata`` (as its suite tests it) raises on import, if it
    does not import (:func:`import_failure` says it in one line)."""
    try:
        kata.stage(stage)
    except Todo:
        return None  # a stub that says so at import: its tests report it one by one
    except Exception as exc:  # whatever the learner's module raises at import
        return exc
    return None


@functools.cache  # asked for every test of a run (isolation.wanted): a kata's stay put
def native_modules(kata_dir: Path) -> list[str]:
    """The C modules a kata declares: a ``<module>.pyi`` beside ``csrc/CMakeLists.txt``."""
    if not (kata_dir / "csrc" / "CMakeLists.txt").is_file():
        return []
    return sorted(p.stem for p in kata_dir.glob("*.pyi"))


def reaches_c(items: list[pytest.Item], kata_dir: Path, stage: int) -> bool:
    """Whether ``items`` (of one stage) include a test of the stage's C unit (a practice
    unit whose file is C, by its ``-k`` keyword): a run of the Python unit alone builds
    no C before its tests (one of them that needs it still builds it), nor does a stage
    whose units are all Python. True where the stage declares no units at all."""
    try:
        declared = load_kata(kata_dir).stage(stage).units
    except CatalogError:
        return True
    if not declared:
        return True
    units = [u for u in declared if u.file.endswith(".c")]
    if not units:
        return False
    selects = [Expression.compile(unit.keyword) for unit in units]
    return any(s.evaluate(KeywordMatcher.from_item(item)) for s in selects for item in items)


def build_failure(kata: KataUnderTest, module: str) -> str | None:
    """One line (the compiler's first error, whole) if ``module`` does not build."""
    try:
        kata.module(module)
    except BuildError as exc:
        return str(exc).splitlines()[0]
    return None


def redis_failure() -> str | None:
    """One line if the configured Redis cannot serve the run (``None`` if it can, or if
    the run uses the embedded server)."""
    # Imported here, not at the top: pytest loads redis_fixture as a plugin (and rewrites
    # its asserts) only if nothing imported it before.
    from katas._harness.redis_fixture import ENV_CLUSTER, ENV_SERVER, ENV_URL

    server = os.environ.get(ENV_SERVER)
    if server and shutil.which(server) is None:
        return f"{ENV_SERVER}={server}: no such program on PATH (install redis-server)"
    cluster = os.environ.get(ENV_CLUSTER)
    if cluster and shutil.which(cluster.split()[0]) is None:
        return f"{ENV_CLUSTER}={cluster}: no such program on PATH (install redis-server)"
    if cluster and shutil.which("redis-cli") is None:
        return f"{ENV_CLUSTER}={cluster}: redis-cli, which creates the cluster, is not on PATH"
    url = os.environ.get(ENV_URL)
    if not url:
        return None
    parsed = urlparse(url)
    if parsed.scheme != "redis":  # a unix socket or TLS: the first test tells
        return None
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    try:
        with socket.create_connection((host, port), timeout=PING_DEADLINE_S) as conn:
            conn.settimeout(PING_DEADLINE_S)
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            answer = conn.recv(64)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return f"{ENV_URL}={url}: nothing answers at {host}:{port} ({reason})"
    if not answer:
        return f"{ENV_URL}={url}: {host}:{port} closed the connection without answering"
    return None  # +PONG, or an error such as NOAUTH: a Redis is there


__all__ = [
    "build_failure",
    "import_failure",
    "native_modules",
    "reaches_c",
    "redis_failure",
    "stage_failure",
]
