"""What the rate limiter's suites share: exact models and the drivers around them."""
