// A llama-family decode step's layers in one call, over the linears of kernels.h (decoder.cpp; bindings.cpp
// binds the class).
#pragma once
#include <tuple>
#include <vector>

#include "kernels.h"

namespace woq {

// A quantized linear layer as the kernels take it, by its form (kernels.h): 4-bit (q uint8, a = d, b = m), 8-bit
// (q int8, a = s), or a GGUF tensor's own blocks (q: its rows' bytes, form: the type number).
struct Piece {
  int64_t form;
  at::Tensor q;
  c10::optional<at::Tensor> a, b, bias;
  bool int8_inputs;
  Packed vq, vs;
  at::Tensor operator()(const at::Tensor& x) const;
};
// form, q, a, b, bias, int8_inputs, VNNI q, VNNI scales
using LinearParts = std::tuple<int64_t, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                               c10::optional<at::Tensor>, bool, Packed, Packed>;

// One layer's linear: its pieces (rows of different forms or types stacked: quant.StackedWeight) side by side.
struct QuantLinear {
  std::vector<Piece> pieces;
  explicit QuantLinear(const std::vector<LinearParts>& parts);
  at::Tensor operator()(const at::Tensor& x) const;
};
using LayerParts = std::tuple<at::Tensor, std::vector<LinearParts>, std::vector<LinearParts>, at::Tensor,
                              std::vector<LinearParts>, std::vector<LinearParts>>;

// The decoder layers of a llama-family decode step in one call (the mirror of model/compact.py's one layer loop,
// CompactLM.forward: same kernels, same order, equal to it bit for bit, tests/test_quality.py): no Python between
// the dozen calls of each layer. The weights are held; the cache and the
// step's positions are passed in.
class Decoder {
 public:
  Decoder(const std::vector<LayerParts>& layers, int64_t heads, double eps);

  // x [B, H] embedded tokens; cos, sin [B, D]; write [B] cache positions; lengths [B] positions attended;
  // keys, values: each layer's cache [rows, Hk, S, D], with float16 scales for an int8 cache (else empty
  // lists) -> the last layer's output [B, H]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& write,
                     const at::Tensor& lengths, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                     const std::vector<at::Tensor>& key_scales, const std::vector<at::Tensor>& value_scales) const;

  // forward with LoRA adapters' terms (lora_add) after each linear: stacks, each layer's pieces (k: 0 qkv, 1 o,
  // 2 gate_up, 3 down; a [S, R, in] and b [S, R, rows] in float16; the first of the linear's output columns they
  // add to); tokens, slots, scales: the (entry, slot, scale) pairs, sorted by slot
  using Stacks = std::vector<std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, int64_t>>>;
  at::Tensor forward_lora(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& write,
                          const at::Tensor& lengths, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                          const std::vector<at::Tensor>& key_scales, const std::vector<at::Tensor>& value_scales,
                          const Stacks& stacks, const at::Tensor& tokens, const at::Tensor& slots,
                          const at::Tensor& scales) const;

 private:
  struct Lora {
    const Stacks& stacks;
    const at::Tensor &tokens, &slots, &scales;
    // y plus the terms of layer i's linear k (0 qkv, 1 o, 2 gate_up, 3 down) on input x
    at::Tensor add(size_t i, int k, const at::Tensor& x, at::Tensor y) const;
  };
  at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& write,
                 const at::Tensor& lengths, std::vector<at::Tensor>& keys, std::vector<at::Tensor>& values,
                 const std::vector<at::Tensor>& key_scales, const std::vector<at::Tensor>& value_scales,
                 const Lora* lora) const;
  struct Layer {
    at::Tensor attn_norm, mlp_norm;
    QuantLinear qkv, o, gate_up, down;
  };
  std::vector<Layer> layers_;
  int64_t heads_;
  double eps_;
};

}  // namespace woq
