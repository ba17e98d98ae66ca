"""The learner's working copy: one package per kata, over the shared ``_runtime``
(what api.py imports), ``_registry``, ``_harness`` (pytest) and ``_cli`` (the kata command)."""
