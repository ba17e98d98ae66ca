"""The testing harness: the pytest plugin, failure reports, hypothesis profiles, Redis
servers and the fault proxy, waiting, interleavings, histories, child processes,
benchmarks, shared strategies and the fixed walks of stateful tests.

May import: the runtime, the registry, pytest, hypothesis, anyio, redis and fakeredis.
Never a kata: a kata reaches it, it never reaches a kata.
"""
