"""shortfin's LLM server API."""
