"""What a GGUF file's header says about its model, read once (no weights): its architecture, the weight-only mode
that keeps its linears' own quantization, its shape for pre-flight, its chat template. The model cache's stamp
keeps these, so later starts do not parse the file again."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

FLOAT_TYPES = {"F32", "F16", "BF16"}
FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"}  # held as int4; 5 bits and more as int8


def mode_of(types: list[str]) -> str:
    """The weight-only mode that keeps tensors of these GGUF types (a fused layer's parts): none for float types,
    int4 when every part has 4 bits or fewer, else int8."""
    if all(t in FLOAT_TYPES for t in types):
        return "none"
    return "int4" if all(t in FOUR_BIT for t in types) else "int8"
# llama.cpp's architecture names that transformers calls otherwise
MODEL_TYPES = {"gemma3": "gemma3_text"}


def open_gguf(source):
    """A GGUFReader for a path, or the reader given: a first start parses the file (its whole vocabulary: 8 s for
    Gemma's 262k tokens) once for the header, the tokenizer and the weights."""
    from gguf import GGUFReader

    return source if isinstance(source, GGUFReader) else GGUFReader(str(source))


def read_header(source) -> dict:
    reader = open_gguf(source)

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture", "")
    kinds = Counter(t.tensor_type.name for t in reader.tensors
                    if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2)
    kind = kinds.most_common(1)[0][0] if kinds else ""
    heads = field(f"{arch}.attention.head_count") or 1
    hidden = field(f"{arch}.embedding_length") or 0
    sizes = {t.name: int(t.n_elements) for t in reader.tensors}
    by_bytes = Counter()  # the matrices' types, most bytes first
    for t in reader.tensors:
        if len(t.shape) == 2:
            by_bytes[t.tensor_type.name] += int(t.n_bytes)
    return {"arch": arch, "chat_template": field("tokenizer.chat_template"),
            "quantize": mode_of([kind]) if kind else "none", "types": [k for k, _ in by_bytes.most_common()],
            "num_params": sum(sizes.values()), "num_layers": field(f"{arch}.block_count"),
            "num_kv_heads": field(f"{arch}.attention.head_count_kv") or heads,
            "head_dim": field(f"{arch}.attention.key_length") or hidden // heads,
            "vocab_params": sizes.get("token_embd.weight", 0), "tied": "output.weight" not in sizes, "hidden": hidden}


def model_type(arch: str) -> str:
    return MODEL_TYPES.get(arch, arch)
