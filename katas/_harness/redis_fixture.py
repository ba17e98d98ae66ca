"""The ``redis_env`` and ``redis_cluster`` fixtures and the ``redis_faults`` marker, in
every suite run.

Only a test that asks for the fixture imports :mod:`katas._harness.redis` and with it
fakeredis and redis-py: half a second of every run that needs no Redis, and a
catalogue sweep starts hundreds.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from katas._registry.impl import ENV_REDIS_CLUSTER, ENV_REDIS_SERVER

#: The environment variable naming the ``redis-server`` the harness starts (mode 2).
ENV_SERVER = ENV_REDIS_SERVER
#: The environment variable of an external Redis server (mode 3).
ENV_URL = "KATA_REDIS_URL"
#: The environment variable naming the ``redis-server`` a Redis Cluster is built of (mode 4).
ENV_CLUSTER = ENV_REDIS_CLUSTER
#: How a test that needs a real Redis Cluster, and has none, is skipped: on the embedded
#: default that is the one skip the repository's checks accept.
CLUSTER_SKIP = "needs a real Redis Cluster"

if TYPE_CHECKING:
    from katas._harness.redis import RedisEnv
    from katas._harness.redis_cluster import LocalCluster


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "redis_faults: restarts, stops or flushes a Redis server (private servers only)"
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    """The shared cluster and the clusters built ahead of tests that never came end with
    the session (only a run that built a cluster has imported the module)."""
    cluster = sys.modules.get("katas._harness.redis_cluster")
    if cluster is not None:
        cluster.close_session()


@pytest.fixture
def redis_env(request: pytest.FixtureRequest) -> Iterator[RedisEnv]:
    """The test's Redis, in the mode the environment chose (see :mod:`katas._harness.redis`).

    Mark a test ``redis_faults`` when it restarts, stops or flushes a server, and
    ``realtime`` when it lets real server time pass.
    """
    from katas._harness.redis import RedisEnv

    env = RedisEnv.from_environment(
        faults=request.node.get_closest_marker("redis_faults") is not None,
        realtime=request.node.get_closest_marker("realtime") is not None,
        name=request.node.name,
    )
    try:
        yield env
    finally:
        env.close()


def cluster_command() -> list[str]:
    """The command a test's own cluster starts with: ``KATA_REDIS_CLUSTER``, else
    ``KATA_REDIS_SERVER``; the test is skipped when neither is set."""
    import os
    import shlex

    command = os.environ.get(ENV_CLUSTER) or os.environ.get(ENV_SERVER)
    if not command:
        pytest.skip(
            f"{CLUSTER_SKIP} (it moves slots and kills masters): set {ENV_CLUSTER}="
            f"redis-server (or {ENV_SERVER}) to run it"
        )
    return shlex.split(command)


@pytest.fixture
def redis_cluster() -> Iterator[LocalCluster]:
    """A Redis Cluster of three masters of the test's own, to reshard and kill masters
    of (:func:`cluster_command` says how it starts)."""
    from katas._harness.redis_cluster import LocalCluster

    with LocalCluster(command=cluster_command()) as cluster:
        yield cluster
