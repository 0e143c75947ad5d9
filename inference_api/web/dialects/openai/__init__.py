"""The OpenAI API, with vLLM's extras (/tokenize, /detokenize, its sampling fields)."""
