"""The ``kata`` command: list, show, start, pair, hints, progress, reset and reveal.

May import: the runtime, the registry and rich. Never the harness, pytest or hypothesis
in-process (suites run in child processes), never a kata.
"""
