"""A byte-level tokenizer: token i < 256 is byte i; one end token. UTF-8 text splits across tokens."""
from __future__ import annotations

from typing import Sequence

EOS = 256
VOCAB = 257


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        turns = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return self.encode(turns + "<|assistant|>")

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
