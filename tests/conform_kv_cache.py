"""The kv_cache kata's conformances: each ``conform_*`` function returns an instance of a
stage class as the Protocol of ``katas/kv_cache/api.py`` it implements (see
tests/test_conformance.py)."""

from __future__ import annotations

import katas.kv_cache.stage1 as kv_stub1
import katas.kv_cache.stage2 as kv_stub2
import solutions.kv_cache.stage1 as kv_ref1
import solutions.kv_cache.stage2 as kv_ref2
from katas.kv_cache import api as kv

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
