"""A fake model runner: logits that spell "Echo: <prompt> — " over and over, at a fixed step rate."""

from __future__ import annotations

import time

import torch

from .tokenizer import VOCAB


class MockRunner:
    def __init__(self, rows: int, tokens_per_second: float):
        self.device = torch.device("cpu")
        self.vocab_size = VOCAB
        self.step_seconds = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self._cached: list[list[int]] = [[] for _ in range(rows)]  # each row's tokens by position (its "KV cache")
        self._prompt_len = [0] * rows
        self._last_step = 0.0

    def prefill(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        for row, chunk, start in zip(rows, chunks, starts):
            self._cached[row][start:] = chunk
            self._prompt_len[row] = start + len(chunk)
        return self._logits(rows, [self._prompt_len[r] for r in rows])

    def decode(self, rows: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        wait = self._last_step + self.step_seconds - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # the mock's decode rate; a real model spends this time computing
        self._last_step = time.monotonic()
        for row, token, pos in zip(rows, tokens, positions):
            self._cached[row][pos:] = [token]
        return self._logits(rows, [p + 1 for p in positions])

    verifies = True  # its logits depend on the position alone: a draft's forward gives each token its own step's

    def verify(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Each chunk (a row's last token and its draft) written at start.. of its row: the logits after every
        token, the rows' one after another [sum of the chunks' lengths, V] (one decode step's time)."""
        wait = self._last_step + self.step_seconds - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._last_step = time.monotonic()
        out = []
        for row, chunk, start in zip(rows, chunks, starts):
            self._cached[row][start:] = chunk
            out.append(self._logits([row] * len(chunk), [start + 1 + j for j in range(len(chunk))]))
        return torch.cat(out)

    embeds = True

    def hidden(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor:
        """Token vectors (the mock's: each byte's one-hot over 16 dimensions, by its value and position)."""
        self._cached[row][start:] = ids
        out = torch.zeros(len(ids), 16)
        for i, t in enumerate(ids):
            out[i, (t + start + i) % 16] = 1.0
        return out

    def score(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor:
        """A prefill's logits after every one of ids (the mock's: its last position's, repeated)."""
        return self.prefill([row], [ids], [start]).expand(len(ids), -1)

    def snapshot(self, row: int, length: int) -> list[torch.Tensor]:
        """A row's first length positions (the mock's cache: its tokens), as a prompt cache keeps them."""
        return [torch.tensor(self._cached[row][:length], dtype=torch.int64)]

    def restore(self, row: int, tensors: list[torch.Tensor]) -> None:
        self._cached[row] = tensors[0].tolist()

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self._cached[dst] = self._cached[src][:length]

    def holds(self, cached: int, length: int) -> bool:
        return True  # every position a row wrote (no sliding window)

    @property
    def decode_ahead(self) -> None:
        return None  # no launch ahead

    def _logits(self, rows: list[int], next_positions: list[int]) -> torch.Tensor:
        logits = torch.zeros(len(rows), VOCAB)
        for i, (row, pos) in enumerate(zip(rows, next_positions)):
            end = self._prompt_len[row]
            prompt = bytes(t for t in self._cached[row][:end] if t < 256)
            script = b"Echo: " + prompt[-64:].decode("utf-8", "ignore").encode() + " — ".encode()
            logits[i, script[(pos - end) % len(script)]] = 50.0
        return logits
