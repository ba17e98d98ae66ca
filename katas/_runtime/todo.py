"""The stub sentinel: ``raise Todo()`` marks what the learner has still to write.

The harness reports a ``Todo`` as one line, ``not implemented yet: <what> — stage N, see
katas/<kata>/README.md``, never as a crash. ``NotImplementedError`` stays what Python
means by it ("abstract"), so a reference or a model that raises one is a real error.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import FrameType

_STAGE_FILE = re.compile(r"stage(\d+)\.py$")


class Todo(Exception):
    """An unwritten function or method of a stub.

    Its message is derived from where it is raised — the function's qualified name, and
    the stage and prompt of the file it is in — so a stub says only ``raise Todo()``.
    """

    def __init__(self, what: str | None = None, where: str | None = None) -> None:
        # A C binding names both (it has no Python frame of its own).
        frame = sys._getframe(1)
        what = what or _qualname(frame)
        super().__init__(f"{what} — {where or _where(Path(frame.f_code.co_filename))}")


def _qualname(frame: FrameType) -> str:
    code = frame.f_code
    qualname: str | None = getattr(code, "co_qualname", None)  # Python 3.11+
    if qualname is not None:
        return qualname
    owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
    if owner is None:
        return code.co_name
    cls = owner if isinstance(owner, type) else type(owner)
    return f"{cls.__name__}.{code.co_name}"


def _where(path: Path) -> str:
    prompt = f"see katas/{path.parent.name}/README.md"
    stage = _STAGE_FILE.search(path.name)
    return f"stage {stage[1]}, {prompt}" if stage else prompt
