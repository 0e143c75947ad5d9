// The CPU kernels' entry points, as the bindings and the decoder call them.
#pragma once
#include <torch/extension.h>

#include <vector>

namespace woq {

// The weights packed for the VNNI tiles (quant.py's vnni_int4, vnni_int8), or none.
using Packed = c10::optional<torch::Tensor>;
using Bias = c10::optional<torch::Tensor>;

// The weight forms a linear takes (quant.py): 8-bit groups, 4-bit blocks, or a GGUF tensor's own blocks
// (its ggml type number)
constexpr int64_t FORM_INT8 = -1, FORM_INT4 = -2;

bool vnni();
std::vector<int64_t> gguf_types();
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, const Bias& bias,
                          bool int8_inputs, const Packed& vq, const Packed& vs);
torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                          const torch::Tensor& m, const Bias& bias, bool int8_inputs, const Packed& vq,
                          const Packed& vs);
torch::Tensor linear_gguf(const torch::Tensor& x, const torch::Tensor& raw, int64_t type, const Bias& bias,
                          bool int8_inputs);
torch::Tensor dequantize_gguf(const torch::Tensor& raw, int64_t type);

using Scales = c10::optional<torch::Tensor>;
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const Scales& ks,
                               const Scales& vs, const torch::Tensor& lengths, double scale,
                               const c10::optional<torch::Tensor>& rows, const c10::optional<torch::Tensor>& starts,
                               double softcap, int64_t ring);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& x);
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor& keys, torch::Tensor& values, const Scales& key_scales,
                         const Scales& value_scales, const torch::Tensor& positions, int64_t heads,
                         const c10::optional<torch::Tensor>& rows);

// the Decoder class (decoder.cpp) into the module
void bind_decoder(pybind11::module_& m);

}  // namespace woq
