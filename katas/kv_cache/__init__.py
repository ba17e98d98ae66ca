"""The KV-cache kata: LRU, TTL and LFU eviction, then single-flight loading, then sharding."""
