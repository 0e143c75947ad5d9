// A decode step's layers in one call (decoder.h), over the linears of kernels.h.
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

Decoder::Decoder(const std::vector<LayerParts>& layers, int64_t heads, double eps, bool gelu, double attn_scale,
                 double softcap)
    : heads_(heads), eps_(eps), gelu_(gelu), attn_scale_(attn_scale), softcap_(softcap) {
  for (const auto& [attn_norm, qkv, o, mlp_norm, gate_up, down, q_norm, k_norm, post_attn, post_mlp] : layers) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "per-head norms of the queries and the keys, or none");
    layers_.push_back({attn_norm, mlp_norm, QuantLinear(qkv), QuantLinear(o), QuantLinear(gate_up), QuantLinear(down),
                       q_norm, k_norm, post_attn, post_mlp});
  }
}

at::Tensor Decoder::forward(const at::Tensor& x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                            std::vector<at::Tensor> write, std::vector<c10::optional<at::Tensor>> starts,
                            std::vector<int64_t> ring, const at::Tensor& lengths, std::vector<at::Tensor> keys,
                            std::vector<at::Tensor> values, std::vector<at::Tensor> key_scales,
                            std::vector<at::Tensor> value_scales) const {
  StepInputs in{cos, sin, write, starts, ring, lengths, keys, values, key_scales, value_scales};
  return run(x, in, nullptr);
}

at::Tensor Decoder::forward_lora(const at::Tensor& x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                 std::vector<at::Tensor> write, std::vector<c10::optional<at::Tensor>> starts,
                                 std::vector<int64_t> ring, const at::Tensor& lengths, std::vector<at::Tensor> keys,
                                 std::vector<at::Tensor> values, std::vector<at::Tensor> key_scales,
                                 std::vector<at::Tensor> value_scales, const Stacks& stacks, const at::Tensor& tokens,
                                 const at::Tensor& slots, const at::Tensor& scales) const {
  TORCH_CHECK(stacks.size() == layers_.size(), "forward_lora: a stack list per layer");
  const Lora lora{stacks, tokens, slots, scales};
  StepInputs in{cos, sin, write, starts, ring, lengths, keys, values, key_scales, value_scales};
  return run(x, in, &lora);
}

at::Tensor Decoder::Lora::add(size_t i, int k, const at::Tensor& x, at::Tensor y) const {
  for (const auto& [linear, a, b, offset] : stacks[i])
    if (linear == k) lora_add(x.contiguous(), a, b, tokens, slots, scales, y.narrow(1, offset, b.size(2)));
  return y;
}

at::Tensor Decoder::run(const at::Tensor& x, StepInputs& in, const Lora* lora) const {
  const size_t L = layers_.size();
  TORCH_CHECK(in.keys.size() == L && in.values.size() == L, "a cache per layer");
  TORCH_CHECK(
      in.cos.size() == L && in.sin.size() == L && in.write.size() == L && in.starts.size() == L && in.ring.size() == L,
      "the step's rotary, slots, starts and rings: one per layer");
  TORCH_CHECK(in.key_scales.size() == in.value_scales.size() && (in.key_scales.empty() || in.key_scales.size() == L));
  auto h = x.contiguous().clone();
  const int64_t B = h.size(0);
  // each linear, then (with adapters) its terms
  auto linear = [&](size_t i, int k, const QuantLinear& l, const at::Tensor& v) {
    return lora == nullptr ? l(v) : lora->add(i, k, v, l(v));
  };
  // as CompactLM._norm, a layer's optional norm of an output
  auto norm = [&](const Norm& w, at::Tensor v) { return w.has_value() ? rms_norm(v, *w, eps_) : v; };
  at::Tensor normed;  // the next layer's input: the norm of h
  if (L > 0) normed = rms_norm(h, layers_[0].attn_norm, eps_);
  for (size_t i = 0; i < L; ++i) {
    const Layer& l = layers_[i];
    const Scales ks = in.key_scales.empty() ? Scales() : Scales(in.key_scales[i]);
    const Scales vs = in.value_scales.empty() ? Scales() : Scales(in.value_scales[i]);
    const int64_t Hk = in.keys[i].size(1), D = in.keys[i].size(3);
    auto qkv = linear(i, 0, l.qkv, normed);
    if (l.q_norm.has_value()) {  // each head's norm before the rotary, written back into qkv
      auto heads = qkv.view({B, heads_ + 2 * Hk, D});
      heads.narrow(1, 0, heads_).copy_(rms_norm(heads.narrow(1, 0, heads_), *l.q_norm, eps_));
      heads.narrow(1, heads_, Hk).copy_(rms_norm(heads.narrow(1, heads_, Hk), *l.k_norm, eps_));
    }
    auto q = rope_store(qkv, in.cos[i], in.sin[i], in.keys[i], in.values[i], ks, vs, in.write[i], heads_, c10::nullopt);
    auto a = decode_attention(q, in.keys[i], in.values[i], ks, vs, in.lengths, attn_scale_, c10::nullopt, in.starts[i],
                              softcap_, in.ring[i]);
    // each residual add and the norm after it in one pass (the next layer's attention norm after the last)
    auto up = linear(i, 2, l.gate_up,
                     add_rms_norm(h, norm(l.post_attn_norm, linear(i, 1, l.o, a.view({B, -1}))), l.mlp_norm, eps_));
    at::Tensor act;
    if (gelu_) {  // as the loop's [gate | up] halves: gelu(gate) * up
      auto halves = up.chunk(2, -1);
      act = at::gelu(halves[0], "tanh").mul_(halves[1]);
    } else {
      act = silu_mul(up);
    }
    auto y = norm(l.post_mlp_norm, linear(i, 3, l.down, act));
    if (i + 1 < L) normed = add_rms_norm(h, y, layers_[i + 1].attn_norm, eps_);
    else h.add_(y);
  }
  return h;
}

}  // namespace woq
