"""The Redis client a stage-3 component accepts: one that fails a lost reply fast, once.

A stage-3 call is one script. If the client resends a command whose reply was lost (the
script ran, the answer did not arrive), the script runs again: a rate-limit request is
charged twice, a job enqueued twice, a lease granted that no worker knows of. redis-py
retries by default, so the contract is explicit: a ``socket_timeout`` (a blackholed server
must not hang the caller) and no automatic retries. Whether a call is retried, and how it
is made safe to repeat, is then the component's decision, in the open.

What a component sends is JSON, and JSON must not change it silently: :func:`to_json`
refuses what it would drop or could not encode.

Imported by the kata ``api`` modules, for the stage-3 stubs and references alike.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any

#: How a server that is up but cannot serve now answers: busy with a long script (BUSY),
#: loading its data (LOADING), a replica cut off from its master (MASTERDOWN), a cluster
#: slot moving or down (TRYAGAIN, CLUSTERDOWN).
UNAVAILABLE_REPLIES = ("BUSY ", "LOADING ", "MASTERDOWN ", "TRYAGAIN ", "CLUSTERDOWN ")

#: The client the prompts show, which this accepts.
EXAMPLE = "redis.Redis(..., socket_timeout=0.2, retry=Retry(NoBackoff(), 0))"


#: Nesting deeper than this is refused: JSON (and the reader's stack) would give out.
MAX_JSON_DEPTH = 100


def to_json(name: str, value: Any) -> str:
    """``value`` as compact JSON; ``TypeError`` naming ``name`` for what JSON would refuse
    or change: a dict key that is not a str (``{1: 'a', '1': 'b'}`` would lose an entry),
    NaN, a set or an object, nesting deeper than :data:`MAX_JSON_DEPTH`. (A tuple is
    encoded, and comes back as a list.)"""
    stack = [(value, 0)]
    while stack:  # iterative: a deep value must not exhaust the stack here either
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise TypeError(f"{name} nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, str):
                    raise TypeError(
                        f"{name} has the dict key {key!r}, not a str: JSON would make it "
                        f"{json.dumps(str(key))}, merging it with any key of that name"
                    )
                stack.append((inner, depth + 1))
        elif isinstance(item, list | tuple):
            stack.extend((inner, depth + 1) for inner in item)
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be JSON for Redis, got {reprlib.repr(value)}: {e}") from None


def unavailable(error: BaseException) -> bool:
    """Whether ``error`` says Redis cannot serve now — the connection refused or reset, a
    timeout, or a reply of :data:`UNAVAILABLE_REPLIES` — which a component's failure mode
    handles, rather than a bug (a script error, a wrong type), which is raised."""
    import redis  # here, so that importing a kata's api does not import redis

    # A cluster client that can reach no node at all raises RedisClusterUnreachableError,
    # which is not a RedisError (redis_errors.REDIS_FAILURES catches both).
    unreachable = redis.exceptions.RedisClusterUnreachableError
    if isinstance(error, redis.ConnectionError | redis.TimeoutError | unreachable):
        return True
    # redis-py raises these replies as types of their own, their code cut from the text
    # (MasterDownError is a ClusterDownError); a cluster client that kept getting TRYAGAIN
    # or redirections until its own bound ran out raises ClusterError("TTL exhausted.")
    typed = redis.exceptions.ClusterError | redis.exceptions.TryAgainError
    if isinstance(error, typed):
        return True
    return isinstance(error, redis.ResponseError) and str(error).startswith(UNAVAILABLE_REPLIES)


def check_client(client: Any, name: str = "client") -> None:
    """ValueError naming ``name`` unless ``client`` (redis-py or fakeredis, sync or async,
    a ``Redis`` or a ``RedisCluster``) has a socket timeout and makes no automatic
    retries."""
    kwargs = client.get_connection_kwargs() if hasattr(client, "get_connection_kwargs") else {}
    if kwargs.get("socket_timeout") is None:
        raise ValueError(
            f"{name} must have a socket_timeout: without one a blackholed Redis hangs every "
            f"call (e.g. {EXAMPLE})"
        )
    # a cluster client keeps its Retry as ``retry`` (it has no ``get_retry``)
    retry = client.get_retry() if hasattr(client, "get_retry") else getattr(client, "retry", None)
    retries = retry.get_retries() if retry is not None else 0
    if retries:
        raise ValueError(
            f"{name} retries failed commands ({retries} retries): a script whose reply was "
            f"lost would run again — charged, enqueued or leased twice. Pass "
            f"retry=Retry(NoBackoff(), 0) (e.g. {EXAMPLE})"
        )
