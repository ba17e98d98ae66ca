"""The streaming-parser kata: Server-Sent Events exactly as WHATWG defines them, and LLM deltas."""
