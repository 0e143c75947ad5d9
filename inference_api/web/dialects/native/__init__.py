"""The native API, compatible with the original inference API, and the server's /health and /metrics."""
