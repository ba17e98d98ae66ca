"""The rate-limiter kata: token bucket and friends, then threads, then Redis."""
