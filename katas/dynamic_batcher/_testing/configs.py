"""The configurations a paged batcher refuses, shared by the stage-1 batcher's suite and
the prefix-caching batcher's: the two take the same settings, over a model's pool, and
must refuse the same nonsense, naming the setting that is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _pytest.mark import ParameterSet

from katas._harness.story import check


def bad_configurations(num_blocks: int) -> list[ParameterSet]:
    """``(name, options)`` cases any paged batcher refuses, over a model of ``num_blocks``
    blocks of 4 tokens: the setting it must name, and the options that are wrong."""
    return [
        pytest.param("max_num_seqs", {"max_num_seqs": 0}, id="no-seqs"),
        pytest.param("max_num_batched_tokens", {"max_num_batched_tokens": 0}, id="no-budget"),
        pytest.param(
            "max_num_batched_tokens",
            {"max_num_seqs": 8, "max_num_batched_tokens": 7},
            id="budget-under-the-seqs",
        ),
        pytest.param("num_blocks", {"num_blocks": 0}, id="no-blocks"),
        pytest.param("num_blocks", {"num_blocks": num_blocks - 1}, id="not-the-models-pool"),
        pytest.param("block_size", {"block_size": 8}, id="not-the-models-blocks"),
        pytest.param("policy", {"policy": "lifo"}, id="unknown-policy"),
    ]


def accepted_configurations() -> list[ParameterSet]:
    """``(options, requests)`` cases at the edge of what a paged batcher accepts, over a
    model of blocks of 4 (``num_blocks`` and ``block_size`` left to the model's): the
    options, and how many requests to serve with them."""
    return [
        pytest.param({"max_num_seqs": 8, "max_num_batched_tokens": 8}, 8, id="budget-is-the-seqs"),
        pytest.param({"max_num_seqs": 1, "max_num_batched_tokens": 1}, 2, id="ones"),
    ]


def expect_refused_by_name(
    build: Callable[..., object],
    config: dict[str, Any],
    name: str,
    options: dict[str, Any],
    rule: str,
) -> None:
    """``build(**config)`` with ``options`` over it raises an error whose message names the
    setting ``name``: ``ValueError`` for an int or a str out of bounds, ``TypeError`` for
    a value of another type (a float, a bool)."""
    __tracebackhide__ = True
    wanted = ValueError if all(type(v) in (int, str) for v in options.values()) else TypeError
    with pytest.raises((ValueError, TypeError)) as caught:
        build(**{**config, **options})
    check(
        isinstance(caught.value, wanted) and name in str(caught.value),
        f"{rule}: {options} must be refused with a {wanted.__name__} naming {name!r}, "
        f"got {caught.value!r}",
    )


__all__ = ["accepted_configurations", "bad_configurations", "expect_refused_by_name"]
