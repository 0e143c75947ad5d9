"""What a GGUF file's header says about its model, read once (no weights): its architecture, the weight-only mode
that keeps its linears' own quantization, its shape for pre-flight, its chat template. The model cache's stamp
keeps these, so later starts do not parse the file again."""

from __future__ import annotations

import math
import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .families import gguf_windows

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGMLQuantizationType

FLOAT_TYPES = {"F32", "F16", "BF16"}
# the types the kernels serve without dequantizing (model/gguf_blocks.py): taken as they are into the int4 layout, and
# served in their own blocks (csrc/block_form.h; tests/engine/test_gguf_kernels.py checks every one). Any other type
# is dequantized to float32 at load.
INT4_TYPES = {"Q4_0", "Q4_1", "IQ3_S"}  # (IQ3_S: its odd levels -15..15, its block scale rounded to float16)
BLOCK_TYPES = {"Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q5_0", "Q5_1", "IQ4_NL", "F16", "BF16"}
# held as int4; 5 bits and more as int8
FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ1_S"}
# the i-quants that scale blocks of 16, served in quant.py's int8 layout wherever the kernels take int8 inputs
# (gguf_blocks.int8_weight), else dequantized to float32: each weight a whole number of its super-block's d / 8; a
# block of 32 kept exactly where its numbers fit an int8, else rounded as Q8_0 rounds. (IQ3_S: the int4 layout,
# INT4_TYPES; IQ3_XXS, IQ2_XXS and IQ1_S: blocks of 32 of at most 16 levels, kernels.LEVEL_TYPES.)
IQ_INT8_TYPES = {"IQ2_XS", "IQ2_S", "IQ1_M"}


def mode_of(types: list[str]) -> str:
    """The weight-only mode that keeps tensors of these GGUF types (a fused layer's parts): none for float types,
    int4 when every part has 4 bits or fewer, else int8."""
    if all(t in FLOAT_TYPES for t in types):
        return "none"
    return "int4" if all(t in FOUR_BIT for t in types) else "int8"


# GGUF value types: (struct format, size) of the scalar ones; 8 is a string, 9 an array
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
SMALL_ARRAY = 4096  # arrays up to this many items are read; longer ones (a vocabulary) are stepped over


class GGUFIndex:
    """A GGUF file's metadata and tensors without its vocabulary: the key-value pairs read with struct, arrays of
    more than SMALL_ARRAY items stepped over (their length kept), the tensors as views of one read-only memory map,
    shaped as gguf-py's GGUFReader shapes them. GGUFReader builds Python objects for every vocabulary entry
    (Gemma 3's 262,144: about 0.6 GB, 8 s), which the weights never need; this reads Gemma 3's header in a
    fraction of a second. ``fields`` maps a key to its value (a str, number, list, or ``LongArray``)."""

    def __init__(self, path, small: int = SMALL_ARRAY):
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = Path(path)
        with open(self.path, "rb") as f:  # (the map outlives the descriptor)
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self.map, dtype=np.uint8)  # read-only, as every tensor viewed from it
        buf = self.data.data  # the file's bytes as a memoryview
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (a big-endian file?) is not read here")
        pos = 24
        self.fields: dict = {}
        for _ in range(kv_count):
            key, pos = _string(buf, pos)
            (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.fields[key], pos = _value(buf, pos, kind, small)
        infos = []
        for _ in range(tensor_count):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = (pos + align - 1) // align * align
        floats = {
            "F32": np.float32,
            "F16": np.float16,
            "F64": np.float64,
            "I8": np.int8,
            "I16": np.int16,
            "I32": np.int32,
            "I64": np.int64,
        }
        self.tensors = []
        for name, dims, kind, offset in infos:
            n = math.prod(dims)
            block, size = GGML_QUANT_SIZES[kind]
            shape = tuple(reversed(dims))
            dtype = floats.get(kind.name)
            if dtype is None:
                dtype, count, shape = np.uint8, n * size // block, quant_shape_to_byte_shape(shape, kind)
            else:
                count = n
            at = start + offset
            data = self.data[at : at + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
            self.tensors.append(IndexTensor(name, kind, np.array(dims, dtype=np.uint64), n, n * size // block, data))

    def release_pages(self) -> None:
        """The file's pages read so far leave this process's resident set (they stay in the system's page cache,
        and are read in again where touched)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self.map.madvise(mmap.MADV_DONTNEED)


@dataclass(frozen=True)
class IndexTensor:
    """One tensor of a GGUFIndex, with the attributes of gguf-py's ReaderTensor that the loaders read."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # its dimensions, innermost first (numpy, as gguf-py gives them)
    n_elements: int
    n_bytes: int
    data: np.ndarray  # a numpy view of the memory map


@dataclass(frozen=True)
class LongArray:
    """An array stepped over: its item type and length."""

    kind: int
    length: int


def _string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


def _value(buf, pos: int, kind: int, small: int = SMALL_ARRAY):
    if kind in _SCALARS:
        fmt, size = _SCALARS[kind]
        return struct.unpack_from(fmt, buf, pos)[0], pos + size
    if kind == 8:
        return _string(buf, pos)
    if kind != 9:
        raise ValueError(f"GGUF value type {kind} unknown")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if count > small:  # stepped over: fixed-size items at once, strings by their lengths
        if item in _SCALARS:
            return LongArray(item, count), pos + count * _SCALARS[item][1]
        if item != 8:
            raise ValueError(f"GGUF array of type {item} is not read here")
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return LongArray(item, count), pos
    values = []
    for _ in range(count):
        value, pos = _value(buf, pos, item, small)
        values.append(value)
    return values, pos


def open_gguf(source):
    """A GGUFReader for a path, or the reader given: a first start parses the file (its whole vocabulary: 8 s for
    Gemma's 262k tokens) once, for the tokenizer and the config (the header alone: ``read_header``)."""
    from gguf import GGUFReader

    return source if isinstance(source, GGUFReader) else GGUFReader(str(source))


# a layer's keys carry outlier channels where its key bias has one this many times the bias's median magnitude
# (Qwen2.5-Coder 1.5B: layers 0, 1, 7 and 15 at 516, 170, 128 and 204 times; the other 24 at 11 to 48)
KEY_OUTLIER = 64


def key_outliers(tensors) -> list[int]:
    """The layers whose key bias (``blk.N.attn_k.bias``) has a channel of more than KEY_OUTLIER times the bias's
    median magnitude: their keys lose their other channels in an int8 vector of one scale."""
    import numpy as np

    found = []
    for t in tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2:] == ["attn_k", "bias"] and t.tensor_type.name == "F32":
            b = np.abs(np.asarray(t.data, dtype=np.float32))
            if b.size and b.max() > KEY_OUTLIER * max(float(np.median(b)), 1e-12):
                found.append(int(parts[1]))
    return sorted(found)


def read_header(path) -> dict:
    """The header's summary (architecture, weight types and mode, shape, chat template), by a GGUFIndex: no
    vocabulary parsed (a fraction of a second, where gguf-py's GGUFReader takes seconds)."""
    from ..kernels import LEVEL_TYPES

    index = GGUFIndex(path)

    def field(key: str, default=None):
        value = index.fields.get(key, default)
        return default if isinstance(value, LongArray) else value

    tensors = index.tensors
    arch = field("general.architecture", "")
    kinds = Counter(
        t.tensor_type.name
        for t in tensors
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2
    )
    kind = kinds.most_common(1)[0][0] if kinds else ""
    heads = field(f"{arch}.attention.head_count") or 1
    hidden = field(f"{arch}.embedding_length") or 0
    sizes = {t.name: int(t.n_elements) for t in tensors}
    by_bytes: Counter[str] = Counter()  # the matrices' types, most bytes first
    float_params = 0  # the matrices' weights served as float32 (a type the kernels lack, or F32)
    iq_params = 0  # the matrices' weights of IQ_INT8_TYPES (int8 with the kernels' int8 inputs, else float32)
    served = INT4_TYPES | BLOCK_TYPES | set(LEVEL_TYPES)
    for t in tensors:
        if len(t.shape) == 2:
            by_bytes[t.tensor_type.name] += int(t.n_bytes)
            if t.tensor_type.name in IQ_INT8_TYPES:
                iq_params += int(t.n_elements)
            elif t.tensor_type.name not in served:
                float_params += int(t.n_elements)
    tokens = index.fields.get("tokenizer.ggml.tokens")
    return {
        "arch": arch,
        "vocab": tokens.length if isinstance(tokens, LongArray) else len(tokens or ()),  # (0: none)
        "chat_template": field("tokenizer.chat_template"),
        "quantize": mode_of([kind]) if kind else "none",
        "types": [k for k, _ in by_bytes.most_common()],
        "num_params": sum(sizes.values()),
        "float_params": float_params,
        "iq_params": iq_params,
        "num_layers": field(f"{arch}.block_count"),
        "heads": heads,
        "num_kv_heads": field(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": field(f"{arch}.attention.key_length") or hidden // heads,
        "vocab_params": sizes.get("token_embd.weight", 0),
        "tied": "output.weight" not in sizes,
        "hidden": hidden,
        "key_outliers": key_outliers(tensors),
        "windows": list(
            gguf_windows(
                arch,
                field(f"{arch}.block_count") or 0,
                field(f"{arch}.attention.sliding_window"),
                field(f"{arch}.attention.sliding_window_pattern"),
            )
        ),
    }
