"""The review round's material (``kata review``): every catalogue entry is proposed with a
rationale that does not give it away, every stage has sound changes, and each sound
change passes its whole stage suite (with ``--catalogue``, as the entries' sweep).
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import Pool, embedded_env, module_pool, selected, stage_suites

from katas._registry import mutants
from katas._registry.suites import SuiteRun, run_suite, suite_files
from katas._registry.warm import WarmStart

CATALOGUE = mutants.load()
SOUND = mutants.load_sound()
#: Sound changes a stage offers at least: a round shows about a third of its changes so.
SOUND_PER_STAGE = 2
RATIONALE_MAX = 110
#: Words a proposed change's rationale never says: it is presented as an improvement.
_GIVES_AWAY = re.compile(r"§|\b(bug|wrong|broken|incorrect|fix(es|ed)?)\b", re.IGNORECASE)
WAIT_S = 1200
#: Whole suites, after the stage suites' and before the catalogue's short runs.
POOL_ORDER = 1
_WARM = WarmStart()


def _proposal_problems(change: mutants.Mutant) -> list[str]:
    rationale = change.rationale
    if not rationale:
        return ["no '# rationale:' line"]
    problems = []
    if len(rationale) > RATIONALE_MAX:
        problems.append(f"a rationale of {len(rationale)} characters (at most {RATIONALE_MAX})")
    if found := _GIVES_AWAY.search(rationale):
        problems.append(f"the rationale says {found.group(0)!r}: it gives the change away")
    if any(test in rationale for test in change.catches):
        problems.append("the rationale names a test")
    return problems


def test_every_change_is_proposed_with_a_rationale_that_does_not_give_it_away() -> None:
    bad = {c.name: p for c in [*CATALOGUE, *SOUND] if (p := _proposal_problems(c))}
    assert not bad, (
        f"{len(bad)} of {len(CATALOGUE) + len(SOUND)} proposed changes:\n"
        + "\n".join(f"  {name}: {'; '.join(p)}" for name, p in list(bad.items())[:20])
        + ("\n  …" if len(bad) > 20 else "")
    )


@pytest.mark.parametrize(("kata", "stage"), stage_suites())
def test_every_stage_has_sound_changes_that_apply(kata: str, stage: int, tmp_path: Path) -> None:
    mine = [c for c in SOUND if c.kata == kata and c.stage == stage]
    assert len(mine) >= SOUND_PER_STAGE, (
        f"{kata} stage {stage}: {len(mine)} sound change(s) in tests/reviews/{kata}/, "
        f"a review round needs at least {SOUND_PER_STAGE}"
    )
    for n, change in enumerate(mine):
        assert change.sound, f"{change.path}: no '# sound:' line (why behaviour is unchanged)"
        mutants.materialise(change, tmp_path / str(n))  # ValueError: it does not apply


def _run(change: mutants.Mutant, base: dict[str, str]) -> SuiteRun:
    with tempfile.TemporaryDirectory(prefix="kata-sound-") as tmp:
        impl = str(mutants.materialise(change, Path(tmp) / "impl"))
        env = {**embedded_env(base), "KATA_PROFILE": "mutant"}
        return run_suite(suite_files(change.kata, change.stage), impl=impl, env=env, warm=_WARM)


def start_runs(items: list[pytest.Item]) -> Pool[SuiteRun]:
    base = dict(os.environ)
    chosen = [p["change"] for p in selected(items, "test_a_sound_change_passes_its_stage_suite")]
    return Pool({c.name: functools.partial(_run, c, base) for c in chosen})


@pytest.fixture(scope="module")
def sound_runs(request: pytest.FixtureRequest) -> Iterator[Pool[SuiteRun]]:
    pool = module_pool(request, start_runs)
    yield pool
    pool.shutdown()
    _WARM.close()


@pytest.mark.catalogue
@pytest.mark.timeout(WAIT_S)
@pytest.mark.parametrize("change", SOUND, ids=[c.name for c in SOUND])
def test_a_sound_change_passes_its_stage_suite(
    change: mutants.Mutant, sound_runs: Pool[SuiteRun]
) -> None:
    run = sound_runs.result(change.name)
    failed = run.failures()
    assert run.results and run.returncode == 0 and not failed, (
        f"{change.path.name} ({change.rationale}) is offered as sound, but its stage suite "
        f"fails on it (exit code {run.returncode}):\n"
        + "\n".join(f"  {r.nodeid}: {r.outcome} ({r.kind}) {r.message}" for r in failed[:10])
        + (f"\n{run.output[-2000:]}" if not run.results else "")
    )
