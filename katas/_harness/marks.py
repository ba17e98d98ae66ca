"""The marks a kata test carries, by the names the suites use.

``core`` and ``extended`` say which part of a stage a test belongs to (a timed attempt
runs the core first); ``rule("id", …)`` names the rules of the prompt it checks (the
plugin quotes them when it fails); ``anyio_test`` runs an async test on asyncio and on
trio; ``processes`` marks a test that starts OS processes of the code under test
(seconds of wall time: the catalogue sweep's sample of other tests leaves it out). A
suite imports them (``from katas._harness.marks import core, rule``) instead of spelling
``pytest.mark.…`` again.
"""

from __future__ import annotations

import pytest

core = pytest.mark.core
extended = pytest.mark.extended
rule = pytest.mark.rule
anyio_test = pytest.mark.anyio
processes = pytest.mark.processes

__all__ = ["anyio_test", "core", "extended", "processes", "rule"]
