"""Noticing that the learner saved a file, by polling modification times.

Polling needs no dependency and works on every file system (network mounts, containers,
editors that save by renaming a temporary file). A snapshot is each watched file's
``(mtime_ns, size, inode)``; a save changes at least one of them, and a rename-on-save
changes the inode. :meth:`Watcher.poll` is cheap (a directory walk of one kata folder),
so the session calls it a few times a second.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

#: What a learner edits in a kata folder: Python, and the C of a hot path.
WATCHED_SUFFIXES = (".py", ".c", ".h", ".pyi", ".toml")
_SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", "build"}

Snapshot = dict[str, tuple[int, int, int]]


def snapshot(roots: Iterable[Path], suffixes: tuple[str, ...] = WATCHED_SUFFIXES) -> Snapshot:
    """``{path: (mtime_ns, size, inode)}`` of every watched file below ``roots``."""
    found: Snapshot = {}
    for root in roots:
        if root.is_file():
            candidates: Iterable[tuple[str, list[str], list[str]]] = [
                (str(root.parent), [], [root.name])
            ]
        else:
            candidates = os.walk(root)
        for directory, dirs, files in candidates:
            dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith(".")]
            for name in files:
                if not name.endswith(suffixes) or name.startswith("."):
                    continue
                path = os.path.join(directory, name)
                try:
                    st = os.stat(path)
                except OSError:  # deleted between the listing and the stat
                    continue
                found[path] = (st.st_mtime_ns, st.st_size, st.st_ino)
    return found


class Watcher:
    """Reports which watched files changed since the previous :meth:`poll`."""

    def __init__(self, roots: Iterable[Path]) -> None:
        self.roots = tuple(roots)
        self._last = snapshot(self.roots)

    def poll(self) -> list[Path]:
        """The files created, changed or deleted since the last poll (sorted)."""
        now = snapshot(self.roots)
        changed = {p for p in now.keys() | self._last.keys() if now.get(p) != self._last.get(p)}
        self._last = now
        return sorted(Path(p) for p in changed)


__all__ = ["WATCHED_SUFFIXES", "Snapshot", "Watcher", "snapshot"]
