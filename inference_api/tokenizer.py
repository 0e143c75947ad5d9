"""The tokenizer interface the app and the engine share, over a transformers tokenizer."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        if not self.tok.chat_template:
            # a base model without a template: plain concatenation of the turns
            return self.encode("\n".join(m["content"] for m in messages) + "\n")
        text = self.tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
