"""Every architecture the compact decoder describes, against llama.cpp on the same GGUF files.

tests/data/gguf holds tiny random models of each family, turned into GGUFs by llama.cpp's own
convert_hf_to_gguf.py and quantized by llama-quantize, with llama.cpp's perplexity and next-token choices on a
fixed text stored beside them (scripts/make_reference_ggufs.py regenerates them; this suite never builds
llama.cpp). Each file is served as the server serves it, in the default mode, straight from the GGUF, and must
give llama-perplexity's perplexity within 1 % and its top-1 token on at least 98 % of the scored positions.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_reference import load_reference
from servers import MODEL_CACHE

from inference_api.config import ServerConfig
from inference_api.engine.process import build_engine
from inference_api.model.families import FAMILIES
from inference_api.model.tokenizer import HFTokenizer

REFERENCE = load_reference()


def serve(path: Path, **flags):
    """The engine the server builds for a GGUF file (the kernels and model folders in the suite's cache)."""
    return build_engine(
        ServerConfig(model=str(path), model_cache_dir=Path(MODEL_CACHE), rows=2, context_length=256, **flags)
    )


def score(engine, ref) -> tuple[float, float]:
    """(perplexity, share of positions whose top-1 token is llama.cpp's) over llama-perplexity's chunks: each
    chunk from position 0 in a fresh row, the second half of it scored, as llama-perplexity scores it."""
    runner = engine.runner
    nll, n, agree = 0.0, 0, 0
    with torch.inference_mode():
        for i, chunk in enumerate(ref.chunks):
            lp = torch.log_softmax(runner.score(i % 2, list(chunk.tokens), 0).float(), dim=-1)
            for pos in chunk.positions():
                nll -= float(lp[pos.position, pos.target])
                agree += int(lp[pos.position].argmax()) == pos.top1
                n += 1
    return math.exp(nll / n), agree / n


def test_the_reference_files_cover_every_described_family():
    archs = {ref.gguf_arch for ref in REFERENCE.values()}
    assert {"llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "falcon"} <= archs
    assert {"gemma3_text" if a == "gemma3" else a for a in archs} >= set(FAMILIES) - {"mistral"}  # mistral: llama's
    assert any("rope" in ref.arch for ref in REFERENCE.values())  # Llama 3's rope scaling
    types = {t for ref in REFERENCE.values() for t in ref.tensor_types}
    assert {"Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS", "IQ4_NL"} <= types
    assert {"IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_S", "IQ2_XS", "IQ1_M"} <= types  # (IQ2_S: IQ3_XXS's file's fallback)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_a_gguf_gives_llama_cpps_perplexity_and_next_tokens(name):
    ref = REFERENCE[name]
    engine, ready = serve(ref.path)
    assert engine.runner.plan.model == "compact", "every family here runs on the compact decoder"
    ppl, agree = score(engine, ref)
    print(
        f"\n{name}: perplexity {ppl:.1f} against llama.cpp's {ref.final_ppl:.1f} "
        f"({(ppl / ref.final_ppl - 1) * 100:+.2f} %), top-1 {agree * 100:.1f} % of llama.cpp's"
    )
    assert abs(ppl / ref.final_ppl - 1) < 0.01
    assert agree >= 0.98


# a file of each architecture (the Decoder's layers differ by family; the linears' block types are the loop's)
ONE_PER_ARCH = sorted({ref.gguf_arch: name for name, ref in sorted(REFERENCE.items(), reverse=True)}.values())


@pytest.mark.parametrize("name", ONE_PER_ARCH)
def test_the_decoders_one_call_takes_a_step_as_the_layer_loop_does(name):
    """A decode step through the kernels' Decoder (csrc/decoder.cpp: every family ModelSpec.fused names, with its
    per-head and output norms, GELU gate, soft-capping, two rotary tables and sliding-window rings) equals forward's
    one layer loop over the same kernels bit for bit: rows 0 and 2 decoding with row 1 idle between them, past the
    wrap of the rings (prefill chunks of 16: rings of window + 16 slots), and the idle row's cache untouched."""
    ref = REFERENCE[name]
    config = ServerConfig(
        model=str(ref.path), model_cache_dir=Path(MODEL_CACHE), rows=3, context_length=256, prefill_chunk=16
    )
    engine, _ = build_engine(config)
    runner, model = engine.runner, engine.runner.model
    if not model.spec.fused:  # falcon's parallel layers, a partial rotary: the loop runs them
        assert model.fused is None and model.spec.family.parallel
        return
    assert model.fused is not None
    tokens = list(ref.chunks[0].tokens)
    cache = runner.cache
    with torch.inference_mode():
        for row, prompt in ((0, tokens[:40]), (1, tokens[40:70]), (2, tokens[70:103])):
            for start in range(0, len(prompt), 16):
                runner.prefill([row], [prompt[start : start + 16]], [start])
        idle = runner.snapshot(1, 30)
        ids, positions = [tokens[40], tokens[103]], [40, 33]
        for _ in range(48):
            fused = runner.decode([0, 2], ids, positions)
            decoder, model.fused = model.fused, None
            try:
                loop = runner.decode([0, 2], ids, positions)
            finally:
                model.fused = decoder
            assert torch.equal(fused, loop), (name, positions)
            ids, positions = fused.argmax(-1).tolist(), [p + 1 for p in positions]
    if any(model.spec.windows):
        assert min(cache.layer_slots) < positions[1] - 16  # the rings wrapped
    assert all(torch.equal(a, b) for a, b in zip(idle, runner.snapshot(1, 30)))


def test_a_type_the_kernels_lack_is_served_dequantized_with_a_warning(monkeypatch, caplog):
    """A tensor type outside the kernels' list is never rounded again nor silently served wrong: its layers are
    served as float32 from gguf-py's dequantization, the start-up log names the tensors and the type, and the
    answers stay llama.cpp's (here Q6_K taken off the list, on the Q6_K file)."""
    from inference_api.model import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "BLOCK_TYPES", gguf_blocks.BLOCK_TYPES - {"Q6_K"})
    ref = REFERENCE["llama-q6_k.gguf"]
    with caplog.at_level("WARNING"):
        engine, _ = serve(ref.path)
    assert any("Q6_K" in r.getMessage() and "dequantized" in r.getMessage() for r in caplog.records)
    ppl, agree = score(engine, ref)
    assert abs(ppl / ref.final_ppl - 1) < 0.01 and agree >= 0.98


def test_the_file_decides_bos_and_the_tokenizer_splits_as_llama_cpp():
    """The tiny models' vocabularies add BOS (their GGUFs say so): the text encodes as llama-perplexity
    tokenized it, BOS first."""
    ref = REFERENCE["llama-q4_k_m.gguf"]
    _, ready = serve(ref.path)
    text = Path(__file__).with_name("data").joinpath("english.txt").read_text()
    ids = HFTokenizer(ready.model_dir).encode(text)  # (the app's tokenizer, of the folder the engine names)
    assert ref.add_bos and ids[0] == ref.bos_token_id
    assert ids[: ref.n_ctx] == list(ref.chunks[0].tokens)


@pytest.mark.parametrize(
    "kind",
    [
        *("Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS", "IQ4_NL"),
        *("IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "IQ1_M"),
    ],
)
def test_a_ggufs_own_blocks_are_taken_as_gguf_py_dequantizes_them(kind):
    """The tensors of llama-quantize's files are served in their own blocks without rounding a weight again:
    equal to gguf-py's dequantization, through gguf-py's and through the kernels' own dequantization. The
    i-quants (IQ_INT8_TYPES) in the int8 layout where the kernels take int8 inputs (INT8_LAYOUT), not float32, and
    IQ3_S in the int4 layout:
    those that scale blocks of 16 (IQ_INT8_TYPES) exactly where a block's numbers fit an int8, else rounded once
    (each weight at most 1/254 of its block's largest off)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from servers import MODEL_CACHE

    from inference_api.engine.plan import INT8_LAYOUT
    from inference_api.kernels import load_kernels
    from inference_api.kernels.quant import LEVEL_TYPES, Int8Weight
    from inference_api.model.gguf_blocks import packed
    from inference_api.model.gguf_meta import IQ_INT8_TYPES

    files = [ref.path for ref in REFERENCE.values() if kind in ref.tensor_types]
    tensor = next(
        t for f in files for t in GGUFReader(str(f)).tensors if t.tensor_type.name == kind and len(t.shape) == 2
    )
    want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).reshape(int(tensor.shape[1]), -1)
    if kind in LEVEL_TYPES:  # IQ4_NL's bytes over the type's levels, the scale in float16 (within 2^-11)
        got = packed(tensor).dequantize()
        assert torch.equal(packed(tensor).dequantize(load_kernels(Path(MODEL_CACHE))), got)
        assert ((got - want).abs() <= want.abs() / 2048 + 1e-12).all()
        return
    if kind == "IQ3_S":  # the int4 layout: d = 2 b and m = -15 b in float16 (each weight within 45 / 2048 b)
        from inference_api.model.gguf_blocks import _iq_scales

        b = torch.from_numpy(_iq_scales(kind, np.asarray(tensor.data).view(np.uint8).reshape(want.shape[0], -1)))
        blocks, got = want.view(want.shape[0], -1, 32), packed(tensor).dequantize().view(want.shape[0], -1, 32)
        assert ((got - blocks).abs().amax(-1) <= b * 45 / 2048).all()
        return
    if kind in IQ_INT8_TYPES:
        assert packed(tensor) is None  # (without the int8 inputs: float32)
        assert isinstance(packed(tensor, INT8_LAYOUT), Int8Weight)
        got = packed(tensor, INT8_LAYOUT).dequantize()
        blocks, got = want.view(want.shape[0], -1, 32), got.view(want.shape[0], -1, 32)
        assert ((got - blocks).abs().amax(-1) <= blocks.abs().amax(-1) / 254 * 1.0001).all()
        assert (got == blocks).all(-1).any()
        return
    assert torch.equal(packed(tensor).dequantize(), want)
    assert torch.equal(packed(tensor).dequantize(load_kernels(Path(MODEL_CACHE))), want)


def test_the_embedded_model_tokenizes_as_llama_server_does(hf_tokenizer):
    """The strings llama-server tokenized on the embedded GGUF (special tokens parsed, no BOS: the file says
    none) encode to the same ids here."""
    from gguf_reference import load_server_reference

    ref = load_server_reference("smollm2")
    assert ref.tokenize
    for case in ref.tokenize:
        assert hf_tokenizer.encode(case["text"]) == list(case["tokens"]), case["text"]


@pytest.mark.parametrize("name", sorted(n for n, ref in REFERENCE.items() if ref.tokenize))
def test_an_spm_vocabulary_tokenizes_as_llama_cpp(name):
    """SentencePiece vocabularies (Llama 2's and Gemma's kind: tokenizer.ggml.model "llama") against
    llama-server's /tokenize on the same file: spaces, digits, byte fallback, non-ASCII text, control and
    user-defined symbols inside text, with and without BOS."""
    ref = REFERENCE[name]
    _, ready = serve(ref.path)
    tokenizer = HFTokenizer(ready.model_dir)
    cases = list(ref.tokenize_cases(parse_special=True))
    assert len(cases) > 40
    for case in cases:
        got = tokenizer.encode(case["text"], add_special_tokens=case["add_special"])
        assert got == list(case["tokens"]), (case["text"], case["add_special"])


def family_branches(source: str) -> list[str]:
    """The comparisons in a module's source against a family's name (transformers' or llama.cpp's): ``arch ==
    "gemma2"``, ``arch in ("gemma", "gemma3")``: knowledge of a family outside its table entry."""
    import ast

    names = set(FAMILIES) | {f.gguf for f in FAMILIES.values() if f.gguf}

    def about_a_model(side) -> bool:  # arch, m.arch, config.model_type, name... (not a vocabulary's type)
        label = side.id if isinstance(side, ast.Name) else side.attr if isinstance(side, ast.Attribute) else ""
        return any(word in label for word in ("arch", "model_type", "family", "name"))

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare) or not any(map(about_a_model, (node.left, *node.comparators))):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            hits = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
            if hits:
                found.append(f"line {node.lineno}: {', '.join(hits)}")
    return found


def test_a_family_is_described_in_its_table_entry_only():
    root = Path(__file__).resolve().parents[1]
    table = root / "inference_api" / "model" / "families.py"
    readers = [p for p in (root / "inference_api").rglob("*.py") if p != table]
    readers.append(root / "scripts" / "make_reference_ggufs.py")
    branches = {str(p.relative_to(root)): b for p in readers if (b := family_branches(p.read_text()))}
    assert branches == {}
    assert family_branches('if arch == "gemma2" or m.arch in ("qwen3", "x") or vocab.model == "llama":\n    pass') == [
        "line 1: gemma2",
        "line 1: qwen3",
    ]


def test_the_gguf_names_lead_to_their_families():
    from inference_api.model.families import GGUF_FAMILIES, gguf_windows, model_type

    assert model_type("gemma3") == "gemma3_text" and model_type("llama") == "llama"
    assert model_type("bert") == "bert"  # not a family: the name itself
    assert all(GGUF_FAMILIES[f.gguf] is f for f in FAMILIES.values() if f.gguf)
    # llama.cpp's built-in patterns where the file has no per-layer key, and the file's key over them
    assert gguf_windows("gemma3", 6, 16) == (16, 16, 16, 16, 16, None)
    assert gguf_windows("gemma2", 3, 16) == (16, None, 16)
    assert gguf_windows("gemma2", 3, 16, pattern=0) == (16, 16, 16)
    assert gguf_windows("llama", 2, 16) == (None, None)
