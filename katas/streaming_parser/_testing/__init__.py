"""What the streaming-parser suites share: the oracle, recorded streams, and the drivers
of each stage — parsers and chat chunks (stage 1), sources, consumers and streams of a
mux (stage 2), replicas, fault schedules and resumable sources (stage 3)."""
