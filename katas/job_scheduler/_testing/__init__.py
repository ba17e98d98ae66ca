"""What the job scheduler's suites share: the exact model, test clocks, and the worker
process the stage-3 fault tests start."""
