"""Reference solution of the dynamic-batcher kata, including the C hot path."""
