"""What the dynamic batcher's suites share: the fake model, workloads and the simulator."""
