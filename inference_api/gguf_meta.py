"""What a GGUF file's header says about its model, read once (no weights): its architecture, the weight-only mode
that keeps its linears' own quantization, its shape for pre-flight, its chat template. The model cache's stamp
keeps these, so later starts do not parse the file again."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

# GGUF tensor types by the weight-only mode that keeps them: 4-bit blocks as int4, 5- to 8-bit as int8
_INT4 = {"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"}
_INT8 = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}
# llama.cpp's architecture names that transformers calls otherwise
MODEL_TYPES = {"gemma3": "gemma3_text"}


def read_header(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

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
    return {"arch": arch, "chat_template": field("tokenizer.chat_template"),
            "quantize": "int4" if kind in _INT4 else "int8" if kind in _INT8 else "none",
            "num_params": sum(sizes.values()), "num_layers": field(f"{arch}.block_count"),
            "num_kv_heads": field(f"{arch}.attention.head_count_kv") or heads,
            "head_dim": field(f"{arch}.attention.key_length") or hidden // heads,
            "vocab_params": sizes.get("token_embd.weight", 0), "tied": "output.weight" not in sizes, "hidden": hidden}


def model_type(arch: str) -> str:
    return MODEL_TYPES.get(arch, arch)
