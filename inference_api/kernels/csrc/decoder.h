// A decode step's layers in one call, over the linears of kernels.h (decoder.cpp; bindings.cpp binds the class).
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
using Norm = c10::optional<at::Tensor>;
// attn_norm, qkv, o, mlp_norm, gate_up, down, then the norms some families add (none: the family has no such
// norm): the per-head query and key norms (Qwen 3, Gemma 3) and the norms of the attention's and the MLP's outputs
// before they are added back (Gemma 2 and 3)
using LayerParts = std::tuple<at::Tensor, std::vector<LinearParts>, std::vector<LinearParts>, at::Tensor,
                              std::vector<LinearParts>, std::vector<LinearParts>, Norm, Norm, Norm, Norm>;

// What a step's layers read beside the weights, each list one entry per layer: cos, sin [B, D] the rotary of
// the layer's table at each row's position; write [B] the slot each row writes in the layer's cache; starts [B]
// the first position a sliding-window layer attends (none: from 0); ring the slots of a layer's ring (0: as long
// as the context); lengths [B] positions attended; keys, values: each layer's cache [rows, Hk, S, D], with
// float16 scales for an int8 cache (else empty lists)
struct StepInputs {
  std::vector<at::Tensor> cos, sin, write;
  std::vector<c10::optional<at::Tensor>> starts;
  std::vector<int64_t> ring;
  at::Tensor lengths;
  std::vector<at::Tensor> keys, values, key_scales, value_scales;
};

// The decoder layers of a decode step in one call (the mirror of model/compact.py's one layer loop,
// CompactLM.forward, for the families ModelSpec.fused names: same kernels, same order, equal to it bit for bit,
// tests/test_quality.py and tests/test_architectures.py): no Python between the dozen calls of each layer. The
// weights are held; the cache and the step's positions are passed in.
class Decoder {
 public:
  // gelu: the MLP's gate through tanh-approximated GELU (else SiLU); attn_scale: the scores' scale; softcap: the
  // scores' soft-capping (0: none)
  Decoder(const std::vector<LayerParts>& layers, int64_t heads, double eps, bool gelu, double attn_scale,
          double softcap);

  // x [B, H] embedded tokens, then StepInputs' fields in order -> the last layer's output [B, H]
  at::Tensor forward(const at::Tensor& x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                     std::vector<at::Tensor> write, std::vector<c10::optional<at::Tensor>> starts,
                     std::vector<int64_t> ring, const at::Tensor& lengths, std::vector<at::Tensor> keys,
                     std::vector<at::Tensor> values, std::vector<at::Tensor> key_scales,
                     std::vector<at::Tensor> value_scales) const;

  // forward with LoRA adapters' terms (lora_add) after each linear: stacks, each layer's pieces (k: 0 qkv, 1 o,
  // 2 gate_up, 3 down; a [S, R, in] and b [S, R, rows] in float16; the first of the linear's output columns they
  // add to); tokens, slots, scales: the (entry, slot, scale) pairs, sorted by slot
  using Stacks = std::vector<std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, int64_t>>>;
  at::Tensor forward_lora(const at::Tensor& x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                          std::vector<at::Tensor> write, std::vector<c10::optional<at::Tensor>> starts,
                          std::vector<int64_t> ring, const at::Tensor& lengths, std::vector<at::Tensor> keys,
                          std::vector<at::Tensor> values, std::vector<at::Tensor> key_scales,
                          std::vector<at::Tensor> value_scales, const Stacks& stacks, const at::Tensor& tokens,
                          const at::Tensor& slots, const at::Tensor& scales) const;

 private:
  struct Lora {
    const Stacks& stacks;
    const at::Tensor &tokens, &slots, &scales;
    // y plus the terms of layer i's linear k (0 qkv, 1 o, 2 gate_up, 3 down) on input x
    at::Tensor add(size_t i, int k, const at::Tensor& x, at::Tensor y) const;
  };
  at::Tensor run(const at::Tensor& x, StepInputs& in, const Lora* lora) const;
  struct Layer {
    at::Tensor attn_norm, mlp_norm;
    QuantLinear qkv, o, gate_up, down;
    Norm q_norm, k_norm, post_attn_norm, post_mlp_norm;
  };
  std::vector<Layer> layers_;
  int64_t heads_;
  double eps_;
  bool gelu_;
  double attn_scale_, softcap_;
};

}  // namespace woq
