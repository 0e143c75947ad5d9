"""The mock backend: the real engine over a fake model and a byte tokenizer, no weights.

It echoes each prompt back at a fixed rate, so the HTTP layer, stop sequences, cancellation and
the queue bound can be exercised in milliseconds, and clients developed without a model.
"""
