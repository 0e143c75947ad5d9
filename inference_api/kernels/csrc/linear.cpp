// Weight-only quantized linear layers for CPU: y = x @ dequant(W)^T (+ bias), float32 activations and
// accumulation, the weights read in their own form: quant.py's 8-bit groups or 4-bit blocks (int_forms.h), or a
// GGUF tensor's own blocks of any type block_form.h serves. The math is that of float32 F.linear on the
// dequantized weight, up to summation order (or, with int8 inputs, on inputs rounded to int8 blocks of 32).
//
// One ladder picks the kernel for every form (run_linear), from the most specific to the most general:
// 1. int8 inputs and weights packed for the tiles (quant.py's forms, the k-quants, Q5_0 and Q5_1 packed at load,
//    other GGUF blocks a group of 16 rows at a time on the fly): every row count on the integer tiles (AVX512-VNNI;
//    at the AVX2 level the forms packed at load), so that each row's numbers are the same whatever the batch;
// 2. int8 inputs, a form with integer kernels: each pass of weight rows read once for up to 4 input rows
//    at a time (one row: the memory-bound decode of one stream);
// 3. float inputs, at least a vector's width of rows: dequantized chunks multiplied in register tiles;
// 4. fewer rows: dequantized chunks through the BLAS sgemm;
// 5. one row: each weight row read once, straight from its bytes;
// 6. a CPU without the vector units: one row at a time.
#include <chrono>

#include "block_form.h"
#include "int_forms.h"
#include "kernels.h"

namespace woq {
namespace {

#ifdef WOQ_VNNI
constexpr int PACKED_MR = VNNI_MR;
#else
constexpr int PACKED_MR = AVX2_MR;
#endif
// every row count's tiles over a weight packed at load (F::packed_tile: K8Pack or B32Pack), MR input rows a tile
template <int MR = PACKED_MR, typename F, typename Rows>
at::Tensor packed_rows(const F& f, const Rows& xr, const at::Tensor& x2, const Bias& bias) {
  return vnni_rows<MR>(
      x2, f.N, bias, [](int64_t) {},
      [&](auto mr, int64_t grp, int64_t i0, float* out) {
        f.template packed_tile<decltype(mr)::value>(xr, grp, i0, out, f.N);
      });
}

template <typename F>
at::Tensor run_linear(const F& f, const at::Tensor& x, const Bias& bias, bool int8_inputs) {
  auto x2 = flat(x);
  TORCH_CHECK(x2.scalar_type() == at::kFloat && x2.size(1) == f.K, "inputs of ", x2.size(1), " for a weight of ", f.K);
  const int64_t M = x2.size(0), N = f.N, K = f.K;
  const float* xp = x2.data_ptr<float>();
  const auto shape = out_shape(x, N);
  auto deq = [&](int64_t n, int64_t k0, int64_t kc, float* out) { f.deq(n, k0, kc, out); };
#ifdef WOQ_SIMD
  if constexpr (F::K8) {  // the k-quants against Q8_K inputs: the tiles for several rows, else passes of rows
    if (int8_inputs) {
      const Q8KRows xr(xp, M, K);
      // packed at load: the tiles unpack each vector where they use it, for every row count (on a Zen 5, with
      // AVX512-VNNI, faster than unpacking each group once a call from 1 to 512 rows: Qwen2.5 1.5B's Q4_K gate at 32
      // rows 0.63 against 1.21 ms, its Q6_K down 0.86 against 1.24, the same at 512)
      if (f.packed) return packed_rows(f, xr, x2, bias).reshape(shape);
#ifdef WOQ_VNNI
      if (M > 1)
        return vnni_rows(
                   x2, N, bias, [&](int64_t grp) { f.vnni_prepare(grp); },
                   [&](auto mr, int64_t, int64_t i0, float* out) {
                     f.template k8_tile<decltype(mr)::value>(xr, i0, out, N);
                   })
            .reshape(shape);
#endif
      auto pass = [&](auto rw, int64_t n, int64_t rows, float* out, int64_t i0, int64_t i1) {
        row_groups(i0, i1, [&](auto mr, int64_t i) {
          f.template k8_dot<decltype(rw)::value, decltype(mr)::value>(xr, i, n, rows, out + i * N, N);
        });
      };
      return (M == 1 ? few_rows<R>(M, x2, N, bias, pass) : few_rows<2>(M, x2, N, bias, pass)).reshape(shape);
    }
  }
#endif
#ifdef WOQ_VNNI
  if constexpr (F::VNNI) {
    if (int8_inputs && f.vnni_ready()) {
      const Q8Rows xr(xp, M, K, F::HALVES);
      if constexpr (F::B32)
        if (f.packed)  // Q5_0, Q5_1 packed at load: every row count unpacks each vector in the tile
          return packed_rows(f, xr, x2, bias).reshape(shape);
      if constexpr (F::ONE_ROW)
        if (M == 1)  // no packing for one input row: the tiles' numbers, read from the rows' own layout
          return vnni_rows(
                     x2, N, bias, [](int64_t) {},
                     [&](auto, int64_t grp, int64_t, float* out) { f.vnni_one(xr, grp, out); })
              .reshape(shape);
      return vnni_rows(
                 x2, N, bias, [&](int64_t grp) { f.vnni_prepare(grp); },
                 [&](auto mr, int64_t grp, int64_t i0, float* out) {
                   f.template vnni_tile<decltype(mr)::value>(xr, grp, i0, out, N);
                 })
          .reshape(shape);
    }
  }
#endif
#if defined(WOQ_SIMD) && !defined(WOQ_VNNI)
  if constexpr (F::AVX2_TILE) {
    if (int8_inputs &&
        f.avx2_ready()) {  // packed at load (the 4-bit form, Q5_0, Q5_1): the AVX2 tiles, every row count
      const Q8Rows xr(xp, M, K, F::HALVES);
      return vnni_rows<AVX2_MR>(
                 x2, N, bias, [](int64_t) {},
                 [&](auto mr, int64_t grp, int64_t i0, float* out) {
                   f.template avx2_tile<decltype(mr)::value>(xr, grp, i0, out, N);
                 })
          .reshape(shape);
    }
  }
#endif
#ifdef WOQ_SIMD
  if constexpr (F::Q8) {
    if (int8_inputs && f.q8_ready()) {
      const Q8Rows xr(xp, M, K, F::HALVES);
      auto pass = [&](auto rw, int64_t n, int64_t rows, float* out, int64_t i0, int64_t i1) {
        row_groups(i0, i1, [&](auto mr, int64_t i) {
          f.template dot_q8<decltype(rw)::value, decltype(mr)::value>(xr, i, n, rows, out + i * N, N);
        });
      };
      return (M == 1 ? few_rows<R>(M, x2, N, bias, pass) : few_rows<2>(M, x2, N, bias, pass)).reshape(shape);
    }
  }
  if (M >= W && f.vec_ready()) return tiled_rows(x2, N, bias, deq).reshape(shape);
#endif
  if (M > 1) return many_rows(x2, N, bias, deq).reshape(shape);
  const auto aux = f.one_row_inputs(xp);
#ifdef WOQ_SIMD
  if (f.vec_ready())  // one row: memory-bound, each weight byte read once
    return few_rows<R>(
               1, x2, N, bias,
               [&](auto, int64_t n, int64_t rows, float* out, int64_t, int64_t) { f.dot_rows(xp, aux, n, rows, out); })
        .reshape(shape);
#endif
  return each_row(x2, N, bias, [&](int64_t n) { return f.dot_row(xp, aux, n); }).reshape(shape);
}

// every row count with int8 inputs goes to the VNNI tiles when the weights were packed for them (4-bit: a
// byte per two weights, float16 scales; 8-bit: a byte per weight, float scales)
bool packed_for_vnni(const Packed& vq, const Packed& vs, int64_t N, int64_t K, at::ScalarType q_type) {
  if (!vq.has_value()) return false;
  const bool four = q_type == at::kByte;
  TORCH_CHECK(vs.has_value() && vq->is_contiguous() && vs->is_contiguous() && vq->scalar_type() == q_type &&
                  (vs->scalar_type() == at::kHalf || (!four && vs->scalar_type() == at::kFloat)) && N % 16 == 0 &&
                  K % 32 == 0,
              "VNNI weights packed wrongly");
  // the 4-bit form: each block's scale and minimum; the 8-bit form: its scale
  TORCH_CHECK(vq->numel() == N * K / (four ? 2 : 1) && vs->numel() == N / 16 * (K / 32) * (four ? 32 : 16),
              "VNNI weights packed wrongly: their sizes do not fit the layer");
  return packed_tiles(four ? FORM_INT4 : FORM_INT8);
}

#ifdef WOQ_SIMD
// int8_peak's loop on one thread: `steps` rounds of 12 independent accumulators, no memory traffic (the inputs
// pinned in registers by an empty asm statement, which the compiler may not remove with the loop around it)
inline void peak_loop(int64_t steps) {
#ifdef WOQ_VNNI
  __m512i acc[12], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  for (auto& a : acc) a = _mm512_setzero_si512();
  for (int64_t n = 0; n < steps; ++n) {
    for (auto& a : acc) a = _mm512_dpbusd_epi32(a, w, x);
    asm volatile("" : "+v"(w), "+v"(x));
  }
  for (auto& a : acc) asm volatile("" : : "v"(a));
#else
  __m256i acc[12], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
  for (auto& a : acc) a = _mm256_setzero_si256();
  for (int64_t n = 0; n < steps; ++n)
    for (auto& a : acc) {
      a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x));
      asm volatile("" : "+v"(w));  // (else the 12 equal products would be one)
    }
  for (auto& a : acc) asm volatile("" : : "v"(a));
#endif
}
#endif

}  // namespace

// The int8 multiply-adds a second these kernels' level can issue on every thread, with the instruction its tiles
// multiply with and nothing else: AVX512-VNNI's vpdpbusd (64 byte products into 16 int32 sums), or at the AVX2
// level vpmaddubsw (32 products into 16 int16 pair sums) with the vpaddw that adds its pairs up, as the AVX2 tiles
// do. The ceiling of a compute-bound step (a long prefill, many streams) at this level; 0 without the vector units.
double int8_peak(int64_t steps) {
#ifdef WOQ_SIMD
  const int64_t threads = at::get_num_threads();
  const auto started = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) peak_loop(steps);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
#ifdef WOQ_VNNI
  constexpr double PRODUCTS = 64;
#else
  constexpr double PRODUCTS = 32;
#endif
  return static_cast<double>(threads) * steps * 12 * PRODUCTS / seconds;
#else
  return 0.0;
#endif
}

// Whether these kernels were built with the VNNI tiles (AVX512-VNNI): quant.py packs the 8-bit weights only then.
bool vnni() {
#ifdef WOQ_VNNI
  return true;
#else
  return false;
#endif
}

// Whether these kernels run every row count of quant.py's form (FORM_INT8, FORM_INT4) on tiles over a copy packed at
// load (vnni_int8, vnni_int4): both forms at both levels (AVX2: avx2_i8_tile, avx2_i4_tile over the same packing)
bool packed_tiles(int64_t form) {
#ifdef WOQ_SIMD
  return form == FORM_INT8 || form == FORM_INT4;
#else
  return false;
#endif
}

// ggml's type numbers of the block types served in their own blocks (none without the vector units)
std::vector<int64_t> gguf_types() {
  std::vector<int64_t> types;
#ifdef WOQ_SIMD
  std::apply([&](auto... b) { (types.push_back(decltype(b)::TYPE), ...); }, BlockTypes{});
#endif
  return types;
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const Bias& bias,
                       bool int8_inputs, const Packed& vq, const Packed& vs) {
  TORCH_CHECK(q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat && q.is_contiguous() && s.is_contiguous());
  const int64_t N = q.size(0), K = q.size(1), G = K / s.size(1);
  TORCH_CHECK(G * s.size(1) == K);
  I8Form f{q.data_ptr<int8_t>(), s.data_ptr<float>(), N, K, G, s.size(1)};
  if (packed_for_vnni(vq, vs, N, K, at::kChar)) {
    f.vq = reinterpret_cast<const uint8_t*>(vq->data_ptr<int8_t>());
    if (vs->scalar_type() == at::kHalf) f.vsh = vs->data_ptr<c10::Half>();
    else f.vs = vs->data_ptr<float>();
  }
  return run_linear(f, x, bias, int8_inputs);
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                       const Bias& bias, bool int8_inputs, const Packed& vq, const Packed& vs) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && d.is_contiguous() && m.is_contiguous());
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf, "int4 scales and minimums are float16");
  const int64_t N = q.size(0), K = q.size(1) * 2, S = K / 32;
  TORCH_CHECK(K % 32 == 0 && d.size(1) == S && m.size(1) == S);
  I4Form f{q.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), m.data_ptr<c10::Half>(), N, K, S};
  if (packed_for_vnni(vq, vs, N, K, at::kByte)) f.vq = vq->data_ptr<uint8_t>(), f.vs = vs->data_ptr<c10::Half>();
  return run_linear(f, x, bias, int8_inputs);
}

// the bytes pack_k8 makes of raw [N, row_bytes] of this type; 0 where the type is not packed
int64_t k8_packed_bytes(int64_t type, int64_t N, int64_t row_bytes) {
  int64_t bytes = 0;
#ifdef WOQ_SIMD
  with_block(type, [&](auto b) {
    using B = decltype(b);
    if constexpr (LoadPack<B>::ON) bytes = (N + 15) / 16 * (row_bytes / B::BYTES) * LoadPack<B>::PB;
  });
#endif
  return bytes;
}

// k-quant (Q2_K to Q6_K) or IQ4_XS rows packed for the tiles (k8_pack.h: K8Pack), and Q5_0, Q5_1 or IQ4_NL rows
// (B32Pack): uint8 [groups of 16 rows, blocks * PB]; an empty tensor for other types
at::Tensor pack_k8(const at::Tensor& raw, int64_t type) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "GGUF rows: uint8 [N, bytes]");
  const int64_t N = raw.size(0), bytes = k8_packed_bytes(type, N, raw.size(1)), groups = (N + 15) / 16;
  if (bytes == 0) return at::empty({0}, at::kByte);
  auto out = at::empty({groups, bytes / groups}, at::kByte);
#ifdef WOQ_SIMD
  with_block(type, [&](auto b) {
    using B = decltype(b);
    using P = LoadPack<B>;
    if constexpr (P::ON) {
      TORCH_CHECK(raw.size(1) % B::BYTES == 0, "rows of ", raw.size(1), " bytes are not whole blocks");
      at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
          P::pack(raw.data_ptr<uint8_t>(), N, raw.size(1), g, out.data_ptr<uint8_t>() + g * (bytes / groups));
      });
    }
  });
#endif
  return out;
}

// x @ W^T for W a GGUF tensor's rows in their own blocks: raw [N, row_bytes] uint8, type: ggml's type number;
// packed: pack_k8's bytes of them (int8 inputs then read only those)
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& raw, int64_t type, const Bias& bias, bool int8_inputs,
                       const Packed& packed) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "GGUF rows: uint8 [N, bytes]");
  at::Tensor y;
#ifdef WOQ_SIMD
  const bool served = with_block(type, [&](auto b) {
    using B = decltype(b);
    TORCH_CHECK(raw.size(1) % B::BYTES == 0, "rows of ", raw.size(1), " bytes are not whole blocks");
    BlockForm<B> f(raw.data_ptr<uint8_t>(), raw.size(0), raw.size(1));
    if (packed.has_value() && packed->numel() > 0) {
      TORCH_CHECK(packed->scalar_type() == at::kByte && packed->is_contiguous() &&
                      packed->numel() == k8_packed_bytes(type, raw.size(0), raw.size(1)),
                  "k-quant rows packed wrongly");
      f.packed = packed->data_ptr<uint8_t>();
    }
    y = run_linear(f, x, bias, int8_inputs);
  });
  TORCH_CHECK(served, "GGUF type ", type, " is not served in its own blocks");
#else
  TORCH_CHECK(false, "GGUF blocks need the vector units (AVX2 with FMA and F16C)");
#endif
  return y;
}

// rows of a GGUF tensor's blocks (raw [R, row_bytes]) dequantized: float [R, K]
at::Tensor dequantize_gguf(const at::Tensor& raw, int64_t type) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "GGUF rows: uint8 [R, bytes]");
  at::Tensor y;
#ifdef WOQ_SIMD
  const bool served = with_block(type, [&](auto b) {
    using B = decltype(b);
    const BlockForm<B> f(raw.data_ptr<uint8_t>(), raw.size(0), raw.size(1));
    y = at::empty({f.N, f.K}, at::kFloat);
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, f.N, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) f.deq(r, 0, f.K, yp + r * f.K);
    });
  });
  TORCH_CHECK(served, "GGUF type ", type, " is not served in its own blocks");
#else
  TORCH_CHECK(false, "GGUF blocks need the vector units (AVX2 with FMA and F16C)");
#endif
  return y;
}

}  // namespace woq
