"""Check 6: every stage class meant to implement a Protocol of its kata's ``api.py`` does,
in the stub and in the reference alike — checked by ``mypy --strict`` (tests/test_lint.py),
without building anything.

Each ``conform_*`` function takes an instance of one stage class and returns it as the
Protocol that class implements, so a missing method, or one whose signature the
Protocol's callers could not use, is a type error here. The tests below keep the list
honest at run time: each function's class has every member of its Protocol, and every
Protocol an ``api.py`` defines is implemented by at least one stub class and one
reference class.

Not listed, because they implement no Protocol of their ``api.py`` (their surfaces are
their own, compared stub against reference by tests/test_surface.py):

- rate_limiter: ``MultiLimiter`` (a cost per limit), ``AsyncLimiter`` (an ``async``
  acquire, no ``peek``/``reset``), ``ConcurrencyLimiter`` and ``RedisConcurrencyLimiter``
  (leases), ``RedisRateLimiter`` (no ``tracked_keys``/``sweep``: Redis expires the keys)
  and ``AsyncRedisRateLimiter`` (``async``);
- kv_cache: stage 3's ``ShardedCache`` and ``NearCache`` (remote: no ``len``/iteration);
- job_scheduler: the queues, pools and workers;
- dynamic_batcher: stage 2's ``AsyncEngine`` and ``DynamicBatcher``, stage 3's
  ``ReplicaSet`` and ``Router`` (their streams are ``api.TokenStream``s, below; the
  router's replicas, ``api.ReplicaLink`` and ``api.Completion``, are the harness's).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing

import pytest

import katas.dynamic_batcher.stage1 as db_stub1
import katas.dynamic_batcher.stage2 as db_stub2
import katas.dynamic_batcher.stage3 as db_stub3
import katas.job_scheduler.stage1 as js_stub1
import katas.job_scheduler.stage3 as js_stub3
import katas.kv_cache.stage1 as kv_stub1
import katas.kv_cache.stage2 as kv_stub2
import katas.rate_limiter.stage1 as rl_stub1
import katas.rate_limiter.stage2 as rl_stub2
import solutions.dynamic_batcher.stage1 as db_ref1
import solutions.dynamic_batcher.stage2 as db_ref2
import solutions.dynamic_batcher.stage3 as db_ref3
import solutions.job_scheduler.stage1 as js_ref1
import solutions.job_scheduler.stage3 as js_ref3
import solutions.kv_cache.stage1 as kv_ref1
import solutions.kv_cache.stage2 as kv_ref2
import solutions.rate_limiter.stage1 as rl_ref1
import solutions.rate_limiter.stage2 as rl_ref2
from katas._registry.impl import REPO_ROOT
from katas.dynamic_batcher import api as db
from katas.dynamic_batcher._testing.fleet import SimCompletion
from katas.dynamic_batcher._testing.http_link import HttpLink
from katas.dynamic_batcher._testing.model import FakeModel
from katas.dynamic_batcher._testing.replica_client import CompletionStream
from katas.job_scheduler import api as js
from katas.kv_cache import api as kv
from katas.rate_limiter import api as rl

# --- rate_limiter: stage-1 limiters are sweepable; the stage-2 wrapper is a limiter ----


def conform_stub_token_bucket(x: rl_stub1.TokenBucket) -> rl.SweepableLimiter:
    return x


def conform_ref_token_bucket(x: rl_ref1.TokenBucket) -> rl.SweepableLimiter:
    return x


def conform_stub_sliding_log(x: rl_stub1.SlidingLog) -> rl.SweepableLimiter:
    return x


def conform_ref_sliding_log(x: rl_ref1.SlidingLog) -> rl.SweepableLimiter:
    return x


def conform_stub_gcra(x: rl_stub1.GCRA) -> rl.SweepableLimiter:
    return x


def conform_ref_gcra(x: rl_ref1.GCRA) -> rl.SweepableLimiter:
    return x


def conform_stub_fixed_window(x: rl_stub1.FixedWindow) -> rl.SweepableLimiter:
    return x


def conform_ref_fixed_window(x: rl_ref1.FixedWindow) -> rl.SweepableLimiter:
    return x


def conform_stub_sliding_window_counter(x: rl_stub1.SlidingWindowCounter) -> rl.SweepableLimiter:
    return x


def conform_ref_sliding_window_counter(x: rl_ref1.SlidingWindowCounter) -> rl.SweepableLimiter:
    return x


def conform_stub_thread_safe_limiter(x: rl_stub2.ThreadSafeLimiter) -> rl.RateLimiter:
    return x


def conform_ref_thread_safe_limiter(x: rl_ref2.ThreadSafeLimiter) -> rl.RateLimiter:
    return x


# --- kv_cache: the stage-1 caches and the stage-2 wrappers are caches -------------------


def conform_stub_lru_cache(x: kv_stub1.LRUCache) -> kv.Cache:
    return x


def conform_ref_lru_cache(x: kv_ref1.LRUCache) -> kv.Cache:
    return x


def conform_stub_ttl_cache(x: kv_stub1.TTLCache) -> kv.Cache:
    return x


def conform_ref_ttl_cache(x: kv_ref1.TTLCache) -> kv.Cache:
    return x


def conform_stub_lfu_cache(x: kv_stub1.LFUCache) -> kv.Cache:
    return x


def conform_ref_lfu_cache(x: kv_ref1.LFUCache) -> kv.Cache:
    return x


def conform_stub_concurrent_cache(x: kv_stub2.ConcurrentCache) -> kv.Cache:
    return x


def conform_ref_concurrent_cache(x: kv_ref2.ConcurrentCache) -> kv.Cache:
    return x


def conform_stub_async_cache(x: kv_stub2.AsyncCache) -> kv.Cache:
    return x


def conform_ref_async_cache(x: kv_ref2.AsyncCache) -> kv.Cache:
    return x


# --- job_scheduler: the effect stores ---------------------------------------------------


def conform_stub_memory_effect_store(x: js_stub1.MemoryEffectStore) -> js.EffectStore:
    return x


def conform_ref_memory_effect_store(x: js_ref1.MemoryEffectStore) -> js.EffectStore:
    return x


def conform_stub_redis_effect_store(x: js_stub3.RedisEffectStore) -> js.EffectStore:
    return x


def conform_ref_redis_effect_store(x: js_ref3.RedisEffectStore) -> js.EffectStore:
    return x


# --- dynamic_batcher: both batchers are what simulate() drives; the model is the harness's


def conform_stub_continuous_batcher(x: db_stub1.ContinuousBatcher) -> db.Batcher:
    return x


def conform_ref_continuous_batcher(x: db_ref1.ContinuousBatcher) -> db.Batcher:
    return x


def conform_stub_static_batcher(x: db_stub1.StaticBatcher) -> db.Batcher:
    return x


def conform_ref_static_batcher(x: db_ref1.StaticBatcher) -> db.Batcher:
    return x


def conform_stub_prefix_caching_batcher(x: db_stub2.PrefixCachingBatcher) -> db.Batcher:
    return x


def conform_ref_prefix_caching_batcher(x: db_ref2.PrefixCachingBatcher) -> db.Batcher:
    return x


def conform_stub_token_stream(x: db_stub2._Stream) -> db.TokenStream:
    return x


def conform_ref_token_stream(x: db_ref2._Stream) -> db.TokenStream:
    return x


def conform_stub_routed_stream(x: db_stub3._RoutedStream) -> db.TokenStream:
    return x


def conform_ref_routed_stream(x: db_ref3._RoutedStream) -> db.TokenStream:
    return x


def conform_harness_fake_model(x: FakeModel) -> db.Model:
    return x  # a Protocol the kata calls and the harness implements: no stub, no reference


def conform_harness_http_link(x: HttpLink) -> db.ReplicaLink:
    return x  # the router calls links; the harness implements them, over HTTP and in process


def conform_harness_completion_stream(x: CompletionStream) -> db.Completion:
    return x


def conform_harness_sim_completion(x: SimCompletion) -> db.Completion:
    return x


# --- run time ---------------------------------------------------------------------------

#: Names typing puts on every Protocol class: not members of the contract.
_NOT_MEMBERS = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__"}


def _conformances() -> list[tuple[str, type, type]]:
    """``(function name, stage class, Protocol)`` of every ``conform_*`` function."""
    module = sys.modules[__name__]
    out = []
    for name, fn in sorted(vars(module).items()):
        if name.startswith("conform_") and inspect.isfunction(fn):
            hints = typing.get_type_hints(fn)
            out.append((name, hints["x"], hints["return"]))
    return out


def _is_protocol(cls: object) -> bool:
    return inspect.isclass(cls) and bool(getattr(cls, "_is_protocol", False))


def _members(protocol: type) -> set[str]:
    """The methods and properties a Protocol (and the Protocols it extends) declares."""
    return {
        name
        for base in protocol.__mro__
        if _is_protocol(base) and base is not typing.Protocol
        for name, value in vars(base).items()
        if (callable(value) or isinstance(value, property)) and name not in _NOT_MEMBERS
    }


def _api_protocols() -> list[type]:
    """Every Protocol defined (not re-exported) by a kata's ``api.py``."""
    out = []
    for path in sorted((REPO_ROOT / "katas").glob("*/api.py")):
        api = importlib.import_module(f"katas.{path.parent.name}.api")
        out += [
            cls
            for cls in vars(api).values()
            if _is_protocol(cls) and cls.__module__ == api.__name__
        ]
    return out


CONFORMANCES = _conformances()


@pytest.mark.parametrize(
    ("name", "cls", "protocol"), CONFORMANCES, ids=[c[0] for c in CONFORMANCES]
)
def test_stage_class_has_every_member_of_its_protocol(name: str, cls: type, protocol: type) -> None:
    assert _is_protocol(protocol), f"{name} returns {protocol!r}, not a Protocol"
    missing = sorted(m for m in _members(protocol) if not hasattr(cls, m))
    assert not missing, (
        f"{cls.__module__}.{cls.__qualname__} lacks {missing} of {protocol.__name__}"
    )


@pytest.mark.parametrize("protocol", _api_protocols(), ids=lambda p: f"{p.__module__}.{p.__name__}")
def test_every_api_protocol_has_a_stub_and_a_reference_implementing_it(protocol: type) -> None:
    implementers = [cls for _, cls, p in CONFORMANCES if p is protocol]
    if any("._testing." in cls.__module__ for cls in implementers):
        return  # the harness implements it (a model the batcher drives), the learner calls it
    roots = {cls.__module__.split(".")[0] for cls in implementers}
    assert roots >= {"katas", "solutions"}, (
        f"{protocol.__module__}.{protocol.__name__}: no conform_* function for a "
        f"{'stub' if 'katas' not in roots else 'reference'} class in tests/test_conformance.py"
    )
