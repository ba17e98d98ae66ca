"""The classic-bug catalogue: small diffs against the reference, each a realistic mistake.

A catalogue entry is ``tests/mutants/<kata>/stageN_<bug>.diff``: header lines, then a
unified diff whose paths are relative to ``solutions/`` (``a/<kata>/stageN.py``)::

    # bug: the one-line "common mistake" a learner reads
    # why: what goes wrong, and when
    # symptom: what a user or an on-call engineer reports, never naming the cause
    # rationale: how the change would be proposed in a review, never admitting the defect
    # catches: test_stage1_name test_stage1_other test_stage1_param[one]
    # needs: cluster      (optional: its tests need a real Redis Cluster)

The repository's checks apply each entry to a copy of ``solutions/`` and require every
named test (every parametrization, or only the one named with its id) to fail by
assertion while the mutant still passes most other tests.

The review round (``kata review``) mixes entries with *sound* changes:
``tests/reviews/<kata>/stageN_<change>.diff``, the same format with the header lines
``# rationale:`` and ``# sound:`` (why behaviour is unchanged); the repository's checks
require the whole stage suite to pass on each.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from katas._registry.impl import ENV_REDIS_CLUSTER, ENV_REDIS_SERVER, REPO_ROOT

CATALOGUE = REPO_ROOT / "tests" / "mutants"
REVIEWS = REPO_ROOT / "tests" / "reviews"
_NAME = re.compile(r"stage(?P<stage>\d+)_(?P<slug>[a-z0-9_]+)\.diff")


@dataclass(frozen=True)
class Mutant:
    """One catalogue entry, or a sound change of the review round (``sound`` set, no
    ``bug``)."""

    path: Path
    kata: str
    stage: int
    slug: str
    bug: str
    why: str
    catches: tuple[str, ...]
    #: the incident a debugging round reports instead of the bug's name
    symptom: str = ""
    #: what its tests need beyond the embedded default: ``cluster`` (a real Redis Cluster)
    needs: tuple[str, ...] = ()
    #: how the change is proposed in the review round
    rationale: str = ""
    #: a sound change: why behaviour is unchanged
    sound: str = ""

    @property
    def name(self) -> str:
        return f"{self.kata}/{self.path.stem}"


def parse(path: Path, required: tuple[str, ...] = ("bug", "why", "catches")) -> Mutant:
    """Read one ``.diff`` file; ValueError names the file and what is missing.

    ``required``: the header lines it must have (a blind hunt's bug has no ``catches``
    yet: see ``tests/hunt.py``).
    """
    match = _NAME.fullmatch(path.name)
    if match is None:
        raise ValueError(f"{path}: catalogue files are named stageN_<bug>.diff")
    header: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("# "):
            break
        field, _, value = line[2:].partition(":")
        header[field.strip()] = (header.get(field.strip(), "") + " " + value.strip()).strip()
    for field in required:
        if not header.get(field):
            raise ValueError(f"{path}: header line '# {field}: ...' is missing")
    return Mutant(
        path=path,
        kata=path.parent.name,
        stage=int(match["stage"]),
        slug=match["slug"],
        bug=header.get("bug", ""),
        why=header.get("why", ""),
        catches=tuple(header.get("catches", "").split()),
        symptom=header.get("symptom", ""),
        needs=tuple(header.get("needs", "").split()),
        rationale=header.get("rationale", ""),
        sound=header.get("sound", ""),
    )


def changed_lines(mutant: Mutant) -> list[str]:
    """The lines the diff removes or adds, without their ``-``/``+``."""
    lines = mutant.path.read_text().splitlines()
    return [
        line[1:]
        for line in lines
        if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
    ]


def body(mutant: Mutant) -> str:
    """The diff itself, its header lines left off."""
    lines = mutant.path.read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("# "))


def load(kata: str | None = None) -> list[Mutant]:
    """Every catalogue entry (of one kata, if named), sorted by kata, stage and name."""
    pattern = f"{kata}/*.diff" if kata else "*/*.diff"
    return sorted(
        (parse(p) for p in CATALOGUE.glob(pattern)), key=lambda m: (m.kata, m.stage, m.slug)
    )


def load_sound(kata: str | None = None, folder: Path = REVIEWS) -> list[Mutant]:
    """Every sound change of the review round (of one kata, if named), sorted."""
    pattern = f"{kata}/*.diff" if kata else "*/*.diff"
    return sorted(
        (parse(p, required=("rationale", "sound")) for p in folder.glob(pattern)),
        key=lambda m: (m.kata, m.stage, m.slug),
    )


def materialise(mutant: Mutant, dest: Path, solutions: Path = REPO_ROOT / "solutions") -> Path:
    """Copy ``solutions/`` to ``dest`` and apply the mutant there; return ``dest``."""
    copy_solutions(solutions, dest)
    apply(mutant, dest)
    return dest


def copy_solutions(solutions: Path, dest: Path) -> None:
    """A copy of the references to apply entries to: no caches, no built modules."""
    shutil.copytree(solutions, dest, ignore=shutil.ignore_patterns("__pycache__", "*.so"))


def shows_here(mutant: Mutant, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a run here can show the entry's failure: one whose tests need a real Redis
    Cluster, only where a ``redis-server`` to build one of is configured."""
    if "cluster" in mutant.needs:
        return bool(environ.get(ENV_REDIS_CLUSTER) or environ.get(ENV_REDIS_SERVER))
    return True


def apply(mutant: Mutant, tree: Path) -> None:
    """Apply the mutant to ``tree``, a copy of ``solutions/`` (perhaps with other entries
    applied already); ValueError if it does not apply cleanly."""
    result = subprocess.run(
        ["patch", "-p1", "--batch", "--forward", "--silent", "-i", str(mutant.path)],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise ValueError(
            f"{mutant.path}: does not apply to solutions/: {result.stdout}{result.stderr}"
        )


def touched_files(mutant: Mutant) -> list[str]:
    """The files the diff changes, relative to ``solutions/`` (``kata/stageN.py``)."""
    return [
        line[len("+++ b/") :].split("\t")[0].strip()
        for line in mutant.path.read_text().splitlines()
        if line.startswith("+++ b/")
    ]
