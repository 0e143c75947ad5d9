import torch
from tiny import small_llama_config
from transformers import LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from inference_api.model.attention import NAME, row_sdpa, use_row_attention


class _Module:
    num_key_value_groups = 3
    is_causal = True


def test_row_sdpa_equals_transformers_sdpa_on_grouped_heads_with_a_mask():
    torch.manual_seed(0)
    store = torch.randn(4, 2, 50, 16)  # [rows, kv_heads, positions, dim], sliced like the row cache
    key, value = store[:, :, :20], store.flip(0)[:, :, :20]
    query = torch.randn(4, 6, 3, 16)
    mask = torch.zeros(4, 1, 3, 20).masked_fill_(torch.rand(4, 1, 3, 20) < 0.3, torch.finfo(torch.float32).min)
    ours, _ = row_sdpa(_Module(), query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(_Module(), query, key, value, mask, scaling=0.25)
    assert ours.shape == theirs.shape == (4, 3, 6, 16)
    torch.testing.assert_close(ours, theirs)


def _tiny_model(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(small_llama_config(attn_implementation=attn)).eval()


def test_cpu_sdpa_model_switches_and_gives_the_same_logits():
    model = _tiny_model("sdpa")
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    mask = torch.zeros(1, 1, 5, 5).masked_fill_(~torch.ones(5, 5, dtype=torch.bool).tril(), -1e9)
    with torch.inference_mode():
        before = model(input_ids=ids, attention_mask=mask).logits
        use_row_attention(model)
        after = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == NAME
    torch.testing.assert_close(after, before)


def test_eager_model_is_left_alone():
    model = _tiny_model("eager")
    use_row_attention(model)
    assert model.config._attn_implementation == "eager"
