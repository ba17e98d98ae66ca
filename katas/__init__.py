"""The learner's working copy: one package per kata, over the shared ``_runtime``
(what api.py imports), ``_registry``, ``_harness`` (pytest) and ``_cli`` (the kata command)."""

from katas._runtime import native as _native

# A kata's C modules are built from the importing implementation's own sources.
_native.install()
