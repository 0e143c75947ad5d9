"""llama-stack's inference API (0.0.x)."""
