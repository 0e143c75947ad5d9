"""Pure-Python reader for llama.cpp's reference results on the tiny GGUFs in tests/data/gguf/.

The data is produced by scripts/make_reference_ggufs.py (see tests/data/gguf/README.md); reading it needs only the
standard library, no llama.cpp.

    from gguf_reference import load_reference
    for name, ref in load_reference().items():      # "llama-q4_k_m.gguf" -> ReferenceFile
        for chunk in ref.chunks:
            # evaluate chunk.tokens (positions 0..n_ctx-1, fresh KV cache) with our engine, then
            for pos in chunk.positions():             # ScoredPosition: logits at pos predict chunk.tokens[pos+1]
                ...  # compare argmax with pos.top1 where pos.margin is comfortably > tolerance, etc.

Conventions (also in reference.json["conventions"]):
  * chunk.tokens is exactly what llama-perplexity evaluated: the text tokenized once with BOS prepended, cut into
    n_ctx-token chunks, and - because the vocab adds BOS - the FIRST token of every chunk overwritten with BOS.
  * only positions n_ctx/2 .. n_ctx-2 are scored; the logits at position p predict tokens[p+1].
  * log-probs come from llama.cpp's uint16-quantized dump: exact to about +-1.3e-4, and anything more than 16 nats
    below the top log-prob reads as the row's floor (target_at_floor tells when the target token hit it).
  * llama.cpp ran with its default f16 KV cache and --no-repack (AMX repacking crashes on this CPU).
  * llama-spm-* / gemma-spm-*: sentencepiece (tokenizer.ggml.model "llama") vocabularies; ref.tokenize holds
    llama-server's /tokenize ids and pieces for a list of strings (ref.tokenize_cases()).
  * top1_f32 / f32_final_ppl / agreement_with_f32: llama.cpp's results on the unquantized f32 GGUF of the same model
    (same settings), i.e. how far quantization alone moves llama.cpp itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GGUF_DIR = Path(__file__).resolve().parent / "data" / "gguf"
REFERENCE_JSON = GGUF_DIR / "reference.json"


@dataclass(frozen=True)
class ScoredPosition:
    position: int  # index into Chunk.tokens whose output logits were scored
    target: int  # Chunk.tokens[position + 1]
    top1: int  # llama.cpp's argmax
    margin: float  # logprob(top1) - logprob(top2)
    target_logprob: float  # logprob of the actual next token (== logprob_floor when target_at_floor)
    target_at_floor: bool
    topk_ids: tuple[int, ...]
    topk_logprob: tuple[float, ...]
    logprob_floor: float  # values at or below this were clipped by llama.cpp's dump format
    logprob_step: float  # quantization step of this row's log-probs
    top1_f32: int | None = None  # llama.cpp's argmax on the f32 GGUF of the same model
    margin_f32: float | None = None


@dataclass(frozen=True)
class Chunk:
    index: int
    tokens: tuple[int, ...]
    scored_positions: tuple[int, ...]
    top1: tuple[int, ...]
    margin: tuple[float, ...]
    target_logprob: tuple[float, ...]
    target_at_floor: tuple[bool, ...]
    topk_ids: tuple[tuple[int, ...], ...]
    topk_logprob: tuple[tuple[float, ...], ...]
    logprob_floor: tuple[float, ...]
    logprob_step: tuple[float, ...]
    ppl_from_dump: float  # exp(-mean target_logprob) for this chunk alone (floor-clipped values included)
    running_ppl_printed: float | None  # llama.cpp's printed running PPL after this chunk
    top1_f32: tuple[int, ...] = ()  # llama.cpp's argmax on the f32 GGUF of the same model, per scored position
    margin_f32: tuple[float, ...] = ()  # ... and its margin there

    def positions(self) -> Iterator[ScoredPosition]:
        for i, p in enumerate(self.scored_positions):
            yield ScoredPosition(
                position=p,
                target=self.tokens[p + 1],
                top1=self.top1[i],
                margin=self.margin[i],
                target_logprob=self.target_logprob[i],
                target_at_floor=self.target_at_floor[i],
                topk_ids=self.topk_ids[i],
                topk_logprob=self.topk_logprob[i],
                logprob_floor=self.logprob_floor[i],
                logprob_step=self.logprob_step[i],
                top1_f32=self.top1_f32[i] if self.top1_f32 else None,
                margin_f32=self.margin_f32[i] if self.margin_f32 else None,
            )


@dataclass(frozen=True)
class ReferenceFile:
    file: str  # file name inside tests/data/gguf/
    path: Path
    arch: str  # our name (ARCHS in the script): llama, llama3rope, gemma2, phi3longrope, ...
    gguf_arch: str  # general.architecture in the GGUF
    hf_architecture: str
    quant: str  # llama-quantize type, e.g. Q4_K_M
    size_bytes: int
    tensor_types: dict[str, int]  # ggml type name -> number of tensors
    tensor_type_by_name: dict[str, str]
    add_bos: bool
    bos_token_id: int | None
    eos_token_id: int | None
    n_ctx: int
    n_vocab: int
    first_scored: int  # n_ctx // 2
    final_ppl: float  # llama.cpp's "Final estimate: PPL"
    final_ppl_err: float | None
    mean_top1_prob: float
    share_margin_gt_0_5: float
    chunks: tuple[Chunk, ...]
    hf_config: dict[str, Any] = field(repr=False)
    commands: dict[str, Any] = field(repr=False)
    raw: dict[str, Any] = field(repr=False)
    # llama.cpp on the f32 (unquantized) GGUF of the same model, same settings:
    f32_final_ppl: float | None = None
    f32_mean_top1_prob: float | None = None
    agreement_with_f32: float | None = None  # share of scored positions with top1 == top1_f32
    agreement_with_f32_margin_gt_0_1: float | None = None  # the same where the f32 margin > 0.1
    share_margin_gt_0_1: float | None = None
    # only for files with LongRoPE factor tensors (phi3longrope): which factor set llama.cpp used, its attn_factor,
    # the GGUF keys / factor tensors ({factor_set_used, n_ctx_seq, attn_factor, gguf_keys, factor_tensors, notes})
    rope_scaling: dict[str, Any] | None = field(default=None, repr=False)
    notes: str | None = field(default=None, repr=False)
    # only for the sentencepiece-vocabulary files (llama-spm, gemma-spm): how the vocabulary was made and its GGUF
    # tokenizer keys ({type, flavor, vocab_size, ids, user_defined_symbols, control_symbols, gguf: {...}}), and
    # llama-server's POST /tokenize results: ({text, add_special, parse_special, tokens, pieces}, ...); pieces are
    # strings, or lists of byte values where a piece is not valid UTF-8 (lone byte-fallback tokens)
    tokenizer: dict[str, Any] | None = field(default=None, repr=False)
    tokenize: tuple[dict[str, Any], ...] = field(default=(), repr=False)

    @property
    def exists(self) -> bool:
        return self.path.is_file()

    def tokenize_cases(self, parse_special: bool | None = True) -> Iterator[dict[str, Any]]:
        """llama.cpp's tokenization cases (empty for the BPE files); parse_special None: all of them."""
        for t in self.tokenize:
            if parse_special is None or t["parse_special"] == parse_special:
                yield t

    def positions(self) -> Iterator[tuple[Chunk, ScoredPosition]]:
        for c in self.chunks:
            for p in c.positions():
                yield c, p


@dataclass(frozen=True)
class ServerReference:
    """llama-server's tokenization and greedy completions for a real model (gemma-3-270m, SmolLM2)."""

    model_file: str
    tokenize: tuple[dict[str, Any], ...]  # {text, tokens, pieces, add_special, parse_special}
    completions: tuple[dict[str, Any], ...]  # {prompt, prompt_tokens, content, tokens, request}
    raw: dict[str, Any] = field(repr=False)

    def tokens_for(self, text: str) -> list[int]:
        for t in self.tokenize:
            if t["text"] == text:
                return list(t["tokens"])
        raise KeyError(text)


def load_reference_raw(path: Path | str = REFERENCE_JSON) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _chunk(i: int, c: dict[str, Any]) -> Chunk:
    return Chunk(
        index=i,
        tokens=tuple(c["tokens"]),
        scored_positions=tuple(c["scored_positions"]),
        top1=tuple(c["top1"]),
        margin=tuple(c["margin"]),
        target_logprob=tuple(c["target_logprob"]),
        target_at_floor=tuple(c["target_at_floor"]),
        topk_ids=tuple(tuple(x) for x in c["topk_ids"]),
        topk_logprob=tuple(tuple(x) for x in c["topk_logprob"]),
        logprob_floor=tuple(c["logprob_floor"]),
        logprob_step=tuple(c["logprob_step"]),
        ppl_from_dump=c["ppl_from_dump"],
        running_ppl_printed=c.get("running_ppl_printed"),
        top1_f32=tuple(c.get("top1_f32", ())),
        margin_f32=tuple(c.get("margin_f32", ())),
    )


def load_reference(path: Path | str = REFERENCE_JSON) -> dict[str, ReferenceFile]:
    """File name (e.g. "llama-q4_k_m.gguf") -> ReferenceFile, sorted by name."""
    path = Path(path)
    data = load_reference_raw(path)
    out: dict[str, ReferenceFile] = {}
    for name, f in sorted(data["files"].items()):
        out[name] = ReferenceFile(
            file=name,
            path=path.parent / name,
            arch=f["arch"],
            gguf_arch=f["gguf_arch"],
            hf_architecture=f["hf_architecture"],
            quant=f["quant"],
            size_bytes=f["size_bytes"],
            tensor_types=dict(f["tensor_types"]),
            tensor_type_by_name=dict(f["tensor_type_by_name"]),
            add_bos=f["add_bos"],
            bos_token_id=f.get("bos_token_id"),
            eos_token_id=f.get("eos_token_id"),
            n_ctx=f["n_ctx"],
            n_vocab=f["n_vocab"],
            first_scored=f["first_scored"],
            final_ppl=f["final_ppl"],
            final_ppl_err=f.get("final_ppl_err"),
            mean_top1_prob=f["mean_top1_prob"],
            share_margin_gt_0_5=f["share_margin_gt_0_5"],
            chunks=tuple(_chunk(i, c) for i, c in enumerate(f["chunks"])),
            hf_config=f.get("hf_config", {}),
            commands=f.get("commands", {}),
            raw=f,
            f32_final_ppl=f.get("f32_final_ppl"),
            f32_mean_top1_prob=f.get("f32_mean_top1_prob"),
            agreement_with_f32=f.get("agreement_with_f32"),
            agreement_with_f32_margin_gt_0_1=f.get("agreement_with_f32_margin_gt_0_1"),
            share_margin_gt_0_1=f.get("share_margin_gt_0_1"),
            rope_scaling=f.get("rope_scaling"),
            notes=f.get("notes"),
            tokenizer=f.get("tokenizer"),
            tokenize=tuple(f.get("tokenize", ())),
        )
    return out


def load_server_reference(name: str) -> ServerReference:
    """name: "gemma3-270m" or "smollm2" (tests/data/gguf/<name>-llamacpp.json)."""
    d = json.loads((GGUF_DIR / f"{name}-llamacpp.json").read_text(encoding="utf-8"))
    return ServerReference(
        model_file=d["model_file"], tokenize=tuple(d["tokenize"]), completions=tuple(d["completions"]), raw=d
    )
