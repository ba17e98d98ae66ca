"""What the repository holds, read the same way by every tool: the katas and their
``kata.toml``, prompts and their rules, the bug catalogue, the implementation a run
selects, and suite runs in child processes with their reports.

May import: the standard library (tomli before Python 3.11) and the runtime (to build a
kata's C modules). Never a kata, the harness or the CLI.
"""
