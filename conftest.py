"""Loads the kata harness (with its Redis fixtures) for every pytest run inside the repository."""

pytest_plugins = ["katas._harness.pytest_plugin"]
