"""What the streaming-parser suites share: recorded streams, models, encoders."""
