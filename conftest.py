"""Loads the kata harness for every pytest run inside the repository."""

pytest_plugins = ["katas._kit.pytest_plugin", "katas._kit.redis"]
