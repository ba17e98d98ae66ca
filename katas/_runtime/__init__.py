"""The contract runtime: what every kata's ``api.py`` (and so every stub and reference)
imports — clocks, the Redis client contract, the stub sentinel.

May import: the standard library, anyio and redis. Never a kata, the harness or the CLI.
"""
