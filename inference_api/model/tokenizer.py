"""The tokenizer interface the app and the engine share: a converted GGUF's tokenizer without transformers
(JsonTokenizer), any other folder's through transformers (HFTokenizer); ``load_tokenizer`` picks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from .loader import is_gguf_folder


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

        # a converted GGUF's folder holds the tokenizer llama.cpp reads from the file (its pre-tokenizer's own
        # regex): transformers 4.57.3+ warns that any local folder it saved may need Mistral's regex fixed
        ours = {"fix_mistral_regex": False} if is_gguf_folder(model_dir) else {}
        self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **ours)
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
            return self.encode(joined_turns(messages))
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

    def vocab(self) -> dict[str, int]:
        return self.tok.get_vocab()

    def to_json(self) -> str:
        """The fast tokenizer's JSON (what llguidance reads)."""
        return self.tok.backend_tokenizer.to_str()

    @property
    def eos_token_id(self) -> int | None:
        return self.tok.eos_token_id


class EngineTokenizer(Protocol):
    """What the engine process asks of a tokenizer: streams' text, the constraints' vocabulary, EOS."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def vocab(self) -> dict[str, int]: ...

    def to_json(self) -> str: ...

    @property
    def eos_token_id(self) -> int | None: ...


class JsonTokenizer:
    """A converted GGUF's tokenizer without transformers: its folder's ``tokenizer.json`` read by the ``tokenizers``
    package (the same Rust tokenizer that transformers' fast tokenizer wraps; transformers itself wrote the JSON,
    every added token and its special flag in it), decoding as transformers decodes (``skip_special_tokens``, then
    its clean-up of spaces where the folder's config asks for it), and the folder's chat template rendered in
    transformers' environment (chat_template.py). Both the engine process and the web worker of a GGUF hold this
    and never import transformers (nor torch, in the web worker): about 0.1 GB less in the engine and 0.4 GB in
    the web worker with Gemma 3's 262,144 tokens (docs/performance.md)."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as RustTokenizer

        folder = Path(model_dir)
        self.backend = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self.clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        # the special tokens by name, as transformers passes them to a template (its special_tokens_map)
        self.specials = {k: _content(config[k]) for k in SPECIAL_NAMES if config.get(k)}
        eos = self.specials.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(eos) if isinstance(eos, str) else None
        template = folder / "chat_template.jinja"  # (where transformers saves it; older folders: the config's)
        source = template.read_text() if template.is_file() else config.get("chat_template")
        self.chat_template: str | None = source or None
        self._compiled = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def offsets(self, text: str) -> list[tuple[int, int, int]]:
        """(token id, start, stop) for each token of ``text``, character offsets (TGI's /tokenize)."""
        enc = self.backend.encode(text)
        return [(t, a, b) for t, (a, b) in zip(enc.ids, enc.offsets)]

    @property
    def handles_tools(self) -> bool:
        """As HFTokenizer.handles_tools."""
        return "tools" in (self.chat_template or "")

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        if not self.chat_template:
            return self.encode(joined_turns(messages))
        from .chat_template import compile_template, render

        if self._compiled is None:
            self._compiled = compile_template(self.chat_template)
        return self.encode(render(self._compiled, messages, tools, self.specials), add_special_tokens=False)

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one input, as the tokenizer joins a pair (a cross-encoder's query and document)."""
        return list(self.backend.encode(first, second).ids)

    def decode(self, ids: Sequence[int]) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=True)
        return clean_up_spaces(text) if self.clean_up else text

    def vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        return self.backend.to_str()


# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a tokenizer's special tokens have in its config and templates
SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
)


def _content(token):
    """A special token's text as tokenizer_config.json writes it (a string, an AddedToken's dict, or a list)."""
    if isinstance(token, list):
        return [_content(t) for t in token]
    return token.get("content") if isinstance(token, dict) else token


def joined_turns(messages: Sequence[dict]) -> str:
    """A conversation's prompt for a base model without a chat template: its turns' texts, one a line."""
    return "\n".join(m["content"] for m in messages) + "\n"


def clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (a decode's ``clean_up_tokenization_spaces``): the spaces some
    English tokenizers leave before punctuation and contractions."""
    for old, new in CLEAN_UP:
        text = text.replace(old, new)
    return text


CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def load_tokenizer(model_dir: str | Path) -> JsonTokenizer | HFTokenizer:
    """The tokenizer of a model's folder, for the web worker and the engine process alike: a converted GGUF's
    folder (the converter's stamp in it) read without transformers; any other folder through transformers (its
    tokenizer.json may leave to tokenizer_config.json which added tokens are special, its template may be one of
    several)."""
    folder = Path(model_dir)
    if is_gguf_folder(folder) and (folder / "tokenizer.json").is_file():
        return JsonTokenizer(folder)
    return HFTokenizer(folder)
