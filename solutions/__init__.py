"""Reference solutions: the same layout and public surface as ``katas/``."""
