"""The tokenizer interface the app and the engine share, over a transformers tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]: ...

    def encode_pair(self, first: str, second: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def offsets(self, text: str) -> list[tuple[int, int, int]]: ...

    @property
    def chat_template(self) -> str | None: ...


class HFTokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        # a fast tokenizer's own Rust tokenizer, which encodes the same ids without transformers' Python around it
        # (padding and truncation strategies, none of which the server asks for): 10 us less a short text
        self.backend = self.tok.backend_tokenizer if self.tok.is_fast else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.backend is not None:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def offsets(self, text: str) -> list[tuple[int, int, int]]:
        """(token id, start, stop) for each token of ``text``, character offsets (TGI's /tokenize)."""
        enc = self.tok(text, return_offsets_mapping=True)
        return [(t, a, b) for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (None: a base model without one)."""
        return self.tok.chat_template or None

    @property
    def handles_tools(self) -> bool:
        """Whether the chat template takes ``tools`` (and so calls and tool results in the history, as Hugging
        Face's templates take them); prepare.encode writes them into plain messages for any other template."""
        return "tools" in (self.tok.chat_template or "")

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        if not self.tok.chat_template:
            # a base model without a template: plain concatenation of the turns
            return self.encode("\n".join(m["content"] for m in messages) + "\n")
        text = self.tok.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=True
        )
        return self.encode(text, add_special_tokens=False)

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one input, as the tokenizer joins a pair (a cross-encoder's query and document)."""
        if self.backend is not None:
            return list(self.backend.encode(first, second).ids)
        return self.tok.encode(first, second)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
