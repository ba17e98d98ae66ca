"""Reference solution of the rate-limiter kata."""
