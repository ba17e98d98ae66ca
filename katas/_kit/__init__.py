"""The harness shared by every kata: clocks, implementation selection, Redis, CLI."""
