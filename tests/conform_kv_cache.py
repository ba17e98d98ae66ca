"""The kv_cache kata's conformances: each ``conform_*`` function returns an instance of a
stage class as the Protocol of ``katas/kv_cache/api.py`` it implements (see
tests/test_conformance.py)."""

from __future__ import annotations

import katas.kv_cache.stage1 as kv_stub1
import katas.kv_cache.stage2 as kv_stub2
import katas.kv_cache.stage3 as kv_stub3
import solutions.kv_cache.stage1 as kv_ref1
import solutions.kv_cache.stage2 as kv_ref2
import solutions.kv_cache.stage3 as kv_ref3
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


# --- kv_cache: stage 1's caches evict (the seam stage 2 uses), by recency, time or frequency


def conform_stub_evicting_lru_cache(x: kv_stub1.LRUCache) -> kv.EvictingCache:
    return x


def conform_ref_evicting_lru_cache(x: kv_ref1.LRUCache) -> kv.EvictingCache:
    return x


def conform_stub_evicting_lfu_cache(x: kv_stub1.LFUCache) -> kv.EvictingCache:
    return x


def conform_ref_evicting_lfu_cache(x: kv_ref1.LFUCache) -> kv.EvictingCache:
    return x


def conform_stub_expiring_ttl_cache(x: kv_stub1.TTLCache) -> kv.ExpiringCache:
    return x


def conform_ref_expiring_ttl_cache(x: kv_ref1.TTLCache) -> kv.ExpiringCache:
    return x


def conform_stub_frequency_lfu_cache(x: kv_stub1.LFUCache) -> kv.FrequencyCache:
    return x


def conform_ref_frequency_lfu_cache(x: kv_ref1.LFUCache) -> kv.FrequencyCache:
    return x


# --- kv_cache: stage 2's wrappers load single-flight, for threads and for tasks


def conform_stub_loading_concurrent_cache(x: kv_stub2.ConcurrentCache) -> kv.LoadingCache:
    return x


def conform_ref_loading_concurrent_cache(x: kv_ref2.ConcurrentCache) -> kv.LoadingCache:
    return x


def conform_stub_loading_async_cache(x: kv_stub2.AsyncCache) -> kv.AsyncLoadingCache:
    return x


def conform_ref_loading_async_cache(x: kv_ref2.AsyncCache) -> kv.AsyncLoadingCache:
    return x


# --- kv_cache: stage 3's ring, the sharded cache over Redis, and the near cache before it


def conform_stub_hash_ring(x: kv_stub3.HashRing) -> kv.Ring:
    return x


def conform_ref_hash_ring(x: kv_ref3.HashRing) -> kv.Ring:
    return x


def conform_stub_sharded_cache(x: kv_stub3.ShardedCache) -> kv.RemoteCache:
    return x


def conform_ref_sharded_cache(x: kv_ref3.ShardedCache) -> kv.RemoteCache:
    return x


def conform_stub_near_cache(x: kv_stub3.NearCache) -> kv.CoherentCache:
    return x


def conform_ref_near_cache(x: kv_ref3.NearCache) -> kv.CoherentCache:
    return x
