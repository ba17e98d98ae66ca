"""Reference solution of the KV-cache kata."""
