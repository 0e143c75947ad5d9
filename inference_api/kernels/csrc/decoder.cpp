// A llama-family decode step's layers in one call (decoder.h), over the linears of kernels.h.
#include "decoder.h"

#include <cmath>

namespace woq {

at::Tensor Piece::operator()(const at::Tensor& x) const {
  if (form == FORM_INT4) return linear_int4(x, q, *a, *b, bias, int8_inputs, vq, vs);
  if (form == FORM_INT8) return linear_int8(x, q, *a, bias, int8_inputs, vq, vs);
  return linear_gguf(x, q, form, bias, int8_inputs, vq);
}

QuantLinear::QuantLinear(const std::vector<LinearParts>& parts) {
  TORCH_CHECK(!parts.empty(), "a linear without weights");
  for (const auto& [form, q, a, b, bias, int8_inputs, vq, vs] : parts) {
    TORCH_CHECK(form >= 0 || a.has_value(), "a quantized linear needs its scales");
    TORCH_CHECK(form != FORM_INT4 || b.has_value(), "a 4-bit linear needs its minimums");
    pieces.push_back({form, q, a, b, bias, int8_inputs, vq, vs});
  }
}

at::Tensor QuantLinear::operator()(const at::Tensor& x) const {
  if (pieces.size() == 1) return pieces[0](x);
  std::vector<at::Tensor> outs;
  for (const auto& p : pieces) outs.push_back(p(x));
  return at::cat(outs, -1);
}

Decoder::Decoder(const std::vector<LayerParts>& layers, int64_t heads, double eps) : heads_(heads), eps_(eps) {
  for (const auto& [attn_norm, qkv, o, mlp_norm, gate_up, down] : layers)
    layers_.push_back({attn_norm, mlp_norm, QuantLinear(qkv), QuantLinear(o), QuantLinear(gate_up), QuantLinear(down)});
}

at::Tensor Decoder::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& write,
                            const at::Tensor& lengths, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                            const std::vector<at::Tensor>& key_scales,
                            const std::vector<at::Tensor>& value_scales) const {
  return run(x, cos, sin, write, lengths, keys, values, key_scales, value_scales, nullptr);
}

at::Tensor Decoder::forward_lora(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 const at::Tensor& write, const at::Tensor& lengths, std::vector<at::Tensor> keys,
                                 std::vector<at::Tensor> values, const std::vector<at::Tensor>& key_scales,
                                 const std::vector<at::Tensor>& value_scales, const Stacks& stacks,
                                 const at::Tensor& tokens, const at::Tensor& slots, const at::Tensor& scales) const {
  TORCH_CHECK(stacks.size() == layers_.size(), "forward_lora: a stack list per layer");
  const Lora lora{stacks, tokens, slots, scales};
  return run(x, cos, sin, write, lengths, keys, values, key_scales, value_scales, &lora);
}

at::Tensor Decoder::Lora::add(size_t i, int k, const at::Tensor& x, at::Tensor y) const {
  for (const auto& [linear, a, b, offset] : stacks[i])
    if (linear == k) lora_add(x.contiguous(), a, b, tokens, slots, scales, y.narrow(1, offset, b.size(2)));
  return y;
}

at::Tensor Decoder::run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& write,
                        const at::Tensor& lengths, std::vector<at::Tensor>& keys, std::vector<at::Tensor>& values,
                        const std::vector<at::Tensor>& key_scales, const std::vector<at::Tensor>& value_scales,
                        const Lora* lora) const {
  TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size());
  TORCH_CHECK(key_scales.size() == value_scales.size() && (key_scales.empty() || key_scales.size() == keys.size()));
  auto h = x.contiguous().clone();
  const int64_t B = h.size(0);
  // each linear, then (with adapters) its terms
  auto linear = [&](size_t i, int k, const QuantLinear& l, const at::Tensor& in) {
    return lora == nullptr ? l(in) : lora->add(i, k, in, l(in));
  };
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    const Scales ks = key_scales.empty() ? Scales() : Scales(key_scales[i]);
    const Scales vs = value_scales.empty() ? Scales() : Scales(value_scales[i]);
    auto q = rope_store(linear(i, 0, l.qkv, rms_norm(h, l.attn_norm, eps_)), cos, sin, keys[i], values[i], ks, vs,
                        write, heads_, c10::nullopt);
    auto a = decode_attention(q, keys[i], values[i], ks, vs, lengths, 1.0 / std::sqrt(double(keys[i].size(3))),
                              c10::nullopt, c10::nullopt, 0.0, 0);
    h.add_(linear(i, 1, l.o, a.view({B, -1})));
    h.add_(linear(i, 3, l.down, silu_mul(linear(i, 2, l.gate_up, rms_norm(h, l.mlp_norm, eps_)))));
  }
  return h;
}

}  // namespace woq
