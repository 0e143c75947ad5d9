"""What a GGUF file says about its tokenization, read as llama.cpp's llama-vocab reads it: whether a BOS (or EOS)
token is added to every prompt, and which tokens end generation. Metadata only; no weights are read."""

from __future__ import annotations

from dataclasses import dataclass

from .gguf_meta import open_gguf

# pre-tokenizers of the BPE ("gpt2") vocabularies whose prompts llama.cpp starts with BOS when the file is silent
_BPE_BOS_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
# texts of tokens llama.cpp treats as end of generation wherever a vocabulary holds them
_EOG_TEXTS = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
}


@dataclass(frozen=True)
class GGUFVocab:
    model: str  # tokenizer.ggml.model: llama (SPM), gpt2 (BPE), bert, t5, ...
    add_bos: bool
    add_eos: bool
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]  # every token that ends generation: EOS, EOT, EOM and the end tokens found by text


def read_vocab(source) -> GGUFVocab:
    """source: a GGUF's path or its GGUFReader (gguf_meta.open_gguf)."""
    fields = open_gguf(source).fields

    def get(key: str):
        f = fields.get(key)
        return None if f is None else f.contents()

    model, pre = get("tokenizer.ggml.model") or "", get("tokenizer.ggml.pre") or ""
    # llama.cpp's defaults per vocabulary type, then the file's own keys
    default_bos = model in ("llama", "bert") or (model == "gpt2" and pre in _BPE_BOS_PRE)
    add_bos = get("tokenizer.ggml.add_bos_token")
    add_eos = get("tokenizer.ggml.add_eos_token")
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    eog = {i for i in (eos, get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id")) if i is not None}
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        for n, idx in enumerate(tokens.data):
            if bytes(tokens.parts[idx]).decode("utf-8", "replace") in _EOG_TEXTS:
                eog.add(n)
    return GGUFVocab(
        model,
        default_bos if add_bos is None else bool(add_bos),
        bool(add_eos) if add_eos is not None else model == "t5",
        bos,
        eos,
        frozenset(eog),
    )


TOKENIZERS = ("gpt2", "llama", "bert")  # the tokenizer.ggml.model values read here: BPE, SPM, WPM

# gguf's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def spm_backend(source):
    """A tokenizers Tokenizer that splits as llama.cpp's SPM tokenizer (the "llama" vocabulary type: Gemma,
    Llama 2, Mistral's older files): spaces as "▁", the adjacent pair whose merged piece scores highest merged
    first (as BPE merges ranked by that score), bytes for what no piece covers, control and user-defined pieces
    matched whole. transformers' own GGUF conversion reads these scores as a unigram model's, which splits words
    where llama.cpp does not ("capital" as "▁c ap it al")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    fields = open_gguf(source).fields
    tok_field, score_field = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
    type_field = fields["tokenizer.ggml.token_type"]
    pieces = [bytes(tok_field.parts[i]).decode("utf-8", "replace") for i in tok_field.data]
    scores = [float(score_field.parts[i][0]) for i in score_field.data]
    types = [int(type_field.parts[i][0]) for i in type_field.data]
    vocab: dict[str, int] = {}
    for i, p in enumerate(pieces):
        vocab.setdefault(p, i)
    mergeable = {p for p, t in zip(pieces, types) if t in (NORMAL, USER_DEFINED, UNKNOWN)}
    merges = []
    for piece, score, kind in zip(pieces, scores, types):
        if kind != NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in mergeable and right in mergeable:
                merges.append((-score, vocab[piece], left, right))
    merges.sort()
    space_prefix = fields.get("tokenizer.ggml.add_space_prefix")
    space_prefix = True if space_prefix is None else bool(space_prefix.contents())
    unk = next((p for p, t in zip(pieces, types) if t == UNKNOWN), None)
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in merges],
            unk_token=unk,
            byte_fallback=True,
            fuse_unk=True,
            ignore_merges=False,
        )
    )
    norms = [normalizers.Prepend("▁")] if space_prefix else []
    backend.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    backend.add_special_tokens(
        [
            AddedToken(p, special=True, normalized=False)  # matched whole, as llama.cpp does
            for p, t in zip(pieces, types)
            if t in (CONTROL, UNKNOWN)
        ]
    )
    backend.add_tokens(
        [AddedToken(p, special=False, normalized=False) for p, t in zip(pieces, types) if t == USER_DEFINED]
    )
    return backend


def with_bos_eos(backend, vocab: GGUFVocab, pieces: dict[int, str]):
    """The backend, adding BOS and EOS to every encoded text as the file says."""
    from tokenizers import processors

    bos = [(pieces[vocab.bos_id], vocab.bos_id)] if vocab.add_bos and vocab.bos_id is not None else []
    eos = [(pieces[vocab.eos_id], vocab.eos_id)] if vocab.add_eos and vocab.eos_id is not None else []
    single = [t for t, _ in bos] + ["$A"] + [t for t, _ in eos]
    pair = single + ["$B"] + [t for t, _ in eos]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=bos + eos)
    kept = backend.post_processor
    keep = kept is not None and not isinstance(kept, processors.TemplateProcessing)  # ByteLevel's offset trimming
    backend.post_processor = processors.Sequence([kept, template]) if keep else template
    return backend


# transformers' GGUF tokenizer converters that read a BPE ("gpt2") vocabulary, by llama.cpp architecture; any other
# architecture's BPE vocabulary takes GPT-2's (byte-level BPE over the file's tokens and merges)
_BPE_CONVERTERS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "falcon": "falcon",
    "gpt2": "gpt2",
    "starcoder2": "starcoder2",
    "stablelm": "stablelm",
    "bloom": "bloom",
}
_TOKENIZER_KEYS = {
    "model": "tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}


def bpe_backend(source, arch: str):
    """A BPE vocabulary's tokenizer, through transformers' converter for the architecture (GPT-2's where it has
    none that reads BPE)."""
    from transformers.integrations.ggml import convert_gguf_tokenizer

    fields = open_gguf(source).fields
    spec = {}
    for key, name in _TOKENIZER_KEYS.items():
        f = fields.get(f"tokenizer.ggml.{key}")
        if f is not None:
            spec[name] = f.contents()
    backend, _ = convert_gguf_tokenizer(_BPE_CONVERTERS.get(arch, "gpt2"), spec)
    return _file_tokens_only(backend, spec["tokens"], spec.get("token_type") or [])


def _file_tokens_only(backend, pieces: list[str], types: list[int]):
    """The converted backend with only the file's tokens: without the added tokens a converter writes in whether
    the file has them or not (Qwen's adds <|im_start|> and <|im_end|>, new ids past a vocabulary that lacks them:
    ids the model has no row for), and with the file's control and user-defined tokens matched whole, as
    llama.cpp matches them (a reasoning model's <think>, which its file types user-defined)."""
    import json

    from tokenizers import AddedToken, Tokenizer

    n = len(pieces)
    if backend.get_vocab_size(with_added_tokens=True) > n:
        state = json.loads(backend.to_str())
        state["added_tokens"] = [t for t in state.get("added_tokens", []) if t["id"] < n]
        backend = Tokenizer.from_str(json.dumps(state))
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens(
        [
            AddedToken(p, special=True, normalized=False)
            for p, t in zip(pieces, types)
            if t == CONTROL and p not in known
        ]
    )
    backend.add_tokens(
        [
            AddedToken(p, special=False, normalized=False)
            for p, t in zip(pieces, types)
            if t == USER_DEFINED and p not in known
        ]
    )
    return backend


def wpm_backend(source):
    """A tokenizers Tokenizer that splits as llama.cpp's WPM tokenizer (the "bert" vocabulary type): BERT's
    normalizer (lower-cased where the file says) and pre-tokenizer, then the longest piece first within each word.
    llama.cpp's converter wrote a word's first piece with "▁" before it and its continuations bare; WordPiece wants
    them the other way round ("##" before continuations), so the pieces are written back."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    fields = open_gguf(source).fields
    tok_field, type_field = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    pieces = [bytes(tok_field.parts[i]).decode("utf-8", "replace") for i in tok_field.data]
    types = [int(type_field.parts[i][0]) for i in type_field.data]
    vocab: dict[str, int] = {}
    for i, (p, t) in enumerate(zip(pieces, types)):
        word = p if t == CONTROL else p[1:] if p.startswith("\u2581") else "##" + p
        vocab.setdefault(word, i)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = pieces[int(unk_id.contents())] if unk_id is not None else "[UNK]"
    lower = fields.get("tokenizer.ggml.normalizer.lowercase")
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token=unk, max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(lowercase=bool(lower.contents()) if lower is not None else True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(p, special=True) for p, t in zip(pieces, types) if t == CONTROL])
    return backend


def gguf_tokenizer(source, arch: str, chat_template: str | None = None):
    """The tokenizer llama.cpp would run for a GGUF, as a transformers tokenizer to save beside the model: an SPM
    vocabulary by its merges (spm_backend), a BPE one by transformers' conversion, BOS and EOS added as the file
    says, the file's chat template."""
    from transformers import PreTrainedTokenizerFast

    reader = open_gguf(source)
    vocab = read_vocab(reader)
    if vocab.model == "llama":
        backend = spm_backend(reader)
    elif vocab.model == "bert":
        backend = wpm_backend(reader)
    elif vocab.model == "gpt2":
        backend = bpe_backend(reader, arch)
    else:
        raise ValueError(f"tokenizer {vocab.model!r} is not supported (supported: {', '.join(TOKENIZERS)})")
    names = {i: backend.id_to_token(i) for i in (vocab.bos_id, vocab.eos_id) if i is not None}
    backend = with_bos_eos(backend, vocab, names)
    special = {
        k: names.get(i) if i is not None else None
        for k, i in (("bos_token", vocab.bos_id), ("eos_token", vocab.eos_id))
    }
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
        **{k: v for k, v in special.items() if v is not None},
    )
    return tok, vocab
