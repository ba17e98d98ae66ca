"""Reference solution of the streaming-parser kata."""
