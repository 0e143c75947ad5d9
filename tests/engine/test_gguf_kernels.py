"""Every GGUF tensor type the kernels serve in its own blocks, against gguf-py's dequantization of the same bytes.

The blocks are random bytes with sane float16 scales (any bit pattern of the codes is a valid block), so every
code, scale and minimum value is reached. Each type is checked through the float kernels (the exact mode: float32
F.linear on gguf-py's weights, up to summation order) and the int8-input kernels (blocks of 32: the codes multiply
the inputs rounded to int8 blocks of 32, the minimums the exact inputs; the k-quants: the whole weight multiplies
the inputs rounded to int8 blocks of 256, llama.cpp's Q8_K), for one row (the memory-bound decode of one stream)
and for several (groups of 4 input rows, tiles, sgemm), on the ISA this machine builds (AVX-512 with VNNI here,
or AVX2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# per type: where its float16 scales lie in a block
LAYOUT = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.IQ4_NL: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_XS: [0],
}
FLOATS = (T.F16, T.BF16)
TYPES = [*LAYOUT, *FLOATS]
# the i-quants served in IQ4_NL's bytes over levels of their own (kernels.LEVEL_TYPES): their super-block's float16
# scale first
IQ_LEVELS = {T.IQ2_XXS: [0], T.IQ3_XXS: [0], T.IQ1_S: [0]}
# the i-quants served in the int8 layout alone, which scale blocks of 16 (gguf_meta.IQ_INT8_TYPES; IQ1_M's float16
# d: the top 4 bits of its 4 words of scales at 48, set by _raw)
IQ_INT8_16 = {T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ1_M: []}


def _raw(t: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if t in FLOATS:
        w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
        return (w.half() if t == T.F16 else w.bfloat16()).view(torch.uint8).numpy().reshape(n, -1)
    size, block = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(n, k // size, block), dtype=np.uint8)
    # scales in [0.001, 0.021); Q4_1 and Q5_1's minimums negative
    for i, at in enumerate({**LAYOUT, **IQ_LEVELS, **IQ_INT8_16, T.IQ3_S: [0]}[t]):
        scale = (rng.random(raw.shape[:2]) * 0.02 + 0.001) * (-1 if i == 1 and t in (T.Q4_1, T.Q5_1) else 1)
        raw[..., at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if t == T.IQ1_M:
        d = (rng.random(raw.shape[:2]) * 0.02 + 0.001).astype(np.float16).view(np.uint16)
        words = raw[..., 48:56].copy().view(np.uint16)
        for i in range(4):
            words[..., i] = (words[..., i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        raw[..., 48:56] = words.view(np.uint8)
    return raw.reshape(n, -1)


def _weights(t: T, raw: np.ndarray, k: int) -> torch.Tensor:
    """gguf-py's float32 weights of the blocks."""
    return torch.from_numpy(np.asarray(dequantize(raw, t), dtype=np.float32).reshape(raw.shape[0], k))


KQUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)


def _int8_blocks(x: torch.Tensor, size: int = 32) -> torch.Tensor:
    blocks = x.view(*x.shape[:-1], -1, size)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(step > 0, step, 1)) * step).view(x.shape)


def test_the_compute_probe_counts_work_a_core_can_do(kernels):
    """bench.py's int8 compute ceiling (int8_peak): work that really runs, and no more than a core can issue (an
    x86 core's int8 products top out near 2 vpdpbusd of 64 a cycle at 5 GHz: 640 G a second; the AVX2 loop with
    its 12 equal products folded into one measured 700 to 1,400 G)."""
    per_core = [kernels.int8_peak(1 << 20) / torch.get_num_threads() for _ in range(3)]
    assert all(1e9 < rate < 640e9 for rate in per_core), per_core
    assert 1e9 < kernels.int8_peak(1 << 21) / torch.get_num_threads() < 640e9


def test_the_kernels_serve_every_common_type(kernels):
    assert {int(t) for t in TYPES} <= set(kernels.gguf_types())


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_as_gguf_py_does(kernels, t):
    raw = _raw(t, 8, 768)  # three super-blocks of 256
    w = _weights(t, raw, 768)
    torch.testing.assert_close(kernels.dequantize_gguf(torch.from_numpy(raw), int(t)), w, rtol=1e-6, atol=1e-7)


# 70 weight rows: not a multiple of the passes' 4 or 2 rows, nor of the tiles' 12 or 6; 512 inputs: two
# super-blocks, three passes of the tiles (192, 192, 128); rows: groups of 4 and every remainder, tiles from 8 (AVX2)
# or 16 (AVX-512), a prefill
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 33])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_linear_on_blocks_is_float32_linear_on_gguf_py_weights(kernels, t, rows):
    raw = _raw(t, 70, 512, seed=rows)
    w = _weights(t, raw, 512)
    torch.manual_seed(rows)
    x, b = torch.randn(rows, 512), torch.randn(70)
    raw_t = torch.from_numpy(raw)
    scale = w.abs().max().item()
    torch.testing.assert_close(
        kernels.linear_gguf(x, raw_t, int(t), b, False), F.linear(x, w, b), rtol=1e-5, atol=1e-5 * scale * 512**0.5
    )
    got = kernels.linear_gguf(x, raw_t, int(t), b, True)
    if t in FLOATS:  # no integer codes: the float kernels whatever the inputs
        want = F.linear(x, w, b)
    else:  # the whole weight (its minimums too) against the inputs rounded to int8 blocks of 32 (llama.cpp's Q8_0
        # and Q8_1), or of 256 for the k-quants (its Q8_K)
        want = F.linear(_int8_blocks(x, 256 if t in KQUANTS else 32), w, b)
        assert not torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * scale * 512**0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale * 512**0.5)


def test_an_unserved_type_is_refused_by_name(kernels):
    with pytest.raises(RuntimeError, match="not served"):
        kernels.linear_gguf(torch.randn(1, 256), torch.zeros(4, 144, dtype=torch.uint8), int(T.IQ2_XXS), None, False)


@pytest.mark.parametrize("t", list(LAYOUT), ids=lambda t: t.name)
def test_a_rows_numbers_do_not_depend_on_the_rows_beside_it(kernels, t):
    """With int8 inputs every row count runs one kernel (the VNNI tiles, or without VNNI the groups of 4 rows):
    a row's outputs are bit for bit the same alone, in a decode step of 32 rows, or in a prefill of 70."""
    raw = torch.from_numpy(_raw(t, 40, 512, seed=3))  # 40 rows: two groups of 16 and a part group
    torch.manual_seed(3)
    x = torch.randn(70, 512)
    batch = kernels.linear_gguf(x, raw, int(t), None, True)
    for rows in (x[:32], x[5:6]):
        part = kernels.linear_gguf(rows, raw, int(t), None, True)
        start = 0 if rows.shape[0] == 32 else 5
        assert torch.equal(part, batch[start : start + rows.shape[0]])


@pytest.mark.parametrize("t", list(LAYOUT), ids=lambda t: t.name)
def test_blocks_packed_at_load_give_the_unpacked_numbers(kernels, t):
    """At both levels the k-quants and IQ4_XS are packed once at load (pack_k8: nibbles or pairs of bits and high
    bits in the tiles' order, Q2_K's scale bytes as the file's, IQ4_XS's nibbles as indices of its levels) and every
    row count reads only the packing: with VNNI each tile of up to 8 rows unpacks each vector of 16 weight rows, with
    AVX2 each tile of up to 4 rows each half vector of 8. Either way a row's numbers are those of the blocks as the
    file holds them (the unpacked blocks' tiles with VNNI, the row kernels with AVX2), to the bit (and so the same
    whatever the batch). Q5_0, Q5_1 and IQ4_NL are packed too (B32Pack): with VNNI the tiles' numbers of the blocks
    packed per call, to the bit; at the AVX2 level the row kernels' sums in another order, each row's numbers the same
    alone as in any batch. Other types are not packed."""
    raw = torch.from_numpy(_raw(t, 40, 512, seed=5))  # two groups of 16 and a part group
    packed = kernels.pack_k8(raw, int(t))
    torch.manual_seed(5)
    x, b = torch.randn(70, 512), torch.randn(40)
    if t in (T.Q5_0, T.Q5_1, T.IQ4_NL):
        assert packed.shape[0] == 3 and packed.shape[1] == 16 * {T.Q5_0: 22, T.Q5_1: 24, T.IQ4_NL: 18}[t] * 512 // 32
        for rows in (1, 3, 5, 9, 70):
            got = kernels.linear_gguf(x[:rows], raw, int(t), b, True, packed)
            want = kernels.linear_gguf(x[:rows], raw, int(t), b, True)
            if kernels.vnni():
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            assert torch.equal(kernels.linear_gguf(x[rows - 1 : rows], raw, int(t), b, True, packed), got[-1:])
        return
    if t not in KQUANTS:
        assert packed.numel() == 0
        return
    assert packed.shape[0] == 3
    per_row = {T.Q2_K: 84, T.Q3_K: 114, T.Q4_K: 148, T.Q5_K: 180, T.Q6_K: 210, T.IQ4_XS: 138}[t]
    assert packed.shape[1] == 2 * 16 * per_row  # a group's two super-blocks
    for rows in (1, 2, 3, 5, 9, 24, 25, 70):
        want = kernels.linear_gguf(x[:rows], raw, int(t), b, True)
        assert torch.equal(kernels.linear_gguf(x[:rows], raw, int(t), b, True, packed), want)
    with pytest.raises(RuntimeError, match="packed wrongly"):
        kernels.linear_gguf(x[:1], raw[:32], int(t), b[:32], True, packed)


@pytest.mark.parametrize("t", [T.Q8_0, T.Q5_0, T.IQ4_NL], ids=lambda t: t.name)
def test_a_symmetric_block_type_maps_onto_the_int8_layout_exactly(kernels, t, monkeypatch):
    """ExecutionPlan.int8_layout: a Q8_0, Q5_0 or IQ4_NL tensor as an Int8Weight
    (groups of 32) holds the same numbers as its blocks (every code and scale reached: random blocks), and its
    linear with int8 inputs is the weight against the inputs rounded to int8 blocks of 32, for one row and several,
    the one row's numbers the same alone or beside others (the tiles where the CPU has VNNI: the unpacked codes are
    let go)."""
    from types import SimpleNamespace

    from inference_api.kernels.quant import QuantLinear
    from inference_api.model import gguf_blocks
    from inference_api.model.gguf_blocks import int8_weight

    n, k = 48, 256
    raw = _raw(t, n, k, seed=3)
    w = int8_weight(SimpleNamespace(shape=(k, n), data=raw, tensor_type=t))
    expected = torch.from_numpy(dequantize(raw, t).reshape(n, k))
    assert torch.equal(w.dequantize(), expected)
    monkeypatch.setattr(gguf_blocks, "DEQUANTIZE_WEIGHTS", 5 * k)  # a few rows at a time: the same codes
    assert torch.equal(int8_weight(SimpleNamespace(shape=(k, n), data=raw, tensor_type=t)).q, w.q)
    layer = QuantLinear(w, None, kernels, int8_inputs=True)
    x = torch.randn(5, k)
    several = layer(x)
    scale = expected.abs().max().item()
    torch.testing.assert_close(several, F.linear(_int8_blocks(x), expected), rtol=1e-5, atol=1e-5 * scale * k**0.5)
    assert torch.equal(layer(x[2:3]), several[2:3])


@pytest.mark.parametrize("t", list(IQ_LEVELS), ids=lambda t: t.name)
def test_an_i_quant_of_few_levels_runs_in_iq4_nls_bytes_over_its_own(kernels, t, monkeypatch):
    """IQ3_XXS, IQ2_XXS and IQ1_S (random blocks: every grid value, sign and scale) in IQ4_NL's nibbles over their
    type's levels (kernels.LEVEL_TYPES, the kernels' own: gguf_legacy.h) and a float32 scale b a block: each
    nibble's level times b is gguf-py's weight exactly; the kernels' dequantization and numpy's agree; the linear,
    with int8 inputs (the tiles at every row count, packed at load or not) or not, is that weight's."""
    from types import SimpleNamespace

    from inference_api.kernels import LEVEL_BLOCK
    from inference_api.kernels.quant import LEVEL_TYPES, BlockWeight
    from inference_api.model import gguf_blocks
    from inference_api.model.gguf_blocks import packed

    n, k = 70, 512
    raw = _raw(t, n, k, seed=6)
    tensor = SimpleNamespace(shape=(k, n), data=raw, tensor_type=t)
    w = packed(tensor)
    assert isinstance(w, BlockWeight) and w.ggml_type == LEVEL_TYPES[t.name][0] and w.type_name == t.name
    want = torch.from_numpy(dequantize(raw, t).reshape(n, k))
    got = w.dequantize()
    assert torch.equal(w.dequantize(kernels), got)
    assert torch.equal(got, want)
    levels = torch.tensor(LEVEL_TYPES[t.name][1], dtype=torch.float32)
    blocks = w.raw.view(n, -1, LEVEL_BLOCK)
    idx = torch.cat([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], dim=-1).long()
    b = torch.from_numpy(gguf_blocks._iq_scales(t.name, raw))
    assert torch.equal(blocks[..., :4].contiguous().view(torch.float32)[..., 0], b)
    assert torch.equal(levels[idx] * b[..., None], want.view(n, -1, 32))  # the codes exact
    monkeypatch.setattr(gguf_blocks, "DEQUANTIZE_WEIGHTS", 5 * k)  # a few rows at a time: the same bytes
    assert torch.equal(packed(tensor).raw, w.raw)
    torch.manual_seed(6)
    x, bias = torch.randn(33, k), torch.randn(n)
    scale = want.abs().max().item()
    packing = kernels.pack_k8(w.raw, w.ggml_type)
    assert packing.numel()  # packed at load for the tiles, as IQ4_NL
    for rows in (1, 2, 3, 5, 16, 33):
        plain = kernels.linear_gguf(x[:rows], w.raw, w.ggml_type, bias, False)
        torch.testing.assert_close(plain, F.linear(x[:rows], got, bias), rtol=1e-5, atol=1e-5 * scale * k**0.5)
        rounded = F.linear(_int8_blocks(x[:rows]), got, bias)
        for tiles in (None, packing):
            y = kernels.linear_gguf(x[:rows], w.raw, w.ggml_type, bias, True, tiles)
            torch.testing.assert_close(y, rounded, rtol=1e-5, atol=1e-5 * scale * k**0.5)


def test_iq3_s_maps_onto_the_int4_layout(kernels, monkeypatch):
    """IQ3_S (random blocks: every grid value, sign and scale) as an Int4Weight: each block's odd levels -15..15 as
    nibbles (exact: a level times the block's scale b is gguf-py's weight), d = 2 b and m = -15 b in float16, so
    each weight is gguf-py's within 45 / 2048 b (d and m each rounded by 2^-11 at most: 1 % of the step 2 b between
    two levels); its linear, with int8 inputs or not, is that weight's (the int4 tiles)."""
    from types import SimpleNamespace

    from inference_api.kernels.quant import Int4Weight, QuantLinear
    from inference_api.model import gguf_blocks
    from inference_api.model.gguf_blocks import packed

    n, k = 48, 512
    raw = _raw(T.IQ3_S, n, k, seed=5)
    tensor = SimpleNamespace(shape=(k, n), data=raw, tensor_type=T.IQ3_S)
    w = packed(tensor)
    assert isinstance(w, Int4Weight)
    want = torch.from_numpy(dequantize(raw, T.IQ3_S).reshape(n, k)).view(n, -1, 32)
    got = w.dequantize().view(n, -1, 32)
    top = want.abs().amax(-1)
    b = torch.from_numpy(gguf_blocks._iq_scales("IQ3_S", raw))
    assert ((got - want).abs().amax(-1) <= b * 45 / 2048).all()  # d's and m's float16 rounding: 2^-11 of each
    q = w.q.view(n, -1, 16)
    levels = 2 * torch.cat([q & 15, q >> 4], dim=-1).float() - 15  # the codes exact: level x b is gguf-py's weight
    assert torch.equal(levels * b[..., None], want)
    monkeypatch.setattr(gguf_blocks, "DEQUANTIZE_WEIGHTS", 5 * k)  # a few rows at a time: the same nibbles
    assert torch.equal(packed(tensor).q, w.q)
    x = torch.randn(5, k)
    scale = top.max().item()
    for int8_inputs in (False, True):
        layer = QuantLinear(w, None, kernels, int8_inputs=int8_inputs)
        inputs = _int8_blocks(x) if int8_inputs else x
        torch.testing.assert_close(layer(x), F.linear(inputs, got.reshape(n, k)), rtol=1e-5, atol=1e-5 * scale * k**0.5)


@pytest.mark.parametrize("t", list(IQ_INT8_16), ids=lambda t: t.name)
def test_an_i_quant_that_scales_blocks_of_16_maps_onto_the_int8_layout(kernels, t, monkeypatch):
    """IQ2_XS, IQ2_S and IQ1_M (random blocks: every code and scale) as an Int8Weight of groups of 32: a block whose
    whole numbers of d / 8 fit an int8 holds gguf-py's numbers exactly (most of IQ1_M's, some of the others': where the
    two halves' scales share a divisor), another is rounded once as Q8_0 rounds, each weight at most 1/254 of the
    block's largest off; the linear with int8 inputs is that weight against the inputs rounded to int8 blocks."""
    from types import SimpleNamespace

    from inference_api.kernels.quant import QuantLinear
    from inference_api.model import gguf_blocks
    from inference_api.model.gguf_blocks import int8_weight

    n, k = 48, 512
    raw = _raw(t, n, k, seed=4)
    w = int8_weight(SimpleNamespace(shape=(k, n), data=raw, tensor_type=t))
    want = torch.from_numpy(dequantize(raw, t).reshape(n, k)).view(n, -1, 32)
    got = w.dequantize().view(n, -1, 32)
    top = want.abs().amax(-1)
    assert ((got - want).abs().amax(-1) <= top / 254 * 1.0001).all()
    exact = (got == want).all(-1).float().mean().item()
    assert exact > (0.75 if t == T.IQ1_M else 0.03), exact  # (random 4-bit scales: 1/16 of IQ2's halves equal)
    assert exact < 1
    monkeypatch.setattr(gguf_blocks, "DEQUANTIZE_WEIGHTS", 5 * k)  # a few rows at a time: the same codes and scales
    again = int8_weight(SimpleNamespace(shape=(k, n), data=raw, tensor_type=t))
    assert torch.equal(again.q, w.q) and torch.equal(again.dequantize(), w.dequantize())
    layer = QuantLinear(w, None, kernels, int8_inputs=True)
    x = torch.randn(5, k)
    scale = top.max().item()
    torch.testing.assert_close(
        layer(x), F.linear(_int8_blocks(x), got.reshape(n, k)), rtol=1e-5, atol=1e-5 * scale * k**0.5
    )


@pytest.mark.parametrize("name", ["llama-iq3_s", "llama-q4_k_m"])
def test_an_untied_token_embedding_stays_in_the_mapped_file(kernels, name):
    """An untied file's token embedding is left in the file's read-only map (gguf_blocks.file_rows: no copy of the
    table beside the weights, of a type the kernels serve (Q4_K) or not (IQ3_S)); its rows, looked up by a batch of
    ids of any shape, are gguf-py's weights exactly; a tied file's embedding is the head's blocks as before."""
    from pathlib import Path

    from inference_api.kernels.quant import FileRows
    from inference_api.model.gguf_model import GGUFModel

    m = GGUFModel(Path(__file__).parents[1] / "data" / "gguf" / f"{name}.gguf")
    t = m.tensors["token_embd.weight"]
    rows = m.weights().embed()
    assert isinstance(rows, FileRows) and np.shares_memory(rows.raw, m.reader.data)
    assert rows.served == (t.tensor_type == T.Q4_K)
    n, k = int(t.shape[1]), int(t.shape[0])
    want = torch.from_numpy(np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32).reshape(n, k))
    ids = torch.tensor([[3, 0, n - 1], [7, 7, 1]])
    assert torch.equal(rows.rows(ids, kernels), want[ids])
    assert torch.equal(rows.dequantize(kernels), want)
    tied = GGUFModel(Path(__file__).parents[1] / "data" / "gguf" / "qwen2-q4_k_m.gguf")
    assert not isinstance(tied.weights().embed(), FileRows)


def test_a_tied_embeddings_lookups_read_the_file_and_the_heads_codes_go():
    """A tied file on the CPU: the engine's lookups are the file's rows exactly, and the head (this file's Q6_K
    table in its own blocks) keeps no codes beside its packing for them: their place is pages nothing wrote."""
    from gguf_reference import GGUF_DIR
    from servers import MODEL_CACHE

    from inference_api.config import ServerConfig
    from inference_api.engine.model_runner import load_runner
    from inference_api.engine.plan import make_plan, model_facts, probe_machine
    from inference_api.kernels import load_kernels
    from inference_api.model.gguf_meta import GGUFIndex
    from inference_api.model.loader import gguf_source, gguf_target, resolve_model_dir

    path = GGUF_DIR / "qwen2-q4_k_m.gguf"
    config = ServerConfig.from_args(["--model", str(path), "--model-cache-dir", MODEL_CACHE, "--rows", "2"], {})
    gguf = gguf_source(config)
    plan = make_plan(config, model_facts(gguf, gguf_target(config, gguf)), probe_machine("cpu"))
    assert plan.quantize != "none" and plan.model == "compact"
    kernels = load_kernels(config.model_cache_dir, level=plan.cpu_level)
    runner = load_runner(config, plan, kernels, gguf, resolve_model_dir(config, weights=False))
    t = next(t for t in GGUFIndex(path).tensors if t.name == "token_embd.weight")
    assert t.tensor_type == T.Q6_K and "output.weight" not in {t.name for t in GGUFIndex(path).tensors}
    n, k = int(t.shape[1]), int(t.shape[0])
    want = torch.from_numpy(np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32).reshape(n, k))
    ids = torch.tensor([0, 5, n - 1])
    assert torch.equal(runner.model.embed(ids), want[ids])
    head = runner.model.head
    assert head.vnni[0] is not None and head.vnni[0].count_nonzero() > 0  # the tiles' packing
    assert head.weight.raw.shape == (n, t.data.shape[-1]) and head.weight.raw.count_nonzero() == 0
