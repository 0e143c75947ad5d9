"""The text-generation-inference (TGI) API."""
