"""The dynamic-batcher kata: continuous batching with paged KV blocks, and its C hot path."""
