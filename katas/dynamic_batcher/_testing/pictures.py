"""Static against continuous batching, drawn: slot occupancy and queue depth over
simulated time, and the TTFT and TPOT of each — in the terminal, or as a PNG.

    python -m katas.dynamic_batcher._testing.pictures               # your stage 1
    python -m katas.dynamic_batcher._testing.pictures --impl=solutions --png batching.png

The workload is the suite's: 256 requests at once, output lengths exponential of mean
128, 32 slots. ``--png`` needs the plotting extra (``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from katas._registry import impl
from katas.dynamic_batcher._testing.charts import distribution_chart, occupancy_chart, save_png
from katas.dynamic_batcher._testing.model import FakeModel
from katas.dynamic_batcher._testing.simulate import Report, simulate
from katas.dynamic_batcher._testing.workload import COMPARISON, Comparison


def reports(selection: impl.Selection, c: Comparison = COMPARISON) -> dict[str, Report]:
    """Both batchers of ``selection``'s stage 1 over the comparison's workload."""
    stage = selection.stage("dynamic_batcher", 1)
    workload = c.workload()

    def model() -> FakeModel:
        return FakeModel(
            vocab_size=32_000, seed=7, num_blocks=c.num_blocks, block_size=c.block_size
        )

    static = stage.StaticBatcher(model(), batch_size=c.slots)
    continuous = stage.ContinuousBatcher(
        model(), max_num_seqs=c.slots, max_num_batched_tokens=c.token_budget,
        num_blocks=c.num_blocks, block_size=c.block_size,
    )  # fmt: skip
    return {
        "static": simulate(static, workload, slots=c.slots),
        "continuous": simulate(continuous, workload, slots=c.slots),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m katas.dynamic_batcher._testing.pictures", description=__doc__
    )
    impl.add_selection_options(parser.add_argument, base=False)
    parser.add_argument("--png", type=Path, help="also save the pictures to this PNG")
    args = parser.parse_args(argv)
    found = reports(impl.resolve(args.impl))
    for name, report in found.items():
        print(f"{name}:\n{report.summary()}\n")
    print(occupancy_chart(found))
    for name, report in found.items():
        print(distribution_chart(report.ttft_ns, title=f"{name}: TTFT"))
        print(distribution_chart(report.tpot_ns, title=f"{name}: TPOT"))
    if args.png is not None:
        save_png(found, args.png)
        print(f"saved {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
