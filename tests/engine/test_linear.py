from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from servers import MODEL_CACHE
from tiny import small_llama_config, tiny_config
from torch import nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM

from inference_api.kernels import load_kernels
from inference_api.kernels.quant import QuantLinear, quantize_int4
from inference_api.model.linear import DenseLinear, OneDNNLinear, SplitLinear, linear_factory, row_bucket, use_linears

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN has no bfloat16 on this CPU",
)


@onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48), (32, 1, 48)])
def test_onednn_linear_equals_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        torch.testing.assert_close(OneDNNLinear(linear.weight, linear.bias)(x), linear(x), rtol=1e-4, atol=1e-4)


def test_onednn_calls_are_padded_to_few_row_counts():
    buckets = {row_bucket(m) for m in range(1, 513)}
    assert buckets == {1, 8, 16, 32} | {64 * i for i in range(1, 9)}  # 12 shapes, not 512
    assert all(row_bucket(m) >= m for m in range(1, 2000))


@onednn_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_onednn_linear_is_linear_on_bfloat16_rounded_inputs(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 80, bias=bias)
    x = torch.randn(5, 3, 64)
    with torch.inference_mode():
        y = OneDNNLinear(linear.weight, linear.bias, torch.bfloat16)(x)
        rounded = F.linear(x.bfloat16().float(), linear.weight.bfloat16().float(), linear.bias)
    assert y.dtype == torch.float32 and y.shape == (5, 3, 80)
    # float32 accumulation of the rounded values; the sum itself is rounded to bfloat16 (2 ** -8 relative)
    torch.testing.assert_close(y, rounded, rtol=2**-8, atol=1e-3)
    assert not torch.allclose(y, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)  # not float32


def test_factory_picks_by_device_dtype_and_quantization():
    w = torch.randn(64, 96)
    cpu = torch.device("cpu")
    kernels = load_kernels(Path(MODEL_CACHE))
    assert isinstance(linear_factory(cpu, torch.bfloat16, "none", None)(w, None), DenseLinear)
    if not torch.backends.mkldnn.is_available():
        assert isinstance(linear_factory(cpu, torch.float32, "int4", kernels)(w, None), QuantLinear)
        return
    assert isinstance(linear_factory(cpu, torch.float32, "none", kernels)(w, None), OneDNNLinear)
    # without the kernels a quantized model is served on its dequantized weights, same numbers
    fallback = linear_factory(cpu, torch.float32, "int4", None)(w, None)
    x = torch.randn(3, 96)
    torch.testing.assert_close(fallback(x), F.linear(x, quantize_int4(w).dequantize()), rtol=1e-4, atol=1e-4)


@onednn
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_layers_run_every_row_count_on_the_kernels_without_a_dense_copy(mode):
    layer = linear_factory(torch.device("cpu"), torch.float32, mode, load_kernels(Path(MODEL_CACHE)))(
        torch.randn(64, 96), torch.randn(64)
    )
    assert isinstance(layer, QuantLinear)
    for x in (torch.randn(1, 1, 96), torch.randn(4, 96), torch.randn(2, 3, 96), torch.randn(80, 96)):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight.dequantize(), layer.bias), rtol=1e-5, atol=1e-5)


@onednn_bf16
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_with_a_bfloat16_copy_one_row_takes_the_kernel_and_several_rows_onednn(mode, monkeypatch):
    kernels = load_kernels(Path(MODEL_CACHE))
    layer = linear_factory(torch.device("cpu"), torch.float32, mode, kernels, torch.bfloat16)(
        torch.randn(64, 96), torch.randn(64)
    )
    assert isinstance(layer, SplitLinear) and isinstance(layer.quantized, QuantLinear)
    assert layer.dense.dtype == torch.bfloat16 and layer.dense.packed.dtype == torch.bfloat16
    calls = []
    for part in (QuantLinear, OneDNNLinear):
        monkeypatch.setattr(
            part, "__call__", lambda self, x, run=part.__call__, name=part.__name__: calls.append(name) or run(self, x)
        )
    for x in (torch.randn(1, 1, 96), torch.randn(4, 96), torch.randn(2, 3, 96)):
        expected = F.linear(x, layer.quantized.weight.dequantize(), layer.quantized.bias)
        torch.testing.assert_close(layer(x), expected, rtol=0.05, atol=0.1)  # bfloat16 rounding on several rows
    assert calls == ["QuantLinear", "OneDNNLinear", "OneDNNLinear"]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_every_linear_of_a_transformers_model_is_replaced_and_logits_stay_the_same(model):
    torch.manual_seed(0)
    if model == "llama":
        m = LlamaForCausalLM(small_llama_config()).eval()
    else:  # gpt2's projections are Conv1D, not nn.Linear: only its head is replaced
        config = tiny_config("gpt2", 64, hidden_size=48, intermediate_size=None, initializer_range=None)
        m = GPT2LMHeadModel(config).eval()
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.inference_mode():
        before = m(input_ids=ids).logits
        replaced = use_linears(m, linear_factory(torch.device("cpu"), torch.float32, "none", None))
        after = m(input_ids=ids).logits
    assert replaced == (2 * 7 + 1 if model == "llama" else 1)
    assert not any(type(x) is nn.Linear for x in m.modules())
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
