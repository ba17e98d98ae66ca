"""Static against continuous batching, drawn: slot occupancy and queue depth over
simulated time, and the TTFT and TPOT of each — in the terminal, or as a PNG.

    python -m katas.dynamic_batcher._testing.pictures               # your stage 1
    python -m katas.dynamic_batcher._testing.pictures --impl=solutions --png batching.png

The workload is the suite's: 256 requests at once, output lengths exponential of mean
128, 32 slots. ``--png`` needs the plotting extra (``pip install -e '.[plot]'``). A batcher
still a stub stops it with one line that names what it needs.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from katas._registry import impl
from katas._runtime.todo import Todo
from katas.dynamic_batcher._testing.charts import distribution_chart, occupancy_chart, save_png
from katas.dynamic_batcher._testing.model import FakeModel
from katas.dynamic_batcher._testing.simulate import Report, simulate
from katas.dynamic_batcher._testing.workload import COMPARISON, Comparison
from katas.dynamic_batcher.api import Batcher

#: What each run needs from the stage, in the order a learner writes them (core first).
NEEDS = {
    "continuous": "ContinuousBatcher (stage 1, core)",
    "static": "StaticBatcher (stage 1, extended)",
}


class NotWritten(Exception):
    """A batcher the pictures run is still a stub; the message is the one line to show."""


def reports(selection: impl.Selection, c: Comparison = COMPARISON) -> dict[str, Report]:
    """Both batchers of ``selection``'s stage 1 over the comparison's workload, static
    first; NotWritten names the first still a stub, ContinuousBatcher before StaticBatcher."""
    stage = selection.stage("dynamic_batcher", 1)
    workload = c.workload()

    def model() -> FakeModel:
        return FakeModel(
            vocab_size=32_000, seed=7, num_blocks=c.num_blocks, block_size=c.block_size
        )

    batchers: dict[str, Callable[[], Batcher]] = {
        "continuous": lambda: stage.ContinuousBatcher(
            model(), max_num_seqs=c.slots, max_num_batched_tokens=c.token_budget,
            num_blocks=c.num_blocks, block_size=c.block_size,
        ),
        "static": lambda: stage.StaticBatcher(model(), batch_size=c.slots),
    }  # fmt: skip
    found: dict[str, Report] = {}
    for name, make in batchers.items():
        try:
            found[name] = simulate(make(), workload, slots=c.slots)
        except Todo as exc:
            what = str(exc).partition(" — ")[0]  # the stub's function, without the prompt
            raise NotWritten(
                f"the picture needs {NEEDS[name]} — not implemented yet: {what}"
            ) from None
    return {"static": found["static"], "continuous": found["continuous"]}


def occupancy_note(found: Mapping[str, Report], width: int = 72) -> str:
    """What the occupancy figures are, against the continuous-wins rule's 90%: one sentence."""
    waiting = ", ".join(f"{name} {r.occupancy_while_queued:.0%}" for name, r in found.items())
    return textwrap.fill(
        "Occupancy is running requests / slots, averaged over every step, the drain at the "
        "end included; the 90% bar (rule continuous-wins) counts only the steps with a request "
        f"waiting (here {waiting}), because only then is an idle slot the batcher's own "
        "waste.",
        width,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m katas.dynamic_batcher._testing.pictures", description=__doc__
    )
    impl.add_selection_options(parser.add_argument, base=False)
    parser.add_argument("--png", type=Path, help="also save the pictures to this PNG")
    args = parser.parse_args(argv)
    try:
        found = reports(impl.resolve(args.impl))
    except NotWritten as exc:
        print(exc, file=sys.stderr)
        return 1
    for name, report in found.items():
        print(f"{name}:\n{report.summary()}\n")
    print(occupancy_chart(found))
    print(occupancy_note(found))
    for name, report in found.items():
        print(distribution_chart(report.ttft_ns, title=f"{name}: TTFT"))
        print(distribution_chart(report.tpot_ns, title=f"{name}: TPOT"))
    if args.png is not None:
        save_png(found, args.png)
        print(f"saved {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
