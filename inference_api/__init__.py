"""LLM inference server: Flask front end, continuous-batching engine in a backend process."""
