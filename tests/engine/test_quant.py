"""The quantized CPU kernels and the decode-step kernels against plain torch on the same numbers."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from servers import MODEL_CACHE

from inference_api.engine.kv_cache import quantize_heads
from inference_api.kernels import load_kernels
from inference_api.kernels.quant import Int4Weight, QuantLinear, quantize_int4, quantize_int8
from inference_api.model.compact import apply_rope


def test_the_kernels_load_again_from_another_path_in_one_process(kernels):
    """The offline API and the tests may name the model cache relatively and absolutely in one process; the
    second import must not fail on the class the first one registered (it would serve dequantized weights), and
    must load the same build instead of compiling another version over its objects."""
    level = None if kernels.build == "native" else kernels.build.split()[-1]
    built = {p.name: p.stat().st_mtime_ns for p in Path(kernels.__file__).parent.iterdir() if p.is_file()}
    again = load_kernels(Path(os.path.relpath(MODEL_CACHE)), level=level)
    assert again is not None and hasattr(again, "Decoder") and hasattr(kernels, "Decoder")
    assert again.__name__ == kernels.__name__  # no "_v1": torch's versioner saw the same build
    assert {p.name: p.stat().st_mtime_ns for p in Path(again.__file__).parent.iterdir() if p.is_file()} == built


def _weight(n: int, k: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n, k) * 0.05


def _packed(form: str, n: int, k: int):
    """The seeded n x k weight in one of the kernels' forms."""
    w = _weight(n, k)
    return {
        "int8-channel": lambda: quantize_int8(w),
        "int8-group32": lambda: quantize_int8(w, 32),
        # scales that are float16 values, as a GGUF's Q8_0 blocks give them (the VNNI packing keeps them so)
        "int8-half32": lambda: dataclasses.replace(p := quantize_int8(w, 32), s=p.s.half().float()),
        "int4": lambda: quantize_int4(w),
    }[form]()


# 70 x 96: not a multiple of the one-row kernel's 4-row passes nor of the tiles' 12 or 6 weight rows;
# 200 x 416: several chunks of weight rows and three passes over the inputs (192, 192, 32) in the tiles
@pytest.mark.parametrize("shape", [(70, 96), (200, 416)])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 17, 33, 70])  # from 8 rows, tiles of 16 and 8 input rows
@pytest.mark.parametrize("form", ["int8-channel", "int8-group32", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_is_float32_linear_on_the_dequantized_weight(kernels, shape, rows, form, bias):
    n, k = shape
    packed = _packed(form, n, k)
    b = torch.randn(n) if bias else None
    x = torch.randn(rows, k)
    if isinstance(packed, Int4Weight):
        y = kernels.linear_int4(x, packed.q, packed.d, packed.m, b)
    else:
        y = kernels.linear_int8(x, packed.q, packed.s, b)
    torch.testing.assert_close(y, F.linear(x, packed.dequantize(), b), rtol=1e-5, atol=1e-5)


def _int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded per block of 32 to 127 steps of the block's own scale, as the kernels round one row."""
    blocks = x.view(*x.shape[:-1], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(step > 0, step, 1)) * step).view(x.shape)


AVX2 = "avx2" in Path("/proc/cpuinfo").read_text()


def _int8_input_case(form: str, n: int, k: int, rows: int):
    return _packed(form, n, k), torch.randn(n), torch.randn(rows, k)


def _rounded_linear(packed, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """F.linear on the inputs rounded to int8 blocks, the whole weight (an int4 block's minimum too) times the
    rounded inputs, as llama.cpp's Q8_1 activations give it."""
    return F.linear(_int8_blocks(x), packed.dequantize(), b)


@pytest.mark.skipif(not AVX2, reason="the int8-input kernels need AVX2; elsewhere the inputs stay float32")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])  # groups of 4 input rows and every remainder
@pytest.mark.parametrize("form", ["int8-channel", "int8-group32", "int4"])
def test_few_rows_with_int8_inputs_are_linear_on_the_rounded_inputs(kernels, form, rows):
    packed, b, x = _int8_input_case(form, 70, 128, rows)
    if isinstance(packed, Int4Weight):
        y = kernels.linear_int4(x, packed.q, packed.d, packed.m, b, True)
    else:
        y = kernels.linear_int8(x, packed.q, packed.s, b, True)
    torch.testing.assert_close(y, _rounded_linear(packed, b, x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y, F.linear(x, packed.dequantize(), b), rtol=1e-5, atol=1e-5)


# 96 x 416: six groups of 16 weight rows, 13 blocks; rows: tiles of 8 input rows and every remainder, a prefill
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 33, 70])
@pytest.mark.parametrize("form", ["int8-channel", "int8-group32", "int8-half32", "int4"])
def test_vnni_tiles_are_linear_on_the_rounded_inputs(kernels, form, rows):
    """The weights packed once (quant.vnni_int4, vnni_int8), every row count through the integer tiles, with the
    same rounding of the inputs as the few-row kernels: AVX512-VNNI, and AVX2 over the same packing (avx2_i8_tile,
    avx2_i4_tile), one row's numbers the same alone as in the batch."""
    packed, b, x = _int8_input_case(form, 96, 416, rows)
    layer = QuantLinear(packed, b, kernels, int8_inputs=True)
    assert layer.vnni[0] is not None  # packed for the tiles
    half = form in ("int8-half32", "int4")  # (the 8-bit form's scales as float16 only where that is exact)
    assert layer.vnni[1] is not None and layer.vnni[1].dtype == (torch.float16 if half else torch.float32)
    y = layer(x)
    torch.testing.assert_close(y, _rounded_linear(packed, b, x), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x[-1:]), y[-1:])  # the last row (of a part tile) alone, to the bit
    with pytest.raises(RuntimeError, match="VNNI weights packed wrongly"):  # the layout is checked, not trusted
        linear = kernels.linear_int4 if isinstance(packed, Int4Weight) else kernels.linear_int8
        args = (packed.q, packed.d, packed.m) if isinstance(packed, Int4Weight) else (packed.q, packed.s)
        linear(x, *args, b, True, layer.vnni[0], layer.vnni[1].flatten()[:-16].clone())  # a group short


def test_quantization_error_is_small_and_int4_keeps_q4_1_blocks():
    w = _weight(64, 128)
    assert (quantize_int8(w).dequantize() - w).abs().max() <= w.abs().max() / 127
    blocks = quantize_int4(w)
    again = quantize_int4(blocks.dequantize())  # a weight that came from 4-bit blocks keeps its nibbles
    assert torch.equal(again.q, blocks.q)
    torch.testing.assert_close(again.dequantize(), blocks.dequantize(), rtol=0, atol=1e-6)


def _cache_form(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(stored values, scales or None, what they read back as) of x in a cache of this dtype."""
    if dtype != torch.int8:
        return x.to(dtype), None, x.to(dtype).float()
    q, s = quantize_heads(x)
    return q, s, q.float() * s.float()[..., None]


# (kv heads, query heads, head dim): groups of 3; and of 7 (the value pass's six weight rows and one more) on a
# head of 24 (AVX2's two vectors and one more); heads of 64 and 128 floats, which the scores hold in registers
# (AVX-512: 4 and 8 vectors, AVX2: 8) and whose values AVX-512 reads four vectors at a time
HEADS = [(2, 6, 16), (1, 7, 24), (2, 6, 64), (1, 4, 128)]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_decode_attention_equals_sdpa_over_each_rows_length(kernels, dtype, heads):
    torch.manual_seed(0)
    (hk, hq, dim), rows, length = heads, 7, 150
    keys, key_scales, key_ref = _cache_form(torch.randn(rows, hk, length, dim), dtype)
    values, value_scales, value_ref = _cache_form(torch.randn(rows, hk, length, dim), dtype)
    q = torch.randn(6, hq, dim)
    lengths = torch.tensor([1, 7, 150, 23, 64, 129])  # within, at and across the kernel's blocks of 64 positions
    out = kernels.decode_attention(q, keys, values, key_scales, value_scales, lengths, dim**-0.5)
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    if dtype == torch.int8 and kernels.int8_scores and dim % 64 == 0:
        q = _rounded_heads(q)  # the scores over int16 queries (AVX512-VNNI)
    ref = F.scaled_dot_product_attention(q[:, :, None], key_ref[:6], value_ref[:6], attn_mask=mask, enable_gqa=True)[
        :, :, 0
    ]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _rounded_heads(q: torch.Tensor) -> torch.Tensor:
    """Each query head rounded to int16 as the VNNI build's scores of an int8 cache round it (one scale a head: its
    largest magnitude over 32,767, to nearest even), and read back."""
    amax = q.abs().amax(-1, keepdim=True)
    return torch.round(q * (32767 / amax)) * (amax / 32767)


def test_an_int8_caches_scores_over_int16_queries_stay_at_the_float_queries(kernels):
    """With AVX512-VNNI an int8 cache's scores are exact integer products of the keys' bytes and the query heads
    rounded to int16 (16 positions' keys a vector, vpdpwssd): against sdpa on the float queries, within float
    rounding (a 2,000-position context), where int8 queries were 100 times further off (0.7 %)."""
    if not kernels.int8_scores:
        pytest.skip("this build's scores are float products (no AVX512-VNNI)")
    torch.manual_seed(3)
    hk, hq, dim, length = 2, 12, 128, 2000
    keys, key_scales, key_ref = _cache_form(torch.randn(1, hk, length, dim), torch.int8)
    values, value_scales, value_ref = _cache_form(torch.randn(1, hk, length, dim), torch.int8)
    q = torch.randn(4, hq, dim) * 2
    lengths = torch.tensor([17, 500, 1999, 2000])
    rows = torch.zeros(4, dtype=torch.long)
    out = kernels.decode_attention(q, keys, values, key_scales, value_scales, lengths, dim**-0.5, rows)
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    k, v = key_ref.expand(4, -1, -1, -1), value_ref.expand(4, -1, -1, -1)
    ref = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]
    assert not torch.equal(out, ref)
    assert (out - ref).norm() / ref.norm() < 1e-4  # (the rounding of a query head: 1/65,534 of its largest value)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_a_prefill_chunks_queries_share_keys_and_each_gets_its_numbers_alone(kernels, dtype, heads):
    """Consecutive queries of one row from one first position (a prefill chunk's: up to eight share each block of
    keys converted once) give each query what it gets decoded alone, to the bit: a chunk of 21 queries across the
    blocks of 64 positions, then another row's; from position 0, in a window (each query its own first position),
    from one first position, and in a ring of 100 slots across its wrap."""
    torch.manual_seed(2)
    (hk, hq, dim), rows, length = heads, 3, 300
    keys, key_scales, _ = _cache_form(torch.randn(rows, hk, length + 1, dim), dtype)
    values, value_scales, _ = _cache_form(torch.randn(rows, hk, length + 1, dim), dtype)
    q = torch.randn(21 + 9 + 12, hq, dim)
    rows_of = torch.tensor([1] * 21 + [0] * 9 + [2] * 12)
    lengths = torch.cat([torch.arange(50, 71), torch.arange(1, 10), torch.arange(200, 212)])
    cases = [(None, 0, 0.0), (lengths - 40, 0, 5.0), (torch.full_like(lengths, 30), 0, 0.0)]
    cases.append((torch.full_like(lengths, 150), 100, 0.0))  # row 2's positions 150 .. 211 in slots 50 .. 99, 0 .. 11
    for starts, ring, cap in cases:
        together = kernels.decode_attention(
            q, keys, values, key_scales, value_scales, lengths, dim**-0.5, rows_of, starts, cap, ring
        )
        for i in range(len(q)):
            alone = kernels.decode_attention(
                q[i : i + 1],
                keys,
                values,
                key_scales,
                value_scales,
                lengths[i : i + 1],
                dim**-0.5,
                rows_of[i : i + 1],
                None if starts is None else starts[i : i + 1],
                cap,
                ring,
            )
            assert torch.equal(alone[0], together[i]), (i, starts is None)


@pytest.mark.parametrize("heads", [(2, 6, 16), (1, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_decode_attention_reads_a_window_across_a_rings_wrap_with_the_same_numbers(kernels, dtype, heads):
    """A sliding-window layer's ring (position p at slot p % ring) gives bit for bit what a cache as long as the
    context gives over the same window: across the wrap, within and across the blocks of 64 positions; and
    Gemma 2's soft-capping matches the formula."""
    torch.manual_seed(1)
    (hk, hq, dim), rows, length, window, ring = heads, 5, 400, 96, 150
    keys, key_scales, _ = _cache_form(torch.randn(rows, hk, length + 1, dim), dtype)
    values, value_scales, _ = _cache_form(torch.randn(rows, hk, length + 1, dim), dtype)
    written = torch.tensor([400, 390, 301, 273, 251])  # windows that wrap at every offset against the blocks

    def ringed(store):  # each row's ring after it wrote its positions 0 .. length - 1
        if store is None:
            return None
        out = torch.zeros(store.shape[0], store.shape[1], ring + 1, *store.shape[3:], dtype=store.dtype)
        for row, n in enumerate(written.tolist()):
            for p in range(n - ring, n):
                out[row, :, p % ring] = store[row, :, p]
        return out

    q = torch.randn(5, hq, dim)
    rows_of = torch.tensor([4, 0, 2, 3, 1])
    lengths = written[rows_of]
    starts = lengths - window
    for cap in (0.0, 5.0):
        full = kernels.decode_attention(
            q, keys, values, key_scales, value_scales, lengths, dim**-0.5, rows_of, starts, cap
        )
        wrapped = kernels.decode_attention(
            q,
            ringed(keys),
            ringed(values),
            ringed(key_scales),
            ringed(value_scales),
            lengths,
            dim**-0.5,
            rows_of,
            starts,
            cap,
            ring,
        )
        assert torch.equal(full, wrapped)
    k = keys[rows_of[:, None], :, torch.arange(window) + starts[:, None]]  # [5, window, hk, dim]
    k_ref = (
        k.float() * key_scales[rows_of[:, None], :, torch.arange(window) + starts[:, None]].float()[..., None]
        if key_scales is not None
        else k.float()
    )
    v = values[rows_of[:, None], :, torch.arange(window) + starts[:, None]]
    v_ref = (
        v.float() * value_scales[rows_of[:, None], :, torch.arange(window) + starts[:, None]].float()[..., None]
        if value_scales is not None
        else v.float()
    )
    k_ref, v_ref = (t.repeat_interleave(hq // hk, dim=2) for t in (k_ref, v_ref))
    if dtype == torch.int8 and kernels.int8_scores and dim % 64 == 0:
        q = _rounded_heads(q)  # (the scores over int16 queries: AVX512-VNNI)
    scores = torch.einsum("bhd,blhd->bhl", q, k_ref) * dim**-0.5
    ref = torch.einsum("bhl,blhd->bhd", (torch.tanh(scores / 5.0) * 5.0).softmax(-1), v_ref)
    torch.testing.assert_close(wrapped, ref, rtol=1e-4, atol=1e-4)


def test_int8_cache_rounds_each_head_to_its_own_scale():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 30.0])[None, :, None]
    x[0, 0] = 0  # an all-zero head keeps scale 0 and reads back as zeros
    q, s = quantize_heads(x)
    back = q.float() * s.float()[..., None]
    assert s.dtype == torch.float16 and q.dtype == torch.int8 and q.abs().max() == 127
    assert ((back - x).abs() <= s.float()[..., None] / 2 + 1e-7).all()  # half a step of its own scale
    assert torch.equal(back[0, 0], torch.zeros(64))


@pytest.mark.parametrize("rows", [1, 32, 450])  # 450: split between the threads, as a prefill's rows are
def test_norm_silu_gate_and_gelu_over_rows(kernels, rows):
    torch.manual_seed(0)
    x, w = torch.randn(rows, 576) * 3, torch.randn(576)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))
    gate_up = torch.randn(2, rows, 2 * 96) * 8
    gate_up[0, 0, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])  # sigmoid's ends
    gate, up = gate_up.chunk(2, dim=-1)
    got = kernels.silu_mul(gate_up)
    assert got.shape == (2, rows, 96)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kernels.gelu(gate_up), F.gelu(gate_up, approximate="tanh"), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [None, [4, 0, 4]])  # None: a decode step's rows 0..B-1; else a prefill's tokens
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_norm_and_rotary_store(kernels, dtype, rows):
    torch.manual_seed(0)
    x, w = torch.randn(3, 48), torch.randn(48)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (48,), w, 1e-5))

    hq, hk, dim, b = 4, 2, 8, 3
    qkv = torch.randn(b, (hq + 2 * hk) * dim)
    cos, sin = torch.randn(b, dim), torch.randn(b, dim)
    kc, vc = torch.zeros(5, hk, 10, dim, dtype=dtype), torch.zeros(5, hk, 10, dim, dtype=dtype)
    scaled = dtype == torch.int8
    ks, vs = (torch.zeros(5, hk, 10, dtype=torch.float16) if scaled else None for _ in range(2))
    pos = torch.tensor([0, 9, 4])
    q = kernels.rope_store(qkv, cos, sin, kc, vc, ks, vs, pos, hq, None if rows is None else torch.tensor(rows))
    rows = rows or list(range(b))
    heads = qkv.view(b, hq + 2 * hk, dim)
    c, s = cos[:, None], sin[:, None]
    torch.testing.assert_close(q, apply_rope(heads[:, :hq], c, s))
    for i, p in enumerate(pos.tolist()):
        for stored, scales, want in (
            (kc, ks, apply_rope(heads[i : i + 1, hq : hq + hk], c[i : i + 1], s[i : i + 1])[0]),
            (vc, vs, heads[i, hq + hk :]),
        ):
            values, want_scales, _ = _cache_form(want, dtype)
            if scaled:  # the same rounding as the prefill path's quantize_heads
                assert torch.equal(stored[rows[i], :, p], values) and torch.equal(scales[rows[i], :, p], want_scales)
            else:
                torch.testing.assert_close(stored[rows[i], :, p], values)
    untouched = [r for r in range(5) if r not in rows]
    assert kc[untouched].float().abs().sum() == 0 and vc[untouched].float().abs().sum() == 0
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.rope_store(qkv, cos, sin, kc, vc, ks, vs, pos, hq, torch.tensor([0, 5, 1]))
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.rope_store(qkv, cos, sin, kc, vc, ks, vs, torch.tensor([0, 10, 1]), hq)
