"""The learner's working copy: one package per kata, plus the shared harness in ``_kit``."""
