#!/usr/bin/env python3
"""Regenerate the tiny random GGUF models in tests/data/gguf/ and llama.cpp's reference results for them.

    .venv/bin/python scripts/make_reference_ggufs.py [--llama-dir DIR] [--only llama,gemma3] [--skip-server]

What it does (everything intermediate lives in a temporary directory that is removed afterwards):

1. trains a tiny byte-level BPE tokenizer (vocab ~512) on tests/data/english.txt with `tokenizers`;
2. for every architecture in ARCHS builds a random transformers model (fixed seed, small init, a strong embedding /
   "bigram" path so that llama.cpp's top-1 is the same at every precision, query/key scaled so that attention and rope
   matter, final norm calibrated to a mean top-1 probability of 0.4), converts it to an f32 GGUF with llama.cpp's
   own convert_hf_to_gguf.py
   (imported from the llama.cpp source, with its own gguf-py, and with the BPE pre-tokenizer check monkeypatched
   to "gpt-2"), and quantizes it with llama-quantize;
3. runs llama-perplexity on tests/data/english.txt with --kl-divergence-base for every GGUF and for the f32 GGUF
   of the same model, decodes the dumped log-probabilities and writes tests/data/gguf/reference.json (with the
   quantized file's top-1 agreement with llama.cpp's own f32 answers);
   The *-spm entries (llama-spm, gemma-spm) use a sentencepiece BPE vocabulary instead (SPM_FLAVORS, trained with
   the `sentencepiece` package, converted by convert_hf_to_gguf.py's sentencepiece path to tokenizer.ggml.model
   "llama"), and also get llama-server's tokenization of SPM_TOKENIZE ("tokenize" in their reference entry);
4. (unless --skip-server) asks llama-server on 127.0.0.1 for the tokenization and greedy completions of a few
   strings with the real gemma-3-270m Q4_K_M file and the SmolLM2 GGUF bundled in the venv, written to
   tests/data/gguf/gemma3-270m-llamacpp.json and tests/data/gguf/smollm2-llamacpp.json.

llama.cpp comes from the peer build (`bash /work/shared/peers/build-llama-server.sh`), by default in
~/.cache/llama-server-peer (override with --llama-dir or LLAMA_SERVER_DIR). Only loopback traffic is used.

The *-spm entries need `sentencepiece` (and `protobuf`), which are deliberately NOT in the project's venv: install
them into a separate directory once and point the script at it (default /tmp/spm-pkgs, or --spm-pkgs / SPM_PKGS):

    .venv/bin/python -m pip install --target /tmp/spm-pkgs sentencepiece protobuf

The directory is appended to sys.path of this script and put on PYTHONPATH of convert_hf_to_gguf.py for those
entries only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
OUT_DIR = DATA / "gguf"
TEXT_FILE = DATA / "english.txt"

HIDDEN = 256  # K-quants need rows that are multiples of 256
INTERMEDIATE = 512
N_HEADS = 4  # head_dim 64
VOCAB_TARGET = 512
SEED = 1234

# perplexity settings
PPL_CTX = 128
PPL_CHUNKS = 4
PPL_THREADS = 2
TOPK = 5
# How the random models are made tame but still give llama.cpp a clear, quantization-proof answer (README.md):
INIT = 0.02  # initializer_range (standard small init; 0.2 made the models chaotic)
EMB_SCALE = 2.5  # embedding factor: the current token's embedding is a large share of the final hidden state...
HEAD_COPY = 2.0  # ...and untied heads get the embedding of a fixed vocab permutation added, so the top-1 is an
# outlier (a "bigram" answer) that 4-bit weights cannot flip; the layers shape the rest
QK_SCALE = 5.0  # query/key factor: attention logits of std ~2.5 instead of ~0.1, so positions (rope) matter
TARGET_TOP1 = 0.4  # mean top-1 probability the final norm is calibrated to (uniform would be 1/512)

# name -> spec. "family": its entry in the engine's family table (inference_api/model/families.py: the config class
# and what it computes differently), "config": the transformers config keys beyond _common's (with "common": False,
# all of them but the vocabulary and the init), "quants": llama-quantize types to produce (file
# tests/data/gguf/<name>-<type>.gguf). Optional overrides: "init", "emb_scale", "head_copy", "qk_scale" (the
# families with q/k norms scale those instead: they already give attention logits of std ~1). "base": the model of
# another entry (the *-spm entries: only the vocabulary differs).
_HEAD_DIM = HIDDEN // N_HEADS
LONGROPE_ORIG_POS = 64  # phi3longrope: original_max_position_embeddings (< PPL_CTX: the long factors are used)
LONGROPE_MAX_POS = 4096  # max_position_embeddings: attention factor sqrt(1 + ln(64)/ln(64)) = sqrt(2)


def longrope_factors(n: int) -> tuple[list[float], list[float]]:
    """Fixed, deterministic LongRoPE factors (one per rotary frequency pair, high to low frequency): short ones
    1.0-3.0, long ones 2.0-20.0, both growing towards the low frequencies (as in Phi-3) with a wiggle so that
    neighbouring pairs differ."""
    short, long = [], []
    for i in range(n):
        x = i / (n - 1)
        short.append(round(1.0 + 1.9 * x * x + 0.1 * (0.5 + 0.5 * math.sin(3.0 * i)), 4))
        long.append(round(2.0 + 17.0 * x**1.5 + 1.0 * (0.5 + 0.5 * math.cos(2.0 * i)), 4))
    return short, long


_FALCON = dict(
    hidden_size=HIDDEN,
    ffn_hidden_size=4 * HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=N_HEADS,
    alibi=False,
    bias=False,
    parallel_attn=True,
    layer_norm_epsilon=1e-5,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=1,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
_GEMMA3 = dict(  # 6 layers: llama.cpp has no per-layer pattern key for gemma3 GGUFs and uses its built-in pattern
    # of 6 (layers 0-4 sliding, layer 5 global), which is also transformers' default layer_types. intermediate
    # 256 (not 512) keeps the 6-layer file under ~1.5 MB
    num_hidden_layers=6,
    num_key_value_heads=1,
    intermediate_size=256,
    head_dim=_HEAD_DIM,
    query_pre_attn_scalar=_HEAD_DIM,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    rope_local_base_freq=10000.0,
    sliding_window=16,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
)
_LLAMA = dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
_PHI3 = dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None)
ARCHS: dict[str, dict] = {
    "llama": dict(
        family="llama",
        config=_LLAMA,
        quants=[
            *("Q4_K_M", "Q8_0", "Q4_0", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL"),
            *("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ1_M"),
        ],
    ),
    "llama3rope": dict(
        family="llama",
        config=dict(
            _LLAMA,
            tie_word_embeddings=True,
            max_position_embeddings=512,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        quants=["Q4_K_M"],
    ),
    "mistral": dict(
        family="mistral",
        config=dict(_LLAMA, rope_theta=1e6, sliding_window=None, head_dim=_HEAD_DIM),
        quants=["Q4_K_M"],
    ),
    "qwen2": dict(
        family="qwen2",
        config=dict(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False),
        quants=["Q4_K_M"],
    ),
    "qwen3": dict(
        family="qwen3",
        config=dict(
            rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, head_dim=_HEAD_DIM, use_sliding_window=False
        ),
        quants=["Q4_K_M"],
        qk_scale=1.6,
    ),
    "gemma": dict(
        family="gemma",
        config=dict(
            num_key_value_heads=1,
            head_dim=_HEAD_DIM,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
        quants=["Q4_K_M"],
        emb_scale=0.5,  # its embedding is multiplied by sqrt(hidden)
    ),
    "gemma2": dict(
        family="gemma2",
        config=dict(
            head_dim=_HEAD_DIM,
            query_pre_attn_scalar=_HEAD_DIM,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            sliding_window=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
        quants=["Q4_K_M"],
        emb_scale=6.0,
    ),
    "gemma3": dict(family="gemma3_text", config=_GEMMA3, quants=["Q4_K_M"], emb_scale=10.0, qk_scale=1.6),
    "phi3": dict(family="phi3", config=dict(_PHI3, original_max_position_embeddings=2048), quants=["Q4_K_M"]),
    # Phi-3-mini-128k / Phi-3.5-mini style LongRoPE: per rotary frequency pair a short and a long divisor of the
    # frequency; the long set applies when the sequence (llama.cpp: the padded per-sequence context) exceeds
    # original_max_position_embeddings, and both scale cos/sin by sqrt(1 + ln(max/orig) / ln(orig)). Its attn_factor
    # sqrt(2) doubles the attention logits, so the layers get a larger share: a larger embedding keeps the "bigram"
    # top-1 margins >= 1.6 (with 2.5 the smallest f32 margin was 0.13)
    "phi3longrope": dict(
        family="phi3",
        config=dict(
            _PHI3,
            max_position_embeddings=LONGROPE_MAX_POS,
            original_max_position_embeddings=LONGROPE_ORIG_POS,
            rope_scaling=dict(
                zip(("type", "short_factor", "long_factor"), ("longrope", *longrope_factors(_HEAD_DIM // 2)))
            ),
        ),
        quants=["Q4_K_M"],
        emb_scale=3.5,
    ),
    # falcon-7b style: one layernorm, parallel attention/MLP, multi-query (num_kv_heads=1 explicitly: transformers
    # ignores it under multi_query, but convert_hf_to_gguf reads it)
    "falcon": dict(
        family="falcon",
        common=False,
        config=dict(_FALCON, new_decoder_architecture=False, multi_query=True, num_kv_heads=1),
        quants=["Q4_K_M"],
        emb_scale=4.0,
    ),
    # falcon-40b style "new decoder architecture": ln_attn + ln_mlp, grouped KV
    "falcon40b": dict(
        family="falcon",
        common=False,
        config=dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2),
        quants=["Q4_K_M"],
        emb_scale=4.0,
    ),
    # a reasoning model: qwen3's model and vocabulary with <think> and </think> added (as Qwen3's and DeepSeek-R1's
    # vocabularies have them: added, not special, so they show in the text) and a chat template that opens a thought
    # at the assistant's turn (THINK_TEMPLATE): the suite's reasoning tests serve it
    "qwen3think": dict(
        quants=["Q4_K_M"], base="qwen3", qk_scale=1.6, added=["<think>", "</think>"], chat_template="think"
    ),
    # sentencepiece (SPM) vocabularies: the model of "base", but with tokenizer.ggml.model "llama" (SPM_FLAVORS)
    "llama-spm": dict(quants=["Q4_K_M"], base="llama", spm="llama"),
    "gemma-spm": dict(quants=["Q4_K_M"], base="gemma", spm="gemma", emb_scale=0.5),
}

# the chat template of the entries with chat_template "think": ChatML turns, past thoughts dropped from assistant
# turns, and the assistant's turn opened inside a thought (as Qwen3's thinking templates and DeepSeek-R1's do)
THINK_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip() -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)
CHAT_TEMPLATES = {"think": THINK_TEMPLATE}

# sentencepiece BPE vocabularies for the *-spm entries, trained on tests/data/english.txt (train_spm_tokenizer).
# llama: Llama 2 style (unk/bos/eos = 0/1/2, dummy prefix "▁", identity normalization, no whitespace folding,
# split digits, byte fallback); gemma: Gemma style (pad/eos/bos/unk = 0/1/2/3, no dummy prefix: convert writes
# add_space_prefix false). Both with user-defined symbols (typed USER_DEFINED in the GGUF through
# added_tokens_decoder "special": false, like real Gemma / chat models) and control symbols (CONTROL).
SPM_VOCAB = 768
SPM_USER_DEFINED = ["<start_of_turn>", "<end_of_turn>"]
SPM_CONTROL = ["<|im_start|>", "<|im_end|>"]
SPM_FLAVORS: dict[str, dict] = {
    "llama": dict(
        ids=dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
        add_dummy_prefix=True,
        tokenizer_class="LlamaTokenizer",
        bos="<s>",
        eos="</s>",
        unk="<unk>",
        pad=None,
    ),
    "gemma": dict(
        ids=dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3),
        add_dummy_prefix=False,
        tokenizer_class="GemmaTokenizer",
        bos="<bos>",
        eos="<eos>",
        unk="<unk>",
        pad="<pad>",
    ),
}
DEFAULT_SPM_PKGS = "/tmp/spm-pkgs"
# strings whose llama-server tokenization (POST /tokenize) is recorded for the *-spm entries: with add_special true
# and false (parse_special true), and for those containing special-looking text also with parse_special false
SPM_TOKENIZE = [
    "",
    "The history of the public library is, in many ways, the history of a simple idea: that knowledge should be "
    "available to anyone who wants it.",
    "Ordinary people rarely saw a book, let alone owned one.",
    "Hello world",
    " Hello world",
    "Hello world ",
    "  two leading spaces",
    "multiple   spaces   between  words",
    "trailing spaces   ",
    " ",
    "   ",
    "\n",
    "line one\nline two",
    "\n\nleading newlines and a trailing one\n",
    "tab\tseparated\tvalues",
    " \t mixed \n\n whitespace \t ",
    "In 2024 there were 1234567 readers, 3.14159 and -42 or 0x1F.",
    "Wait... what?! (yes) [no] {maybe} \"quoted\" 'single' a-b_c/d\\e @#$%^&*~`|<>",
    "caf\u00e9 na\u00efve \u00fcber Stra\u00dfe \u00c9cole",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "emoji \U0001f642\U0001f44d\U0001f3fd done \u2014 \u20ac5",
    "\u2581already\u2581escaped \u2581",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "text<end_of_turn>more text <start_of_turn> spaced <end_of_turn>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>",
    "<s>Hello</s> <bos>Hi<eos> <unk> <pad>",
    "<0x41> is a byte piece, <start_of_turn",
]

# strings for the real-model tokenizer / completion references
REAL_TOKENIZE = [
    "The capital of France is",
    "Once upon a time",
    " hello  world\n\nfoo",
    "<start_of_turn>user\nHi<end_of_turn>",
]
REAL_COMPLETE = ["The capital of France is", "Once upon a time"]
REAL_N_PREDICT = 24


def log(*a):
    print("[make_reference_ggufs]", *a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# 1. tokenizer


def train_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=["<s>", "</s>", "<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(TEXT_FILE)], trainer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert (bos, eos) == (0, 1), (bos, eos)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    # <unk> and <|endoftext|> are unused by the BPE, but llama.cpp's vocab loader looks them up by name for
    # models whose general.name contains "phi3"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return tok.get_vocab_size()


def add_tokens(src: Path, out: Path, tokens: list[str], chat_template: str | None) -> int:
    """The tokenizer in ``src`` with ``tokens`` added (not special: they show in decoded text) and, if given, a
    chat template, saved in ``out``; returns the vocabulary size."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast.from_pretrained(src)
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens])
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"], cfg["add_eos_token"] = True, False
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return len(fast)


def train_spm_tokenizer(out: Path, flavor: str) -> int:
    """A sentencepiece BPE model (SPM_FLAVORS[flavor]) saved as LlamaTokenizer/GemmaTokenizer files (tokenizer.model,
    tokenizer_config.json, special_tokens_map.json). Deterministic: one thread, fixed corpus, BPE (no sampling)."""
    import io

    import sentencepiece as spm

    fl = SPM_FLAVORS[flavor]
    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(SEED)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(TEXT_FILE),
        model_writer=buf,
        model_type="bpe",
        vocab_size=SPM_VOCAB,
        byte_fallback=True,
        split_digits=True,
        required_chars="0123456789",
        user_defined_symbols=SPM_USER_DEFINED,
        control_symbols=SPM_CONTROL,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=fl["add_dummy_prefix"],
        allow_whitespace_only_pieces=True,
        max_sentence_length=100000,
        num_threads=1,
        minloglevel=2,
        **fl["ids"],
        **{f"{k}_piece": fl[k] for k in ("bos", "eos", "unk", "pad") if fl[k]},
    )
    model = buf.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=model)
    ids = fl["ids"]
    for key, tok in (("bos_id", fl["bos"]), ("eos_id", fl["eos"]), ("unk_id", fl["unk"]), ("pad_id", fl["pad"])):
        if ids[key] >= 0:
            assert sp.IdToPiece(ids[key]) == tok, (key, sp.IdToPiece(ids[key]), tok)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model)
    # added_tokens_decoder: how HF tokenizer configs mark added tokens; convert_hf_to_gguf.py types them CONTROL
    # ("special": true) or USER_DEFINED (false) - its sentencepiece reader alone would make user-defined pieces NORMAL
    added = {
        str(sp.PieceToId(t)): dict(
            content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=t in SPM_CONTROL
        )
        for t in SPM_USER_DEFINED + SPM_CONTROL
    }
    specials = {
        k: fl[k.split("_")[0]] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if fl[k.split("_")[0]]
    }
    cfg = dict(
        tokenizer_class=fl["tokenizer_class"],
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
        sp_model_kwargs={},
        added_tokens_decoder=dict(sorted(added.items(), key=lambda kv: int(kv[0]))),
        **specials,
    )
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return sp.vocab_size()


def spm_token_ids(flavor: str) -> dict:
    """config.json token ids of an SPM flavor (what convert_hf_to_gguf.py's SpecialVocab reads without
    tokenizer.json)."""
    ids = SPM_FLAVORS[flavor]["ids"]
    return dict(
        bos_token_id=ids["bos_id"],
        eos_token_id=ids["eos_id"],
        pad_token_id=ids["pad_id"] if ids["pad_id"] >= 0 else None,
    )


def spm_available(path: str) -> bool:
    if path and Path(path).is_dir() and path not in sys.path:
        sys.path.append(path)
    try:
        import google.protobuf  # noqa: F401
        import sentencepiece  # noqa: F401

        return True
    except ImportError:
        return False


# ----------------------------------------------------------------------------------------------------------------
# 2. random models


def _common(vocab: int, **kw) -> dict:
    d = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=N_HEADS,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    d.update(kw)
    return d


def model_config(name: str, vocab: int, init: float | None = None):
    """The transformers config of entry `name`: its family's config class over its keys."""
    import transformers as T

    from inference_api.model.families import FAMILIES, config_windows, gguf_windows

    spec = ARCHS[name]
    base = ARCHS[spec.get("base", name)]  # *-spm: the model of their base entry (only the vocabulary differs)
    family = FAMILIES[base["family"]]
    init = spec.get("init", INIT) if init is None else init
    keys = dict(base["config"], initializer_range=init)
    cfg = T.AutoConfig.for_model(
        family.model_type, **(_common(vocab, **keys) if base.get("common", True) else dict(keys, vocab_size=vocab))
    )
    if family.gguf and family.swa_pattern:  # the file will carry no per-layer key: llama.cpp's pattern must match
        windows = gguf_windows(family.gguf, cfg.num_hidden_layers, cfg.sliding_window)
        assert config_windows(cfg) == windows, (name, config_windows(cfg), windows)
    return family, cfg


def build_model(name: str, vocab: int, init: float | None = None):
    """The random transformers model for entry `name` (before calibrate())."""
    import torch
    import transformers as T

    torch.manual_seed(SEED)
    spec = ARCHS[name]
    family, cfg = model_config(name, vocab, init)
    emb_scale = spec.get("emb_scale", EMB_SCALE)
    head_scale = 1.0
    # (gemma2/gemma3: their post-attention / post-MLP norms give every layer an O(1) contribution to the residual,
    # hence their larger emb_scale in ARCHS; gemma: its embedding is multiplied by sqrt(hidden), hence a smaller one)
    # eager attention: sdpa silently skips gemma2's attention-logit softcapping
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(emb_scale)
        out = model.get_output_embeddings()
        if out is not None and out.weight.data_ptr() != emb.data_ptr():
            # untied head: a random head plus the embedding of a fixed permutation of the vocabulary, so that (like
            # the tied models' head) it has a clear preferred continuation for the current token - but a different
            # one than a tied head would give
            perm = torch.randperm(emb.shape[0])
            out.weight.mul_(head_scale).add_(emb[perm] * spec.get("head_copy", HEAD_COPY))
        scale_qk(model, family, spec.get("qk_scale", QK_SCALE))
        # random norms / biases are left at their default init (ones / zeros) except that we give the (non-gemma)
        # RMSNorm weights some spread, so a wrong norm implementation shows up
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or ".ln_" in n or "layernorm.weight" in n or n.endswith("ln_f.weight"):
                if family.norm_offset:
                    p.add_(torch.randn_like(p) * 0.1)  # stored as (w-1)
                else:
                    p.mul_(1.0 + torch.randn_like(p) * 0.1)
            elif n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def rope_scaling_info(meta: dict, per_tensor: dict) -> dict | None:
    """For GGUFs with LongRoPE factor tensors: what llama.cpp reads and which factor set it uses in
    llama-perplexity (llama_model::get_rope_factors: long iff n_ctx_seq > rope.scaling.original_context_length,
    where n_ctx_seq is the context padded to a multiple of 256)."""
    if "rope_factors_long.weight" not in per_tensor:
        return None
    arch = meta["general.architecture"]
    keys = {
        k: meta[k]
        for k in (
            f"{arch}.context_length",
            f"{arch}.rope.scaling.original_context_length",
            f"{arch}.rope.scaling.attn_factor",
            f"{arch}.rope.freq_base",
            f"{arch}.rope.dimension_count",
        )
        if k in meta
    }
    orig = int(keys[f"{arch}.rope.scaling.original_context_length"])
    n_ctx_seq = -(-PPL_CTX // 256) * 256
    attn = round(float(keys[f"{arch}.rope.scaling.attn_factor"]), 7)
    used = "long" if n_ctx_seq > orig else "short"
    tensors = {n: t for n, t in per_tensor.items() if n.startswith("rope_factors_")}
    hf_used = "long" if orig < PPL_CTX else "short"  # transformers: max position id + 1 > original max positions
    notes = (
        f"LongRoPE: llama.cpp picks rope_factors_{used} here (llama-perplexity -c {PPL_CTX} pads the context to "
        f"n_ctx_seq = {n_ctx_seq} {'>' if used == 'long' else '<='} original_context_length {orig}); "
        f"transformers picks the {hf_used} factors (each chunk has {PPL_CTX} positions, "
        f"original_max_position_embeddings {orig}); "
        f"rope.scaling.attn_factor = {attn} (sqrt(1 + ln(context_length/original_context_length) / "
        f"ln(original_context_length))) multiplies cos and sin of the rotation of q and k; theta_i = "
        f"pos * freq_base^(-2i/n_rot) / factor_i."
    )
    return dict(
        factor_set_used=used, n_ctx_seq=n_ctx_seq, attn_factor=attn, gguf_keys=keys, factor_tensors=tensors, notes=notes
    )


def scale_qk(model, family, f: float):
    """Multiplies the query and key projections by f (attention logits by f^2): with a small init the attention
    would otherwise be nearly uniform, and position handling (rope) would hardly matter."""
    import torch

    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nh = cfg.num_attention_heads
    with torch.no_grad():
        for n, p in model.named_parameters():
            if family.qk_norm:  # q/k RMS norms undo any scale of q_proj/k_proj
                if n.endswith(("q_norm.weight", "k_norm.weight")):
                    if family.norm_offset:  # stored as (w-1)
                        p.copy_((1.0 + p) * f - 1.0)
                    else:
                        p.mul_(f)
            elif n.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
                p.mul_(f)
            elif n.endswith("qkv_proj.weight"):  # phi3, phi3longrope: [q; k; v]
                nkv = cfg.num_key_value_heads
                p[: (nh + nkv) * hd].mul_(f)
            elif n.endswith("query_key_value.weight"):  # falcon
                if cfg.new_decoder_architecture:  # per KV group: nh/nkv query heads, 1 key, 1 value head
                    nkv = cfg.num_kv_heads
                    v = p.view(nkv, nh // nkv + 2, hd, -1)
                    v[:, :-1].mul_(f)
                else:  # multi-query: [q (nh heads); k (1 head); v (1 head)]
                    p[: (nh + 1) * hd].mul_(f)


def final_norm(model):
    base = getattr(model, "model", None) or model.transformer
    return getattr(base, "norm", None) or base.ln_f


def calibrate(model, family, tok_dir: Path, target: float = TARGET_TOP1) -> float:
    """Scales the final norm (i.e. the logits before any softcap) so the mean top-1 probability of the f32 HF model
    on the first PPL_CTX tokens of the text is about `target`. Returns the factor."""
    import torch

    norm = final_norm(model)
    gemma = bool(family.norm_offset)
    w0 = norm.weight.detach().clone()
    b0 = norm.bias.detach().clone() if getattr(norm, "bias", None) is not None else None

    def apply(f):
        with torch.no_grad():
            if gemma:  # Gemma's RMSNorm computes x * (1 + w)
                norm.weight.copy_((1.0 + w0) * f - 1.0)
            else:
                norm.weight.copy_(w0 * f)
            if b0 is not None:
                norm.bias.copy_(b0 * f)
        return hf_peakedness(model, tok_dir)

    lo, hi = math.log(0.02), math.log(100.0)
    for _ in range(20):
        mid = (lo + hi) / 2
        if apply(math.exp(mid)) < target:
            lo = mid
        else:
            hi = mid
    f = math.exp((lo + hi) / 2)
    apply(f)
    return f


def hf_chunks(tok_dir: Path) -> list[list[int]]:
    """The token chunks llama-perplexity evaluates (BOS prepended, cut into PPL_CTX-token chunks, first token of each
    chunk overwritten with BOS)."""
    if (tok_dir / "tokenizer.model").is_file():  # *-spm: sentencepiece itself (BOS + pieces), no transformers
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
        bos = sp.bos_id()
        ids = [bos] + sp.encode(TEXT_FILE.read_text())
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
        ids = tok(TEXT_FILE.read_text())["input_ids"]
        bos = tok.bos_token_id
    chunks = [list(ids[c * PPL_CTX : (c + 1) * PPL_CTX]) for c in range(PPL_CHUNKS)]
    for c in chunks:
        c[0] = bos
    return chunks


def hf_scored_logits(model, tok_dir: Path):
    """f32 HF logits at the scored positions of all chunks, (PPL_CHUNKS * (PPL_CTX/2 - 1), vocab)."""
    import torch

    with torch.no_grad():
        return torch.cat(
            [model(torch.tensor([c])).logits[0, PPL_CTX // 2 : PPL_CTX - 1].float() for c in hf_chunks(tok_dir)]
        )


def hf_peakedness(model, tok_dir: Path) -> float:
    """Mean top-1 probability of the f32 HF model at llama-perplexity's scored positions."""
    import torch

    return float(torch.softmax(hf_scored_logits(model, tok_dir), -1).max(-1).values.mean())


# ----------------------------------------------------------------------------------------------------------------
# conversion with llama.cpp's convert_hf_to_gguf.py

CONVERT_WRAPPER = r"""
import sys, runpy
src = sys.argv.pop(1)
sys.path.insert(0, src + "/gguf-py")
sys.path.insert(0, src)
import gguf  # llama.cpp's own gguf-py
assert gguf.__file__.startswith(src), gguf.__file__
import conversion
from conversion import base as _base
# our BPE tokenizer is not in convert_hf_to_gguf's hash table of known pre-tokenizers: it is a plain GPT-2 one
_base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
# no tokenizer.model here (and no sentencepiece installed): fail the way set_vocab's fallbacks expect
_orig_spm = _base.TextModel._create_vocab_sentencepiece
def _create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return _orig_spm(self)
_base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
# gemma / gemma2 / phi3 converters want a sentencepiece tokenizer.model: use the BPE (gpt2) vocab path instead
# (not for the *-spm entries, which have one)
def _gpt2_vocab(self):
    self._set_vocab_gpt2()
if not (__import__("pathlib").Path(sys.argv[1]) / "tokenizer.model").is_file():
    for modname, clsname in (("gemma", "GemmaModel"), ("gemma", "Gemma2Model"), ("phi", "Phi3MiniModel")):
        mod = __import__("conversion." + modname, fromlist=[clsname])
        getattr(mod, clsname).set_vocab = _gpt2_vocab
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(src: Path, model_dir: Path, out: Path, tmp: Path, model_name: str, spm_pkgs: str = "") -> list[str]:
    wrapper = tmp / "convert_wrapper.py"
    wrapper.write_text(CONVERT_WRAPPER)
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = spm_pkgs
    cmd = [
        sys.executable,
        str(wrapper),
        str(src),
        str(model_dir),
        "--outtype",
        "f32",
        "--outfile",
        str(out),
        "--model-name",
        model_name,
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert failed for {model_dir}:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    if (model_dir / "tokenizer.model").is_file():
        return [
            "convert_hf_to_gguf.py",
            "<model_dir>",
            "--outtype",
            "f32",
            "--outfile",
            "<f32.gguf>",
            "--model-name",
            model_name,
            "(sentencepiece tokenizer.model: _set_vocab_sentencepiece)",
        ]
    return [
        "convert_hf_to_gguf.py",
        "<model_dir>",
        "--outtype",
        "f32",
        "--outfile",
        "<f32.gguf>",
        "--model-name",
        model_name,
        "(get_vocab_base_pre -> 'gpt-2'; gemma/gemma2/phi3 set_vocab -> _set_vocab_gpt2)",
    ]


# the types llama-quantize makes only with an importance matrix (llama-imatrix's, over english.txt on the f32 model)
NEEDS_IMATRIX = {"IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ1_M"}


def importance_matrix(llama_dir: Path, f32: Path, tmp: Path) -> Path:
    """llama-imatrix over english.txt's chunks of 128 on the f32 model, once a model (the same file each run)."""
    out = tmp / f"{f32.stem}-imatrix.gguf"
    if out.exists():
        return out
    tool = llama_dir / "llama-imatrix"
    if not tool.exists():
        raise RuntimeError(
            f"{tool} is missing: build it beside llama-quantize (in {llama_dir}/src/vendor/llama.cpp: cmake --build "
            f"build-native --target llama-imatrix, then copy build-native/bin/llama-imatrix to {llama_dir})"
        )
    cmd = [str(tool), "-m", str(f32), "-f", str(TEXT_FILE), "-o", str(out), "-c", "128", "-t", "2", "--no-ppl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"llama-imatrix failed: {r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return out


def quantize(llama_dir: Path, f32: Path, out: Path, qtype: str, tmp: Path) -> list[str]:
    imatrix = ["--imatrix", str(importance_matrix(llama_dir, f32, tmp))] if qtype in NEEDS_IMATRIX else []
    cmd = [str(llama_dir / "llama-quantize"), *imatrix, str(f32), str(out), qtype, "2"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama-quantize failed: {r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    shown = ["--imatrix", "<llama-imatrix -f english.txt -c 128>"] if imatrix else []
    return ["llama-quantize", *shown, "<f32.gguf>", out.name, qtype, "2"]


def tensor_types(path: Path, gguf_src: Path) -> tuple[dict, dict]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    counts = collections.Counter(t.tensor_type.name for t in reader.tensors)
    per_tensor = {t.name: t.tensor_type.name for t in reader.tensors}
    return dict(sorted(counts.items())), per_tensor


# ----------------------------------------------------------------------------------------------------------------
# 3. llama-perplexity


def read_kl_base(path: Path) -> dict:
    """Decodes llama-perplexity's --kl-divergence-base (a.k.a. --save-all-logits) file.

    Layout (tools/perplexity/perplexity.cpp, perplexity()):
      char[8] "_logits_"; int32 n_ctx; int32 n_vocab; int32 n_chunk;
      int32 tokens[n_chunk*n_ctx]   -- the tokenized text as-is (llama.cpp overwrites token 0 of each chunk with
                                       BOS while evaluating when the vocab adds BOS, but the dump keeps the original)
      per chunk, n_ctx-1-n_ctx/2 rows (one per scored position p = n_ctx/2 .. n_ctx-2, predicting token p+1) of
        nv = 2*((n_vocab+1)/2)+4 uint16: the first 4 hold float32 scale and float32 min_log_prob, then n_vocab
        uint16 q; log_prob[i] = min_log_prob + scale*q[i] (q == 0 means "<= max_logit-16", stored as the floor).
    """
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_", raw[:8]
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<iii", raw, 8)
    off = 20
    tokens = np.frombuffer(raw, dtype="<i4", count=n_chunk * n_ctx, offset=off).reshape(n_chunk, n_ctx)
    off += 4 * n_chunk * n_ctx
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    n_rows = n_ctx - 1 - first
    body = np.frombuffer(raw, dtype="<u2", offset=off).reshape(n_chunk, n_rows, nv)
    assert body.nbytes == len(raw) - off, (body.nbytes, len(raw) - off)
    header = body[:, :, :4].copy().view("<f4")  # (n_chunk, n_rows, 2)
    scale, floor = header[..., 0], header[..., 1]
    q = body[:, :, 4 : 4 + n_vocab].astype(np.float64)
    logprobs = floor[..., None].astype(np.float64) + scale[..., None].astype(np.float64) * q
    return dict(
        n_ctx=n_ctx,
        n_vocab=n_vocab,
        n_chunk=n_chunk,
        tokens=tokens,
        first=first,
        logprobs=logprobs,
        floor=floor.astype(np.float64),
        scale=scale.astype(np.float64),
    )


def run_perplexity(llama_dir: Path, gguf_path: Path, tmp: Path) -> dict:
    dump = tmp / (gguf_path.stem + ".kld")
    cmd = [
        str(llama_dir / "llama-perplexity"),
        "-m",
        str(gguf_path),
        "-f",
        str(TEXT_FILE),
        "-c",
        str(PPL_CTX),
        "-b",
        str(PPL_CTX),
        "-t",
        str(PPL_THREADS),
        "--chunks",
        str(PPL_CHUNKS),
        "--no-repack",
        "--kl-divergence-base",
        str(dump),
    ]
    # llama.cpp's logger is asynchronous and now and then loses its last stderr lines at exit (the process still
    # exits 0 and the dump is complete): retry a few times until the "Final estimate" line is there; failing that,
    # the last running value "[n]x.xxxx" is the same number (exp(mean nll) over all chunks, same %.4f format).
    final = err = None
    for _attempt in range(20):
        r = subprocess.run(cmd, capture_output=True, text=True)
        out = r.stdout + "\n" + r.stderr
        if r.returncode != 0:
            raise RuntimeError(f"llama-perplexity failed on {gguf_path.name}:\n{out[-5000:]}")
        running = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+|nan|inf)", out)]
        if len(running) != PPL_CHUNKS:
            continue
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
        if m:
            final, err, source = float(m.group(1)), float(m.group(2)), "final_estimate_line"
            break
    else:
        if len(running) != PPL_CHUNKS:
            raise RuntimeError(f"no perplexity values in llama-perplexity output:\n{out[-5000:]}")
        final, err, source = running[-1], None, "last_running_value"
    kl = read_kl_base(dump)
    dump.unlink()
    cmdline = [
        "llama-perplexity",
        "-m",
        gguf_path.name,
        "-f",
        "tests/data/english.txt",
        "-c",
        str(PPL_CTX),
        "-b",
        str(PPL_CTX),
        "-t",
        str(PPL_THREADS),
        "--chunks",
        str(PPL_CHUNKS),
        "--no-repack",
        "--kl-divergence-base",
        "<tmpfile>",
    ]
    return dict(final_ppl=final, final_ppl_err=err, final_ppl_source=source, running_ppl=running, kl=kl, cmd=cmdline)


def summarize(ppl: dict, bos_id: int | None, add_bos: bool) -> dict:
    kl = ppl["kl"]
    n_ctx, first = kl["n_ctx"], kl["first"]
    chunks = []
    all_top1p, all_margin, top1_is_input = [], [], []
    for c in range(kl["n_chunk"]):
        toks = [int(t) for t in kl["tokens"][c]]
        if add_bos:
            toks[0] = int(bos_id)
        lp = kl["logprobs"][c]  # (n_rows, n_vocab)
        positions, top1, margin, target_lp, topk_ids, topk_lp, floor_flags = [], [], [], [], [], [], []
        nll = 0.0
        for r in range(lp.shape[0]):
            p = first + r
            row = lp[r]
            order = np.argsort(-row, kind="stable")[:TOPK]
            tgt = toks[p + 1]
            positions.append(p)
            top1.append(int(order[0]))
            margin.append(round(float(row[order[0]] - row[order[1]]), 5))
            target_lp.append(round(float(row[tgt]), 5))
            floor_flags.append(bool(kl["logprobs"][c][r][tgt] <= kl["floor"][c][r] + 1e-9))
            topk_ids.append([int(i) for i in order])
            topk_lp.append([round(float(row[i]), 5) for i in order])
            nll -= float(row[tgt])
            all_top1p.append(math.exp(float(row[order[0]])))
            all_margin.append(float(row[order[0]] - row[order[1]]))
            top1_is_input.append(int(order[0]) == toks[p])
        chunks.append(
            dict(
                tokens=toks,
                scored_positions=positions,
                top1=top1,
                margin=margin,
                target_logprob=target_lp,
                target_at_floor=floor_flags,
                topk_ids=topk_ids,
                topk_logprob=topk_lp,
                logprob_floor=[round(float(x), 5) for x in kl["floor"][c]],
                logprob_step=[float(x) for x in kl["scale"][c]],
                ppl_from_dump=round(math.exp(nll / len(positions)), 5),
                running_ppl_printed=ppl["running_ppl"][c] if c < len(ppl["running_ppl"]) else None,
            )
        )
    return dict(
        n_ctx=n_ctx,
        n_vocab=kl["n_vocab"],
        n_chunk=kl["n_chunk"],
        first_scored=first,
        chunks=chunks,
        final_ppl=ppl["final_ppl"],
        final_ppl_err=ppl["final_ppl_err"],
        final_ppl_source=ppl["final_ppl_source"],
        mean_top1_prob=round(float(np.mean(all_top1p)), 5),
        share_margin_gt_0_5=round(float(np.mean(np.array(all_margin) > 0.5)), 5),
        share_margin_gt_0_1=round(float(np.mean(np.array(all_margin) > 0.1)), 5),
        share_top1_is_input=round(float(np.mean(top1_is_input)), 5),
        n_distinct_top1=len({t for c in chunks for t in c["top1"]}),
        min_margin=round(float(np.min(all_margin)), 6),
    )


def compare_with_f32(summ: dict, f32: dict) -> dict:
    """llama.cpp's quantized-file results against its own results on the f32 GGUF of the same model: adds
    top1_f32 / margin_f32 to every chunk and the share of scored positions whose top-1 is the same."""
    same, same_clear = [], []
    for c, c32 in zip(summ["chunks"], f32["chunks"], strict=True):
        assert c["tokens"] == c32["tokens"] and c["scored_positions"] == c32["scored_positions"]
        c["top1_f32"] = list(c32["top1"])
        c["margin_f32"] = list(c32["margin"])
        for t, t32, m32 in zip(c["top1"], c32["top1"], c32["margin"], strict=True):
            same.append(t == t32)
            if m32 > 0.1:
                same_clear.append(t == t32)
    return dict(
        f32_final_ppl=f32["final_ppl"],
        f32_final_ppl_err=f32["final_ppl_err"],
        f32_mean_top1_prob=f32["mean_top1_prob"],
        agreement_with_f32=round(float(np.mean(same)), 5),
        agreement_with_f32_margin_gt_0_1=round(float(np.mean(same_clear)), 5) if same_clear else None,
        n_scored=len(same),
        n_scored_f32_margin_gt_0_1=len(same_clear),
    )


# ----------------------------------------------------------------------------------------------------------------
# 4. llama-server references for real models


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict, timeout=120) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def llama_server(llama_dir: Path, model: Path, n_ctx: int, extra: list[str] | None = None):
    """Runs llama-server on 127.0.0.1 (free port) with `model` (and `extra` flags) until the block ends; yields the
    port."""
    port = free_port()
    cmd = [
        str(llama_dir / "llama-server"),
        "-m",
        str(model),
        "-c",
        str(n_ctx),
        "-t",
        "2",
        "--no-webui",
        "--no-repack",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(extra or []),
    ]
    logf = tempfile.TemporaryFile()  # noqa: SIM115 (the server's log, read after it stops)
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                logf.seek(0)
                raise RuntimeError(f"llama-server exited: {logf.read()[-3000:].decode(errors='replace')}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() > deadline:
                raise RuntimeError("llama-server did not become healthy")
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()


def _pieces(resp: dict) -> list:
    """Pieces of a /tokenize answer with with_pieces: a string, or a list of byte values when not valid UTF-8
    (e.g. a byte-fallback token)."""
    toks = resp.get("tokens") or []
    return [t.get("piece") if isinstance(t, dict) else None for t in toks]


def spm_tokenize_reference(llama_dir: Path, model: Path) -> list[dict]:
    """llama-server's POST /tokenize of SPM_TOKENIZE: add_special true/false with parse_special true, and for strings
    with '<' also parse_special false."""
    cases = []
    with llama_server(llama_dir, model, 256) as port:
        for text in SPM_TOKENIZE:
            variants = [(True, True), (False, True)]
            if "<" in text:
                variants += [(True, False), (False, False)]
            for add_special, parse_special in variants:
                body = {"content": text, "add_special": add_special, "parse_special": parse_special}
                ids = _post(port, "/tokenize", body)["tokens"]
                pieces = _pieces(_post(port, "/tokenize", dict(body, with_pieces=True)))
                assert all(isinstance(i, int) for i in ids) and len(pieces) == len(ids), (text, ids, pieces)
                cases.append(
                    dict(text=text, add_special=add_special, parse_special=parse_special, tokens=ids, pieces=pieces)
                )
    return cases


def server_reference(llama_dir: Path, model: Path, out_json: Path, tokenize: list[str], complete: list[str]):
    with llama_server(llama_dir, model, 2048) as port:
        props = {}
        with contextlib.suppress(Exception), urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=10) as r:
            props = json.loads(r.read())
        toks = []
        for s in tokenize:
            ids = _post(port, "/tokenize", {"content": s, "add_special": True, "parse_special": True})["tokens"]
            pieces = _post(
                port, "/tokenize", {"content": s, "add_special": True, "parse_special": True, "with_pieces": True}
            ).get("tokens")
            toks.append(
                dict(
                    text=s,
                    add_special=True,
                    parse_special=True,
                    tokens=ids,
                    pieces=[p.get("piece") if isinstance(p, dict) else None for p in pieces]
                    if pieces and isinstance(pieces[0], dict)
                    else None,
                )
            )
        comps = []
        for s in complete:
            body = {
                "prompt": s,
                "n_predict": REAL_N_PREDICT,
                "temperature": 0,
                "cache_prompt": False,
                "return_tokens": True,
                "seed": 0,
            }
            r = _post(port, "/completion", body, timeout=300)
            prompt_ids = _post(port, "/tokenize", {"content": s, "add_special": True, "parse_special": True})["tokens"]
            comps.append(
                dict(
                    prompt=s,
                    request=body,
                    prompt_tokens=prompt_ids,
                    content=r.get("content"),
                    tokens=r.get("tokens"),
                    tokens_predicted=r.get("tokens_predicted"),
                    stop_type=r.get("stop_type"),
                    stopped_eos=r.get("stopped_eos"),
                    stopped_limit=r.get("stopped_limit"),
                )
            )
        try:
            shown = str(model.resolve().relative_to(REPO))
        except ValueError:
            shown = str(model)
        meta = {
            "model_file": shown,
            "model_size_bytes": model.stat().st_size,
            "server_cmd": [
                "llama-server",
                "-m",
                model.name,
                "-c",
                "2048",
                "-t",
                "2",
                "--no-webui",
                "--no-repack",
                "--host",
                "127.0.0.1",
                "--port",
                "<free>",
            ],
            "llama_cpp": llama_cpp_version(llama_dir),
            "props_build_info": props.get("build_info"),
            "bos_token": props.get("bos_token"),
            "eos_token": props.get("eos_token"),
            "tokenize": toks,
            "completions": comps,
            "notes": "tokens from POST /tokenize {content, add_special: true, parse_special: true}; completions "
            "from POST /completion with temperature 0 (greedy), n_predict 24, cache_prompt false; "
            "'tokens' are the generated token ids (return_tokens).",
        }
        out_json.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
        log("wrote", out_json)


# ----------------------------------------------------------------------------------------------------------------


def llama_cpp_version(llama_dir: Path) -> dict:
    r = subprocess.run([str(llama_dir / "llama-perplexity"), "--version"], capture_output=True, text=True)
    text = (r.stdout + r.stderr).strip()
    m = re.search(r"commit ([0-9a-f]+)", text)
    src = llama_dir / "src" / "vendor" / "llama.cpp"
    full = None
    with contextlib.suppress(Exception):
        full = (
            subprocess.run(
                ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
            or None
        )
    pkg = sorted(p.name for p in llama_dir.glob("llama_cpp_python-*.tar.gz"))
    return {
        "version_output": text,
        "commit": m.group(1) if m else None,
        "source_commit": full,
        "source_package": pkg[0] if pkg else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--llama-dir", default=os.environ.get("LLAMA_SERVER_DIR", str(Path.home() / ".cache" / "llama-server-peer"))
    )
    ap.add_argument("--out", default=str(OUT_DIR))
    ap.add_argument("--only", default="", help="comma separated subset of: " + ",".join(ARCHS))
    ap.add_argument("--skip-server", action="store_true", help="skip the real-model llama-server references")
    ap.add_argument("--server-only", action="store_true", help="only the real-model llama-server references")
    ap.add_argument("--gemma-real", default="/tmp/gemma/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--keep-tmp", action="store_true")
    ap.add_argument(
        "--spm-pkgs",
        default=os.environ.get("SPM_PKGS", DEFAULT_SPM_PKGS),
        help="directory with the sentencepiece and protobuf packages (pip install --target DIR "
        "sentencepiece protobuf), needed for the *-spm entries",
    )
    args = ap.parse_args()

    llama_dir = Path(args.llama_dir).expanduser()
    src = llama_dir / "src" / "vendor" / "llama.cpp"
    sys.path.insert(0, str(src / "gguf-py"))  # read GGUFs with llama.cpp's own gguf-py
    for t in ("llama-quantize", "llama-perplexity", "llama-server"):
        if not (llama_dir / t).exists():
            sys.exit(f"{llama_dir / t} missing: run bash /work/shared/peers/build-llama-server.sh first")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="refgguf-"))
    try:
        if not args.server_only:
            build_tiny(args, llama_dir, src, out_dir, tmp)
        if not args.skip_server:
            real = Path(args.gemma_real)
            if real.exists():
                server_reference(llama_dir, real, out_dir / "gemma3-270m-llamacpp.json", REAL_TOKENIZE, REAL_COMPLETE)
            else:
                log("skip gemma3 270m reference:", real, "missing")
            smol = sorted((REPO / ".venv").rglob("SmolLM2*.gguf"))
            if smol:
                server_reference(
                    llama_dir,
                    smol[0],
                    out_dir / "smollm2-llamacpp.json",
                    REAL_TOKENIZE + ["<|im_start|>user\nHi<|im_end|>\n"],
                    REAL_COMPLETE,
                )
            else:
                log("skip SmolLM2 reference: no SmolLM2*.gguf under .venv")
    finally:
        if args.keep_tmp:
            log("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def build_tiny(args, llama_dir: Path, src: Path, out_dir: Path, tmp: Path):
    only = [a for a in args.only.split(",") if a]
    for a in only:
        if a not in ARCHS:
            sys.exit(f"unknown arch {a}")
    todo = [n for n in ARCHS if not only or n in only]
    if any("spm" in ARCHS[n] for n in todo) and not spm_available(args.spm_pkgs):
        sys.exit(
            f"the *-spm entries need sentencepiece + protobuf (not in the project venv): "
            f"{sys.executable} -m pip install --target {args.spm_pkgs} sentencepiece protobuf "
            f"(or --spm-pkgs DIR), or leave them out with --only"
        )
    tok_dir = tmp / "tokenizer"
    vocab = train_tokenizer(tok_dir)
    log("tokenizer vocab", vocab)
    ref_path = out_dir / "reference.json"
    ref = json.loads(ref_path.read_text()) if (only and ref_path.exists()) else {}
    files = dict(ref.get("files", {}))
    failures = dict(ref.get("failures", {}))
    for name, spec in ARCHS.items():
        if only and name not in only:
            continue
        failures.pop(name, None)
        try:
            m_tok_dir, m_vocab, spm_pkgs, tok_extra = tok_dir, vocab, "", {}
            if "spm" in spec:
                m_tok_dir = tmp / f"spm-{spec['spm']}"
                if not m_tok_dir.is_dir():
                    train_spm_tokenizer(m_tok_dir, spec["spm"])
                m_vocab = spm_vocab_size(m_tok_dir)
                spm_pkgs = args.spm_pkgs
                tok_extra = dict(tokenizer=spm_tokenizer_info(m_tok_dir, spec["spm"], m_vocab))
            if "added" in spec:  # the vocabulary with these tokens added after its own
                m_tok_dir = tmp / f"tok-{name}"
                m_vocab = add_tokens(tok_dir, m_tok_dir, spec["added"], CHAT_TEMPLATES.get(spec.get("chat_template")))
            model = build_model(name, m_vocab)
            if "spm" in spec:
                for k, v in spm_token_ids(spec["spm"]).items():
                    setattr(model.config, k, v)
                    setattr(model.generation_config, k, v)
            calib = calibrate(model, model_config(name, m_vocab)[0], m_tok_dir)
            peak = hf_peakedness(model, m_tok_dir)
            mdir = tmp / f"hf-{name}"
            model.save_pretrained(mdir, safe_serialization=True)
            for f in m_tok_dir.iterdir():
                shutil.copy(f, mdir / f.name)
            arch_cfg = json.loads((mdir / "config.json").read_text())
            del model
            f32 = tmp / f"{name}-f32.gguf"
            conv_cmd = convert(src, mdir, f32, tmp, f"tiny-random-{name}", spm_pkgs)
            # llama.cpp on the unquantized model, same settings: the yardstick for how much quantization (and
            # llama.cpp's own activation rounding on quantized weights) moves its answers
            f32_meta = gguf_meta(f32, src)
            f32_summ = summarize(
                run_perplexity(llama_dir, f32, tmp),
                f32_meta.get("tokenizer.ggml.bos_token_id"),
                bool(f32_meta.get("tokenizer.ggml.add_bos_token", False)),
            )
            log(
                f"{name} f32: PPL {f32_summ['final_ppl']:.4f}  top1p {f32_summ['mean_top1_prob']:.3f}  margin>0.1 "
                f"{f32_summ['share_margin_gt_0_1']:.3f}  top1==input {f32_summ['share_top1_is_input']:.3f}  "
                f"distinct top1 {f32_summ['n_distinct_top1']}"
            )
            for q in spec["quants"]:
                fname = f"{name}-{q.lower()}.gguf"
                dst = out_dir / fname
                q_cmd = quantize(llama_dir, f32, dst, q, tmp)
                counts, per_tensor = tensor_types(dst, src)
                ppl = run_perplexity(llama_dir, dst, tmp)
                meta = gguf_meta(dst, src)
                add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
                summ = summarize(ppl, meta.get("tokenizer.ggml.bos_token_id"), add_bos)
                summ.update(compare_with_f32(summ, f32_summ))
                extra = dict(tok_extra)
                rs = rope_scaling_info(meta, per_tensor)
                if rs is not None:
                    extra.update(rope_scaling=rs, notes=rs["notes"])
                if "spm" in spec:
                    extra["tokenizer"] = dict(extra["tokenizer"], gguf=spm_gguf_info(dst))
                    extra["tokenize"] = spm_tokenize_reference(llama_dir, dst)
                    extra["notes"] = SPM_NOTES
                    log(f"{fname}: {len(extra['tokenize'])} tokenize cases")
                files[fname] = dict(
                    file=fname,
                    arch=name,
                    gguf_arch=meta.get("general.architecture"),
                    hf_architecture=arch_cfg.get("architectures", [None])[0],
                    hf_model_type=arch_cfg.get("model_type"),
                    quant=q,
                    size_bytes=dst.stat().st_size,
                    tensor_types=counts,
                    tensor_type_by_name=per_tensor,
                    add_bos=add_bos,
                    bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                    eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                    hf_mean_top1_prob=round(peak, 4),
                    final_norm_scale=round(calib, 5),
                    hf_config=arch_cfg,
                    commands=dict(convert=conv_cmd, quantize=q_cmd, perplexity=ppl["cmd"]),
                    **extra,
                    **summ,
                )
                log(
                    f"{fname}: {dst.stat().st_size / 1e6:.2f} MB  PPL {summ['final_ppl']:.4f} (f32 "
                    f"{summ['f32_final_ppl']:.4f})  top1p {summ['mean_top1_prob']:.3f} (hf f32 {peak:.3f})  "
                    f"agree_f32 {summ['agreement_with_f32']:.4f} (margin>0.1 "
                    f"{summ['agreement_with_f32_margin_gt_0_1']:.4f})  types {counts}"
                )
            f32.unlink()
            shutil.rmtree(mdir)
        except Exception as e:  # keep going with the other architectures
            log(f"FAILED {name}: {e}")
            failures[name] = str(e)[-2000:]
    ref = {
        "format": 1,
        "generator": "scripts/make_reference_ggufs.py",
        "llama_cpp": llama_cpp_version(llama_dir),
        "text_file": "tests/data/english.txt",
        "tokenizer": {
            "type": "byte-level BPE (tokenizers), GPT-2 pre-tokenizer regex",
            "vocab_size": vocab,
            "bos": "<s>",
            "eos": "</s>",
            "trained_on": "tests/data/english.txt",
        },
        "perplexity": {
            "n_ctx": PPL_CTX,
            "n_batch": PPL_CTX,
            "threads": PPL_THREADS,
            "chunks": PPL_CHUNKS,
            "topk": TOPK,
        },
        "conventions": CONVENTIONS,
        "files": dict(sorted(files.items())),
        "failures": failures,
    }
    ref_path.write_text(json.dumps(ref, separators=(",", ":")) + "\n")
    log("wrote", ref_path)


def spm_vocab_size(tok_dir: Path) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model")).vocab_size()


def spm_tokenizer_info(tok_dir: Path, flavor: str, vocab: int) -> dict:
    import hashlib

    fl = SPM_FLAVORS[flavor]
    return {
        "type": "sentencepiece BPE (sentencepiece package), byte_fallback, split_digits, identity normalization, "
        "remove_extra_whitespaces false",
        "flavor": flavor,
        "vocab_size": vocab,
        "add_dummy_prefix": fl["add_dummy_prefix"],
        "ids": fl["ids"],
        "bos": fl["bos"],
        "eos": fl["eos"],
        "unk": fl["unk"],
        "pad": fl["pad"],
        "user_defined_symbols": SPM_USER_DEFINED,
        "control_symbols": SPM_CONTROL,
        "required_chars": "0123456789",
        "trained_on": "tests/data/english.txt",
        "tokenizer_model_sha256": hashlib.sha256((tok_dir / "tokenizer.model").read_bytes()).hexdigest(),
    }


def spm_gguf_info(path: Path) -> dict:
    """The tokenizer keys of an SPM GGUF and its token-type counts (1 normal, 2 unknown, 3 control, 4 user defined,
    5 unused, 6 byte)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for k, f in reader.fields.items():
        if k.startswith("tokenizer.ggml.") and k not in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type",
        ):
            with contextlib.suppress(Exception):
                out[k] = f.contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    out["token_type_counts"] = {str(t): c for t, c in sorted(collections.Counter(int(x) for x in types).items())}
    out["non_normal_tokens"] = {str(i): [tokens[i], int(t)] for i, t in enumerate(types) if int(t) not in (1, 6)}
    return out


SPM_NOTES = (
    "SPM vocabulary (tokenizer.ggml.model 'llama'): tokenize = llama-server's POST /tokenize "
    "{content, add_special, parse_special} (ids) and the same with with_pieces (pieces: a string, or a list of byte "
    "values when the piece is not valid UTF-8, e.g. a lone byte-fallback token), llama-server -c 256 -t 2 --no-webui "
    "--no-repack on 127.0.0.1. Every string with add_special true and false (parse_special true); strings containing "
    "'<' also with parse_special false. add_special adds BOS (add_bos_token true), never EOS."
)


def gguf_meta(path: Path, gguf_src: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for k, f in reader.fields.items():
        if k in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        ):
            continue
        try:
            out[k] = f.contents()
        except Exception:
            continue
    return out


CONVENTIONS = (
    "llama-perplexity tokenizes the whole text once with add_special=true (BOS prepended when the vocab's "
    "add_bos_token is true, which it is for every tiny model here), cuts it into chunks of n_ctx tokens "
    "(tokens[c*n_ctx:(c+1)*n_ctx]) and, when add_bos, overwrites the FIRST token of every chunk with BOS (it does "
    "not insert one): chunks[c].tokens is exactly what was evaluated, positions 0..n_ctx-1, KV cache cleared "
    "between chunks. Only the second half is scored: the logits at positions p = n_ctx/2 .. n_ctx-2 predict token "
    "p+1 (scored_positions). For each scored p: top1 = argmax, margin = logprob(top1) - logprob(top2), "
    "target_logprob = logprob of tokens[p+1], topk_ids/topk_logprob the TOPK best. Log-probs come from the "
    "--kl-divergence-base dump, which stores them as uint16: logprob = floor + step*q with step = "
    "(max_logit - min_logit')/65535, min_logit' = max(min_logit, max_logit-16), floor = min_logit' - max_logit - "
    "logsumexp; so values are exact to ~step/2 (<= 1.3e-4) and everything below max_logprob-16 reads as the floor "
    "(target_at_floor flags it). ppl_from_dump = exp(mean -target_logprob) of the chunk; running_ppl_printed is "
    "llama.cpp's printed running PPL after chunk c ([c+1]x.xxxx); final_ppl the 'Final estimate: PPL'."
)


if __name__ == "__main__":
    main()
