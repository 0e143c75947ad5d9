"""The decode engine: fixed user rows, continuous batching, per-row sampling and stopping."""
