// The CPU kernels' entry points, as the bindings and the decoder call them.
#pragma once
#include <ATen/ATen.h>

#include <vector>

namespace woq {

// The weights packed for the VNNI tiles (quant.py's vnni_int4, vnni_int8), or none.
using Packed = c10::optional<at::Tensor>;
using Bias = c10::optional<at::Tensor>;

// The weight forms a linear takes (quant.py): 8-bit groups, 4-bit blocks, or a GGUF tensor's own blocks
// (its ggml type number)
constexpr int64_t FORM_INT8 = -1, FORM_INT4 = -2;

bool vnni();
double int8_peak(int64_t steps);
bool packed_tiles(int64_t form);
std::vector<int64_t> gguf_types();
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const Bias& bias,
                       bool int8_inputs, const Packed& vq, const Packed& vs);
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                       const Bias& bias, bool int8_inputs, const Packed& vq, const Packed& vs);
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& raw, int64_t type, const Bias& bias, bool int8_inputs,
                       const Packed& packed);
at::Tensor pack_k8(const at::Tensor& raw, int64_t type);
at::Tensor dequantize_gguf(const at::Tensor& raw, int64_t type);

using Scales = c10::optional<at::Tensor>;
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Scales& ks,
                            const Scales& vs, const at::Tensor& lengths, double scale,
                            const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& starts,
                            double softcap, int64_t ring);
at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                             int64_t heads, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm(at::Tensor& h, const at::Tensor& y, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& x);
at::Tensor gelu(const at::Tensor& x);
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys,
                      at::Tensor& values, const Scales& key_scales, const Scales& value_scales,
                      const at::Tensor& positions, int64_t heads, const c10::optional<at::Tensor>& rows);
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniforms);
void lora_add(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& tokens,
              const at::Tensor& slots, const at::Tensor& scales, at::Tensor y);

}  // namespace woq
