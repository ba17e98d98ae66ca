"""The dynamic batcher's C hot path over int32 columns (built from ``csrc/``)."""

from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

#: The ``array`` typecode of a column: native int32.
TYPECODE: str
#: The largest value a column entry can hold (2**31 - 1).
INT_MAX: int

def fill_token_budget(
    need: Buffer, chunk: Buffer, *, token_budget: int, max_seqs: int
) -> tuple[int, int]:
    """Apply one step's token budget to requests in scheduling order.

    ``need[i] >= 1`` is the tokens request ``i`` still has to compute. Each request gets
    ``chunk[i] = min(need[i], budget left)``, in order, until the budget is spent or
    ``max_seqs`` requests are scheduled; ``chunk[i] = 0`` for the rest. ``need`` and
    ``chunk`` are int32 buffers of the same length (``chunk`` writable, not overlapping
    ``need``). Returns ``(requests scheduled, tokens scheduled)``.
    """
