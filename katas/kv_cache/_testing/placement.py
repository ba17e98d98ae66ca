"""A child process that places keys on a ring: run by the stage-3 suite under other
``PYTHONHASHSEED`` values, to prove every process computes the same placement.

``python -m katas._harness.child katas.kv_cache._testing.placement:run`` reads
``[nodes, keys]`` as JSON on stdin and prints each key's three nodes as JSON.
"""

from __future__ import annotations

import json
import sys

from katas._registry import impl

TARGET = "katas.kv_cache._testing.placement:run"


def run(selection: impl.Selection, argv: list[str]) -> int:
    stage = selection.stage("kv_cache", 3)
    nodes, keys = json.loads(sys.stdin.read())
    ring = stage.HashRing(nodes, vnodes=160)
    print(json.dumps([ring.nodes_for(k, 3) for k in keys]))
    return 0
