"""A kata's C extension modules, built from the implementation's own sources on import.

A kata declares a C extension module by its type stub, ``katas/<kata>/<module>.pyi``,
beside ``katas/<kata>/csrc/CMakeLists.txt`` (which calls ``katas_extension()``, see the
top-level ``CMakeLists.txt``). When any implementation's package of that kata imports
the module (``katas.<kata>``, ``solutions.<kata>``, or an ``--impl`` directory's), this
finder builds *that implementation alone* — its own CMake tree under ``build/native/``,
only the module's target — and loads the result. So an edited C file never runs stale,
and a compile error in the learner's C is the error of importing the learner's module
only: the reference still builds and imports. A temporary copy whose C is the reference's
or the stub's, to the byte (a catalogue entry that changes only Python), loads the module
built in that tree instead of building its own.

Outside a checkout (an installed wheel, no ``CMakeLists.txt``) the finder steps aside and
the prebuilt module in the package is imported as usual.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from katas._runtime.children import dies_with_parent

#: The ``katas`` package: where every kata's contract (headers, binding, .pyi) lives.
CONTRACTS = Path(__file__).resolve().parents[1]
#: The checkout: the top-level CMakeLists.txt includes every kata's csrc/.
SOURCE_ROOT = CONTRACTS.parent
BUILD_ROOT = SOURCE_ROOT / "build" / "native"
#: In each tree: the implementation it builds (trees of vanished ones are pruned).
SOURCE_NOTE = "implementation.txt"
#: In each tree, per module: the digest of the sources its last good build was made from.
DIGEST_SUFFIX = "sources.sha256"
#: The trees of temporary copies of an implementation.
_COPY_PREFIX = "impl-"
#: How many lines of compiler output an ImportError quotes.
QUOTED_LINES = 25


#: A line that reports an error: a compiler's diagnostic, a linker's, or CMake's.
_ERROR_LINE = re.compile(r"(?:^|:\s*|\s)(?:fatal )?error:|^CMake Error|undefined reference", re.I)


#: What a BuildError's first line says between the module and the compiler's first error.
BUILD_SAYS = " does not build: "


class BuildError(ImportError):
    """The C of an implementation does not configure or compile; ``str()`` quotes why."""


def declared(kata: str, module: str) -> bool:
    """Whether ``module`` is a C extension module of ``kata``."""
    return (CONTRACTS / kata / f"{module}.pyi").is_file() and (
        CONTRACTS / kata / "csrc" / "CMakeLists.txt"
    ).is_file()


def spec_for(fullname: str, kata_dir: Path) -> importlib.machinery.ModuleSpec:
    """The spec of ``fullname``, the C module built from ``kata_dir``'s ``csrc/``.

    ``kata_dir`` is one implementation's folder of the kata (its parent holds the kata
    folders of that implementation).
    """
    module = fullname.rpartition(".")[2]
    built = build(kata_dir.name, module, kata_dir.parent)
    loader = importlib.machinery.ExtensionFileLoader(fullname, str(built))
    spec = importlib.util.spec_from_file_location(fullname, built, loader=loader)
    if spec is None:  # pragma: no cover - defensive
        raise BuildError(f"cannot load {built}", name=fullname)
    return spec


#: Builds that failed in this process, by tree, module and the sources' newest mtime: a
#: run builds a broken C once, and every later import of the same sources (each test's)
#: raises the same error at once; an edit is built again.
_FAILED: dict[tuple[Path, str, str, int], BuildError] = {}


def build(kata: str, module: str, implementation: Path) -> Path:
    """Build ``kata``'s ``module`` from ``implementation``; return the built file."""
    tree = BUILD_ROOT / _tree_name(implementation)
    sources = implementation / kata / "csrc"
    if not sources.is_dir():
        raise BuildError(f"{kata}.{module}: {sources} is missing (the C of the implementation)")
    key = (tree, kata, module, max((p.stat().st_mtime_ns for p in sources.iterdir()), default=0))
    if key in _FAILED:
        raise _FAILED[key]
    if tree.name.startswith(_COPY_PREFIX) and (same := _built_alike(kata, module, sources)):
        return same
    try:
        return _build(tree, kata, module, implementation)
    except BuildError as exc:
        _FAILED[key] = exc
        raise


def _build(tree: Path, kata: str, module: str, implementation: Path) -> Path:
    tree.mkdir(parents=True, exist_ok=True)
    target = f"{kata}_{module}_impl_module"
    # One build at a time per tree: parallel test processes import the same module.
    with open(tree.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        digest = tree / f"{kata}.{module}.{DIGEST_SUFFIX}"
        digest.unlink(missing_ok=True)  # a reader must not pair it with a half-built file
        if not (tree / "CMakeCache.txt").is_file():
            _prune()
            (tree / SOURCE_NOTE).write_text(str(implementation))
            _run(_configure(tree, implementation), f"{kata}.{module}", implementation, tree)
        _run(
            [tool("cmake") or "cmake", "--build", str(tree), "--target", target],
            f"{kata}.{module}",
            implementation,
            tree,
        )
        built = Path((tree / "impl" / kata / f"{module}.path").read_text().strip())
        digest.write_text(_digest(kata, implementation / kata / "csrc"))
    return built


def _digest(kata: str, sources: Path) -> str:
    """What a build of ``kata``'s C from ``sources`` depends on: the top-level CMake file,
    the kata's contract (header, binding), the implementation's C, the Python it is for."""
    h = hashlib.sha256(sysconfig.get_config_var("EXT_SUFFIX").encode())
    for folder in (SOURCE_ROOT / "CMakeLists.txt", CONTRACTS / kata / "csrc", sources):
        for path in sorted(folder.iterdir()) if folder.is_dir() else [folder]:
            if path.is_file():
                h.update(f"\0{path.name}\0".encode() + path.read_bytes())
    return h.hexdigest()


def _built_alike(kata: str, module: str, sources: Path) -> Path | None:
    """The module built in the reference's or the stub's tree from the same C as
    ``sources``, if there is one. A temporary copy of an implementation (each catalogue
    entry's, each test's) whose C is unchanged then costs no configure and no compile.
    Only those two trees are reused: they are never pruned while a copy loads from them."""
    digest = _digest(kata, sources)
    for name in ("solutions", "katas"):
        tree = BUILD_ROOT / name
        if not (tree / f"{kata}.{module}.{DIGEST_SUFFIX}").is_file():
            continue
        with open(tree.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # not while that tree is being built
            recorded = tree / f"{kata}.{module}.{DIGEST_SUFFIX}"
            if recorded.is_file() and recorded.read_text() == digest:
                built = Path((tree / "impl" / kata / f"{module}.path").read_text().strip())
                if built.is_file():
                    return built
    return None


def _prune() -> None:
    """Remove the trees of implementations that are gone (a test's temporary copy)."""
    for note in BUILD_ROOT.glob(f"impl-*/{SOURCE_NOTE}"):
        if Path(note.read_text()).is_dir():
            continue
        with open(note.parent.with_suffix(".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being built right now
            shutil.rmtree(note.parent, ignore_errors=True)
            Path(lock.name).unlink(missing_ok=True)


def _tree_name(implementation: Path) -> str:
    if implementation == CONTRACTS:
        return "katas"
    if implementation == SOURCE_ROOT / "solutions":
        return "solutions"
    return _COPY_PREFIX + hashlib.sha1(str(implementation).encode()).hexdigest()[:12]


def tool(name: str) -> str | None:
    """``name`` beside this Python (a venv's pip-installed cmake), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def _configure(tree: Path, implementation: Path) -> list[str]:
    command = [tool("cmake") or "cmake", "-S", str(SOURCE_ROOT), "-B", str(tree)]
    if ninja := tool("ninja"):
        command += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    return [
        *command,
        f"-DKATAS_IMPLEMENTATION={implementation}",
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
    ]


def _run(command: list[str], what: str, implementation: Path, tree: Path) -> None:
    if tool("cmake") is None:
        raise BuildError(f"{what}: building C needs cmake (pip install cmake ninja)")
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, **dies_with_parent()
    )
    if done.returncode == 0:
        return
    output = (done.stdout + done.stderr).splitlines()
    # The compiler's (``file:line:col: error: …``) or CMake's own errors; a path that
    # happens to hold the word "error" is no error.
    errors = [line.strip() for line in output if _ERROR_LINE.search(line)] or output or ["?"]
    if command[1] != "--build":  # a failed configure must not leave a half-made cache
        shutil.rmtree(tree, ignore_errors=True)
    # The first error on the first line: a one-line report shows what to fix.
    raise BuildError(
        f"the C of {what}{BUILD_SAYS}{errors[0]}\n"
        f"(cmake in {tree}, from {implementation / what.split('.')[0] / 'csrc'}):\n"
        + "\n".join(output[-QUOTED_LINES:])
    )


class NativeFinder(importlib.abc.MetaPathFinder):
    """Finds the declared C modules of kata packages and builds them (see the module)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        leaf = fullname.rpartition(".")[2]
        if not path or not (SOURCE_ROOT / "CMakeLists.txt").is_file():
            return None
        # An editable install puts its own directory of built files on __path__ too: the
        # implementation is the entry that holds the sources.
        for entry in path:
            kata_dir = Path(entry)
            if (kata_dir / "csrc").is_dir() and declared(kata_dir.name, leaf):
                return spec_for(fullname, kata_dir)
        return None


FINDER = NativeFinder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if FINDER not in sys.meta_path:
        sys.meta_path.insert(0, FINDER)
