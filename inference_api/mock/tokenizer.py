"""A byte-level tokenizer: token i < 256 is byte i; one end token. UTF-8 text splits across tokens."""

from __future__ import annotations

from collections.abc import Sequence

EOS = 256
VOCAB = 257


class ByteTokenizer:
    chat_template = None  # (its turns are written by encode_chat; no think tags)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def offsets(self, text: str) -> list[tuple[int, int, int]]:
        """Each byte's token with the offsets of the character it belongs to."""
        out: list[tuple[int, int, int]] = []
        for i, ch in enumerate(text):
            out.extend((b, i, i + 1) for b in ch.encode("utf-8"))
        return out

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """The turns in a fixed template (no tools: prepare.encode writes them into plain messages)."""
        turns = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return self.encode(turns + "<|assistant|>")

    def encode_pair(self, first: str, second: str) -> list[int]:
        return self.encode(first + "\n" + second)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
