# The reference's module has the kata's surface: one type stub, katas/dynamic_batcher/_hotpath.pyi.
from katas.dynamic_batcher._hotpath import *  # noqa: F403
