import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from inference_api.engine.linear import PackedLinear, use_packed_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48), (32, 1, 48)])
def test_packed_linear_equals_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-4, atol=1e-4)


def _tiny_model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_every_linear_of_a_cpu_model_is_packed_and_logits_stay_the_same(tied):
    model = _tiny_model(tied)
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        packed = use_packed_linears(model)
        after = model(input_ids=ids).logits
    assert packed == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the output head
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.model.embed_tokens.weight.shape == (64, 48)  # a tied embedding keeps its dense weight
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_other_dtypes_are_left_alone():
    model = _tiny_model(tied=False).to(torch.bfloat16)
    assert use_packed_linears(model) == 0
    assert isinstance(model.lm_head, nn.Linear)
