"""What a Redis call can raise, for a stage-3 component's ``except``.

redis-py's own errors are RedisErrors, except one: a cluster client that can reach no
node at all raises RedisClusterUnreachableError, which is not. A component that caught
only RedisError would let a whole-cluster outage escape its failure mode.
:func:`katas._runtime.clients.unavailable` then tells a Redis that cannot serve now from
a bug.

Imported by stage-3 code only: importing a kata's ``api`` does not import redis.
"""

from __future__ import annotations

import redis
from redis.exceptions import RedisClusterUnreachableError

REDIS_FAILURES = (redis.RedisError, RedisClusterUnreachableError)

__all__ = ["REDIS_FAILURES"]
