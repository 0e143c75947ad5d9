// A llama-family decode step's layers in one call, over the linears of kernels.h.
#include <cmath>

#include "kernels.h"

namespace woq {

// A quantized linear layer as the kernels take it, by its form (kernels.h): 4-bit (q uint8, a = d, b = m), 8-bit
// (q int8, a = s), or a GGUF tensor's own blocks (q: its rows' bytes, form: the type number).
struct Piece {
  int64_t form;
  torch::Tensor q;
  c10::optional<torch::Tensor> a, b, bias;
  bool int8_inputs;
  Packed vq, vs;
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (form == FORM_INT4) return linear_int4(x, q, *a, *b, bias, int8_inputs, vq, vs);
    if (form == FORM_INT8) return linear_int8(x, q, *a, bias, int8_inputs, vq, vs);
    return linear_gguf(x, q, form, bias, int8_inputs);
  }
};
// form, q, a, b, bias, int8_inputs, VNNI q, VNNI scales
using LinearParts = std::tuple<int64_t, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                               c10::optional<torch::Tensor>, bool, Packed, Packed>;

// One layer's linear: its pieces (rows of different forms or types stacked: quant.StackedWeight) side by side.
struct QuantLinear {
  std::vector<Piece> pieces;
  explicit QuantLinear(const std::vector<LinearParts>& parts) {
    TORCH_CHECK(!parts.empty(), "a linear without weights");
    for (const auto& [form, q, a, b, bias, int8_inputs, vq, vs] : parts) {
      TORCH_CHECK(form >= 0 || a.has_value(), "a quantized linear needs its scales");
      TORCH_CHECK(form != FORM_INT4 || b.has_value(), "a 4-bit linear needs its minimums");
      pieces.push_back({form, q, a, b, bias, int8_inputs, vq, vs});
    }
  }
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (pieces.size() == 1) return pieces[0](x);
    std::vector<torch::Tensor> outs;
    for (const auto& p : pieces) outs.push_back(p(x));
    return torch::cat(outs, -1);
  }
};
using LayerParts = std::tuple<torch::Tensor, std::vector<LinearParts>, std::vector<LinearParts>, torch::Tensor,
                              std::vector<LinearParts>, std::vector<LinearParts>>;

// The decoder layers of a llama-family decode step in one call (compact.py's CompactLM._decode, same kernels,
// same order): no Python between the dozen calls of each layer. The weights are held; the cache and the
// step's positions are passed in.
class Decoder {
 public:
  Decoder(const std::vector<LayerParts>& layers, int64_t heads, double eps) : heads_(heads), eps_(eps) {
    for (const auto& [attn_norm, qkv, o, mlp_norm, gate_up, down] : layers)
      layers_.push_back(
          {attn_norm, mlp_norm, QuantLinear(qkv), QuantLinear(o), QuantLinear(gate_up), QuantLinear(down)});
  }

  // x [B, H] embedded tokens; cos, sin [B, D]; write [B] cache positions; lengths [B] positions attended;
  // keys, values: each layer's cache [rows, Hk, S, D], with float16 scales for an int8 cache (else empty
  // lists) -> the last layer's output [B, H]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& write, const torch::Tensor& lengths, std::vector<torch::Tensor> keys,
                        std::vector<torch::Tensor> values, const std::vector<torch::Tensor>& key_scales,
                        const std::vector<torch::Tensor>& value_scales) const {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size());
    TORCH_CHECK(key_scales.size() == value_scales.size() && (key_scales.empty() || key_scales.size() == keys.size()));
    auto h = x.contiguous().clone();
    const int64_t B = h.size(0);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const Scales ks = key_scales.empty() ? Scales() : Scales(key_scales[i]);
      const Scales vs = value_scales.empty() ? Scales() : Scales(value_scales[i]);
      auto q = rope_store(l.qkv(rms_norm(h, l.attn_norm, eps_)), cos, sin, keys[i], values[i], ks, vs, write, heads_,
                          c10::nullopt);
      auto a = decode_attention(q, keys[i], values[i], ks, vs, lengths, 1.0 / std::sqrt(double(keys[i].size(3))),
                                c10::nullopt, c10::nullopt, 0.0, 0);
      h.add_(l.o(a.view({B, -1})));
      h.add_(l.down(silu_mul(l.gate_up(rms_norm(h, l.mlp_norm, eps_)))));
    }
    return h;
  }

 private:
  struct Layer {
    torch::Tensor attn_norm, mlp_norm;
    QuantLinear qkv, o, gate_up, down;
  };
  std::vector<Layer> layers_;
  int64_t heads_;
  double eps_;
};

void bind_decoder(pybind11::module_& m) {
  // module_local: the module may be imported again from another path in one process (a relative and an
  // absolute model cache), which would otherwise register the class twice and fail the import
  py::class_<Decoder>(m, "Decoder", py::module_local(),
                      "a llama-family decode step's layers over quantized weights, in one call")
      .def(py::init<const std::vector<LayerParts>&, int64_t, double>(), py::arg("layers"), py::arg("heads"),
           py::arg("eps"))
      .def("forward", &Decoder::forward);
}

}  // namespace woq
