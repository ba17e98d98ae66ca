"""What the KV cache's suites share: the entry points of their child processes."""
