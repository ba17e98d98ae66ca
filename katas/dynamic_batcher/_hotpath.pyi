"""The dynamic batcher's C hot path over int32 columns: the contract is csrc/hotpath.h."""

from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

#: The ``array`` typecode of a column: native int32.
TYPECODE: str
#: The largest value a column entry can hold (2**31 - 1).
INT_MAX: int

def fill_token_budget(
    need: Buffer, chunk: Buffer, *, token_budget: int, max_seqs: int
) -> tuple[int, int]:
    """``hp_fill_token_budget`` (see csrc/hotpath.h) over ``need`` and the writable
    ``chunk``, int32 buffers of one length; returns ``(requests, tokens)`` scheduled."""

def schedule(
    known: Buffer,
    computed: Buffer,
    held: Buffer,
    table: Buffer,
    free_ids: Buffer,
    chunk: Buffer,
    *,
    n: int,
    free_top: int,
    stride: int,
    block_size: int,
    token_budget: int,
    max_seqs: int,
) -> tuple[int, int, int, int, int]:
    """``hp_schedule`` (see csrc/hotpath.h) over writable int32 columns: the running rows'
    chunks and blocks for one step, preempting from the last row when blocks run short;
    returns ``(rows scheduled, tokens, rows preempted, n, free_top)``."""

def apply(
    known: Buffer,
    computed: Buffer,
    held: Buffer,
    table: Buffer,
    free_ids: Buffer,
    chunk: Buffer,
    finished: Buffer,
    *,
    n: int,
    free_top: int,
    stride: int,
    block_size: int,
    seqs: int,
) -> tuple[int, int]:
    """``hp_apply`` (see csrc/hotpath.h): rows ``0 .. seqs`` compute their ``chunk``, rows
    flagged 1 in ``finished`` are released and the rest moved down in order; returns
    ``(n, free_top)``."""
