// How rows of inputs pass over rows of weights, whatever the weights' form: the drivers the kernel-choice ladder
// (linear.cpp) picks from. Each takes the form's own inner kernel as a callable: deq (rows dequantized into a
// float buffer), a pass over a few weight rows, or a VNNI tile.
#pragma once
#include "common.h"

namespace woq {
#ifdef WOQ_SIMD

// group(Int<MR>, i) for the input rows i .. i + MR of i0 .. i1, in groups of up to 4
template <typename Group>
inline void row_groups(int64_t i0, int64_t i1, Group group) {
  int64_t i = i0;
  for (; i + 4 <= i1; i += 4) group(Int<4>{}, i);
  if (i1 - i == 3) group(Int<3>{}, i);
  else if (i1 - i == 2) group(Int<2>{}, i);
  else if (i1 - i == 1) group(Int<1>{}, i);
}
// Several input rows (decode of many streams, prefill) with the vector unit: y^T = dequant(W) @ x^T, the input
// rows along the vector lanes. x is transposed once per call into blocks of up to XB rows ([K][block width]);
// each thread dequantizes a chunk of NC weight rows, KC inputs at a time, into a buffer in its cache, and a
// tile of TR weight rows by one block of input rows keeps its 12 accumulators in registers over the KC
// inputs, each weight broadcast from the buffer. No copy beyond the dequantization: sgemm repacked every
// dequantized chunk (13 % of a 32-row decode step's time in perf), and this is faster from 8 rows up
// (docs/performance.md).
constexpr int64_t XB = 2 * W;  // input rows per block: two vectors
constexpr int64_t KC = 192;    // inputs per pass: a block of x^T is 12 or 24 KB, in L1
constexpr int64_t NC = 96;     // weight rows per chunk: 72 KB of floats, in L2

// acc[r, 0 .. MV W) (rows ldo apart) += sum over k < kc of w[r, k] * xt[k, 0 .. MV W) for RT weight rows w
// (kc apart) and the block xt (rows ldx apart); first: start from zero
template <int RT, int MV>
inline void tile(const float* xt, int64_t ldx, const float* w, int64_t kc, float* acc, int64_t ldo, bool first) {
  Vec::T a[RT][MV];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < MV; ++v) a[r][v] = first ? Vec::zero() : Vec::load(acc + r * ldo + v * W);
  for (int64_t k = 0; k < kc; ++k) {
    Vec::T xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = Vec::load(xt + k * ldx + v * W);
    for (int r = 0; r < RT; ++r) {
      const Vec::T wr = Vec::set1(w[r * kc + k]);
      for (int v = 0; v < MV; ++v) a[r][v] = Vec::fma(xv[v], wr, a[r][v]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < MV; ++v) Vec::store(acc + r * ldo + v * W, a[r][v]);
}

// deq(n, k0, kc, out): weight row n's inputs k0 .. k0 + kc dequantized into out; K a multiple of W
template <typename Deq>
at::Tensor tiled_rows(const at::Tensor& x2, int64_t N, const c10::optional<at::Tensor>& bias, Deq deq) {
  const int64_t M = x2.size(0), K = x2.size(1), Mp = (M + W - 1) / W * W, blocks = (M + XB - 1) / XB;
  const float* x = x2.data_ptr<float>();
  std::vector<float> xt(Mp * K);  // block b: [K][its width], at b * XB * K
  auto transpose = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m0 = b * XB, rows = std::min(XB, M - m0), width = std::min(XB, Mp - m0);
      float* out = xt.data() + m0 * K;
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t i = 0; i < rows; ++i) out[k * width + i] = x[(m0 + i) * K + k];
        for (int64_t i = rows; i < width; ++i) out[k * width + i] = 0.f;
      }
    }
  };
  if (M * K >= 65536) at::parallel_for(0, blocks, 1, transpose);  // a prefill's rows; a decode step's: one thread
  else transpose(0, blocks);
  auto y = at::empty({M, N}, x2.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + NC - 1) / NC, 1, [&](int64_t c0, int64_t c1) {
    thread_local std::vector<float> buf, acc;  // reused by the pool's threads: no page faults per call
    buf.resize(NC * std::min(KC, K));
    acc.resize(NC * Mp);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * NC, nc = std::min(NC, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        for (int64_t j = 0; j < nc; ++j) deq(n0 + j, k0, kc, buf.data() + j * kc);
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t m0 = b * XB, width = std::min(XB, Mp - m0);
          const float* xb = xt.data() + m0 * K + k0 * width;
          with_count<XB / W>(width / W, [&](auto mv) {
            constexpr int MV = decltype(mv)::value, TR = 12 / MV;  // 12 accumulators: 15 of 16 AVX2 registers in use
            int64_t j = 0;
            for (; j + TR <= nc; j += TR)
              tile<TR, MV>(xb, width, buf.data() + j * kc, kc, acc.data() + j * Mp + m0, Mp, k0 == 0);
            for (; j < nc; ++j) tile<1, MV>(xb, width, buf.data() + j * kc, kc, acc.data() + j * Mp + m0, Mp, k0 == 0);
          });
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nc; ++j) yp[m * N + n0 + j] = acc[j * Mp + m];
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
constexpr int VNNI_MR = 8;  // input rows per VNNI tile: 8 int32 and 8 float accumulators
constexpr int AVX2_MR = 4;  // input rows per AVX2 tile over 8 weight rows: 4 int16 and 4 int32 accumulators

// y [M, N]: groups of 16 weight rows split between the threads; each group's packed weights (K * 8 or K * 16
// bytes) stay in L1 while tiles of up to MR input rows pass over them. prepare(group) first (a form that packs
// a group's weights on the fly), then tile(Int<MR>, group, i0, out) for each tile of input rows.
template <int MR = VNNI_MR, typename Prepare, typename Tile>
at::Tensor vnni_rows(const at::Tensor& x2, int64_t N, const c10::optional<at::Tensor>& bias, Prepare prepare,
                     Tile tile) {
  const int64_t M = x2.size(0);
  auto y = at::empty({M, N}, x2.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      prepare(grp);
      for (int64_t i0 = 0; i0 < M; i0 += MR)
        with_count<MR>(std::min<int64_t>(MR, M - i0), [&](auto mr) { tile(mr, grp, i0, yp + i0 * N + grp * 16); });
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// the inputs a thread's passes of weight rows take at a time: 256 KB of int8 inputs, which stay in L2, where a
// prefill's whole inputs streamed from L3 for every pass (Qwen2.5 1.5B's Q4_K gate_up at 512 rows on the AVX2 level:
// 72 -> 81 G multiply-adds/s)
constexpr int64_t ROW_BYTES = 256 << 10;

// M input rows (y [M, N]) over passes of RW weight rows, split between the threads: pass(Int<RW>, n, rows, y + n,
// i0, i1) computes y[i, n .. n + rows) for the input rows i0 <= i < i1 (row stride N), ROW_BYTES of inputs at a time.
template <int RW, typename Pass>
at::Tensor few_rows(int64_t M, const at::Tensor& x2, int64_t N, const c10::optional<at::Tensor>& bias, Pass pass) {
  auto y = at::empty({M, N}, x2.options());
  float* yp = y.data_ptr<float>();
  const int64_t block = std::max<int64_t>(4, ROW_BYTES / x2.size(1) / 4 * 4);
  at::parallel_for(0, (N + RW - 1) / RW, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t i0 = 0; i0 < M; i0 += block)
      for (int64_t blk = b0; blk < b1; ++blk)
        pass(Int<RW>{}, blk * RW, std::min<int64_t>(RW, N - blk * RW), yp + blk * RW, i0, std::min(M, i0 + block));
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
#endif  // WOQ_SIMD

// Several input rows (fewer than a vector holds, or no vector units): each thread dequantizes a chunk of
// weight rows into a float buffer that stays in its cache and multiplies it with the BLAS sgemm
// (single-threaded inside the parallel region), so no float copy of the whole weight is ever held. Chunks of
// about 256 KB: the buffer and the inputs fit in L2. deq as tiled_rows takes it.
template <typename Deq>
at::Tensor many_rows(const at::Tensor& x2, int64_t N, const c10::optional<at::Tensor>& bias, Deq deq) {
  const int M = static_cast<int>(x2.size(0)), K = static_cast<int>(x2.size(1));
  const int64_t NC = std::max<int64_t>(16, std::min<int64_t>(256, 65536 / K / 16 * 16));
  auto y = at::empty({M, N}, x2.options());
  const float* x = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + NC - 1) / NC, 1, [&](int64_t c0, int64_t c1) {
    thread_local std::vector<float> buf;  // reused by the pool's threads: no page faults per call
    buf.resize(NC * K);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * NC;
      const int nc = static_cast<int>(std::min(NC, N - n0)), ldc = static_cast<int>(N);
      for (int64_t n = n0; n < n0 + nc; ++n) deq(n, 0, K, buf.data() + (n - n0) * K);
      // column-major: y^T[n0 : n0 + nc, :] = chunk (stored [nc, K], read transposed) @ x^T (stored [M, K])
      const float one = 1.f, zero = 0.f;
      sgemm_("T", "N", &nc, &M, &K, &one, buf.data(), &K, x, &K, &zero, yp + n0, &ldc);
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// Rows one at a time without the vector kernels (a CPU with neither AVX-512 nor AVX2).
template <typename DotRow>
at::Tensor each_row(const at::Tensor& x2, int64_t N, const c10::optional<at::Tensor>& bias, DotRow dot_row) {
  auto y = at::empty({1, N}, x2.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) yp[n] = dot_row(n);
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace woq
