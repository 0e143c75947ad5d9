// Weight-only quantized linear layers for CPU: y = x @ dequant(W)^T (+ bias), float32 activations and
// accumulation, weights read as 8-bit or 4-bit groups (the layouts of GGUF's Q8_0 and Q4_1 blocks).
// The math is that of float32 F.linear on the dequantized weight, up to summation order.
//
// One row (decode of one stream): each weight row is read once, straight from its packed bytes. Up to
// MANY rows (decode of many streams): a block of weight rows is dequantized once into a small float buffer
// that stays in cache, and 4x4 tiles of (input row, weight row) dot products are computed from it. More
// rows (prefill): the whole weight is dequantized once and multiplied by the BLAS matmul.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NB = 16;  // weight rows per parallel task
constexpr int64_t FEW = 1;  // up to this many input rows: the direct path
constexpr int64_t MANY = 64;  // from this many: a dequantized copy and the BLAS matmul

// int8: q [N, K] int8, s [N, K / G] float; w[n, k] = q[n, k] * s[n, k / G]
inline void deq_row_i8(const int8_t* q, const float* s, int64_t K, int64_t G, float* out) {
  for (int64_t g = 0; g < K / G; ++g) {
    const float sc = s[g];
#pragma omp simd
    for (int64_t j = 0; j < G; ++j) out[g * G + j] = sc * static_cast<float>(q[g * G + j]);
  }
}

inline float dot_row_i8(const float* x, const int8_t* q, const float* s, int64_t K, int64_t G) {
#ifdef __AVX512F__
  if (G % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / G; ++g) {
      __m512 part = _mm512_setzero_ps();
      for (int64_t j = g * G; j < (g + 1) * G; j += 16) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + j))));
        part = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + j), part);
      }
      acc = _mm512_fmadd_ps(part, _mm512_set1_ps(s[g]), acc);
    }
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t g = 0; g < K / G; ++g) {
    float part = 0.f;
    const int8_t* qg = q + g * G;
    const float* xg = x + g * G;
#pragma omp simd reduction(+ : part)
    for (int64_t j = 0; j < G; ++j) part += xg[j] * static_cast<float>(qg[j]);
    acc += part * s[g];
  }
  return acc;
}

// int4: q [N, K / 2] uint8, blocks of 32 weights in 16 bytes (low nibbles: weights 0..15, high: 16..31),
// d and m [N, K / 32] float16 (as in GGUF's Q4_1 blocks); w = d * nibble + m, in float32
inline void deq_row_i4(const uint8_t* q, const c10::Half* d, const c10::Half* m, int64_t K, float* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const uint8_t* b = q + g * 16;
    const float dg = static_cast<float>(d[g]), mg = static_cast<float>(m[g]);
    float* o = out + g * 32;
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      o[j] = dg * static_cast<float>(b[j] & 15) + mg;
      o[j + 16] = dg * static_cast<float>(b[j] >> 4) + mg;
    }
  }
}

inline float dot_row_i4(const float* x, const float* xsum, const uint8_t* q, const c10::Half* d, const c10::Half* m,
                        int64_t K) {
  float acc = 0.f, macc = 0.f;
  for (int64_t g = 0; g < K / 32; ++g) {
    const uint8_t* b = q + g * 16;
    const float* xg = x + g * 32;
    float part = 0.f;
#pragma omp simd reduction(+ : part)
    for (int j = 0; j < 16; ++j)
      part += xg[j] * static_cast<float>(b[j] & 15) + xg[j + 16] * static_cast<float>(b[j] >> 4);
    acc += static_cast<float>(d[g]) * part;
    macc += static_cast<float>(m[g]) * xsum[g];
  }
  return acc + macc;
}

#ifdef __AVX512F__
constexpr int R = 4;  // weight rows per pass of the one-row kernel: independent accumulators, x loaded once
constexpr int AHEAD = 4;  // passes of R rows prefetched ahead

inline float half_to_float(c10::Half h) { return _cvtsh_ss(h.x); }

// sum over g of v[g] * w[g] for float16 v
inline float dot_half(const c10::Half* v, const float* w, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= n; g += 16)
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(v + g))), _mm512_loadu_ps(w + g), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; g < n; ++g) sum += half_to_float(v[g]) * w[g];
  return sum;
}

// y[n0 .. n0 + rows) for one input row: sum over blocks g of d[n, g] * (x_g . nibbles) + m[n, g] * sum(x_g),
// R weight rows at a time so each block of x is loaded once and the rows' chains overlap.
inline void dot_rows_i4(const float* x, const float* xsum, const uint8_t* q, const c10::Half* d, const c10::Half* m,
                        int64_t K, int64_t rows, float* y) {
  const int64_t S = K / 32, half = K / 2;
  const __m128i low = _mm_set1_epi8(15);
  __m512 acc[R];
  const uint8_t* qr[R];
  const c10::Half* dr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    qr[r] = q + (r < rows ? r : 0) * half;
    dr[r] = d + (r < rows ? r : 0) * S;
  }
  // software prefetch AHEAD passes ahead: the R rows' nibbles are R * K / 2 contiguous bytes, S lines of 64
  // bytes, one line per block; their scales and minimums a few lines more (measured: +20 % on cold weights)
  const char* ahead = reinterpret_cast<const char*>(q + AHEAD * R * half);
  for (int64_t i = 0; i < R * S * 2; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(d + AHEAD * R * S) + i, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + AHEAD * R * S) + i, _MM_HINT_T0);
  }
  for (int64_t g = 0; g < S; ++g) {
    _mm_prefetch(ahead + g * 64, _MM_HINT_T0);
    const __m512 xl = _mm512_loadu_ps(x + g * 32), xh = _mm512_loadu_ps(x + g * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const __m128i b = _mm_loadu_si128((const __m128i*)(qr[r] + g * 16));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)));
      const __m512 part = _mm512_fmadd_ps(hi, xh, _mm512_mul_ps(lo, xl));
      acc[r] = _mm512_fmadd_ps(part, _mm512_set1_ps(half_to_float(dr[r][g])), acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r) y[r] = _mm512_reduce_add_ps(acc[r]) + dot_half(m + r * S, xsum, S);
}

// The same for int8 groups of G (a multiple of 16): sum over groups of s[n, g] * (x_g . q[n, g]).
inline void dot_rows_i8(const float* x, const int8_t* q, const float* sc, int64_t K, int64_t G, int64_t rows,
                        float* y) {
  const int64_t S = K / G;
  __m512 acc[R];
  const int8_t* qr[R];
  const float* sr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    qr[r] = q + (r < rows ? r : 0) * K;
    sr[r] = sc + (r < rows ? r : 0) * S;
  }
  const char* ahead = reinterpret_cast<const char*>(q + AHEAD * R * K);  // R * K contiguous bytes
  for (int64_t i = 0; i < R * S * 4; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(sc + AHEAD * R * S) + i, _MM_HINT_T0);
  for (int64_t g = 0; g < S; ++g) {
    for (int64_t i = g * R * G; i < (g + 1) * R * G; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    __m512 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    for (int64_t j = g * G; j < (g + 1) * G; j += 16) {
      const __m512 xv = _mm512_loadu_ps(x + j);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qr[r] + j))));
        part[r] = _mm512_fmadd_ps(w, xv, part[r]);
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(sr[r][g]), acc[r]);
  }
  for (int r = 0; r < rows; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

// One input row over R-row passes of the weight, split between the threads.
template <typename Pass>
torch::Tensor one_row(const torch::Tensor& x2, int64_t N, const c10::optional<torch::Tensor>& bias, Pass pass) {
  auto y = torch::empty({1, N}, x2.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + R - 1) / R, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) pass(blk * R, std::min<int64_t>(R, N - blk * R), yp + blk * R);
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
#endif

// 4 input rows x 4 weight rows of dot products from float buffers
inline void tile4x4(const float* x, int64_t ldx, int64_t mr, const float* w, int64_t K, float* y, int64_t ldy,
                    int64_t nr) {
  const float* xs[4];
  const float* ws[4];
  for (int i = 0; i < 4; ++i) xs[i] = x + (i < mr ? i : 0) * ldx;
  for (int j = 0; j < 4; ++j) ws[j] = w + (j < nr ? j : 0) * K;
  float a[4][4];
#ifdef __AVX512F__
  if (K % 16 == 0) {
    __m512 c[4][4];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) c[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 w0 = _mm512_loadu_ps(ws[0] + k), w1 = _mm512_loadu_ps(ws[1] + k);
      const __m512 w2 = _mm512_loadu_ps(ws[2] + k), w3 = _mm512_loadu_ps(ws[3] + k);
      for (int i = 0; i < 4; ++i) {
        const __m512 xv = _mm512_loadu_ps(xs[i] + k);
        c[i][0] = _mm512_fmadd_ps(xv, w0, c[i][0]);
        c[i][1] = _mm512_fmadd_ps(xv, w1, c[i][1]);
        c[i][2] = _mm512_fmadd_ps(xv, w2, c[i][2]);
        c[i][3] = _mm512_fmadd_ps(xv, w3, c[i][3]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) a[i][j] = _mm512_reduce_add_ps(c[i][j]);
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nr; ++j) y[i * ldy + j] = a[i][j];
    return;
  }
#endif
  float a00 = 0, a01 = 0, a02 = 0, a03 = 0, a10 = 0, a11 = 0, a12 = 0, a13 = 0;
  float a20 = 0, a21 = 0, a22 = 0, a23 = 0, a30 = 0, a31 = 0, a32 = 0, a33 = 0;
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)
  for (int64_t k = 0; k < K; ++k) {
    const float x0 = xs[0][k], x1 = xs[1][k], x2 = xs[2][k], x3 = xs[3][k];
    const float w0 = ws[0][k], w1 = ws[1][k], w2 = ws[2][k], w3 = ws[3][k];
    a00 += x0 * w0; a01 += x0 * w1; a02 += x0 * w2; a03 += x0 * w3;
    a10 += x1 * w0; a11 += x1 * w1; a12 += x1 * w2; a13 += x1 * w3;
    a20 += x2 * w0; a21 += x2 * w1; a22 += x2 * w2; a23 += x2 * w3;
    a30 += x3 * w0; a31 += x3 * w1; a32 += x3 * w2; a33 += x3 * w3;
  }
  a[0][0] = a00; a[0][1] = a01; a[0][2] = a02; a[0][3] = a03;
  a[1][0] = a10; a[1][1] = a11; a[1][2] = a12; a[1][3] = a13;
  a[2][0] = a20; a[2][1] = a21; a[2][2] = a22; a[2][3] = a23;
  a[3][0] = a30; a[3][1] = a31; a[3][2] = a32; a[3][3] = a33;
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) y[i * ldy + j] = a[i][j];
}

template <typename DotRow, typename DeqRow>
torch::Tensor run(const torch::Tensor& x2, int64_t N, const c10::optional<torch::Tensor>& bias, DotRow dot_row,
                  DeqRow deq_row) {
  const int64_t M = x2.size(0), K = x2.size(1);
  if (M >= MANY) {  // prefill: dequantize once, then the BLAS matmul, which is compute-bound here
    auto w = torch::empty({N, K}, x2.options());
    float* wp = w.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) deq_row(n, wp + n * K);
    });
    return bias.has_value() ? at::addmm(*bias, x2, w.t()) : at::mm(x2, w.t());
  }
  auto y = torch::empty({M, N}, x2.options());
  const float* x = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(M > FEW ? NB * K : 0);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * NB, n1 = std::min(N, n0 + NB);
      if (M <= FEW) {
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t i = 0; i < M; ++i) yp[i * N + n] = dot_row(i, n);
        continue;
      }
      for (int64_t n = n0; n < n1; ++n) deq_row(n, buf.data() + (n - n0) * K);
      for (int64_t i = 0; i < M; i += 4)
        for (int64_t n = n0; n < n1; n += 4)
          tile4x4(x + i * K, K, std::min<int64_t>(4, M - i), buf.data() + (n - n0) * K, K, yp + i * N + n, N,
                  std::min<int64_t>(4, n1 - n));
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

torch::Tensor flat(const torch::Tensor& x) { return x.reshape({-1, x.size(-1)}).contiguous(); }

std::vector<int64_t> out_shape(const torch::Tensor& x, int64_t N) {
  auto s = x.sizes().vec();
  s.back() = N;
  return s;
}

}  // namespace

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat);
  auto x2 = flat(x);
  const int64_t N = q.size(0), K = q.size(1), G = K / s.size(1);
  TORCH_CHECK(x2.size(1) == K && G * s.size(1) == K);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  const float* xp = x2.data_ptr<float>();
  const int64_t S = s.size(1);
#ifdef __AVX512F__
  if (x2.size(0) == 1 && G % 16 == 0)  // one row: memory-bound, each weight byte read once
    return one_row(x2, N, bias, [&](int64_t n, int64_t rows, float* out) {
             dot_rows_i8(xp, qp + n * K, sp + n * S, K, G, rows, out);
           }).reshape(out_shape(x, N));
#endif
  auto y = run(x2, N, bias,
               [&](int64_t i, int64_t n) { return dot_row_i8(xp + i * K, qp + n * K, sp + n * S, K, G); },
               [&](int64_t n, float* out) { deq_row_i8(qp + n * K, sp + n * S, K, G, out); });
  return y.reshape(out_shape(x, N));
}

torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                          const torch::Tensor& m, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kByte);
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf, "int4 scales and minimums are float16");
  auto x2 = flat(x);
  const int64_t N = q.size(0), K = q.size(1) * 2, S = K / 32;
  TORCH_CHECK(x2.size(1) == K && K % 32 == 0 && d.size(1) == S && m.size(1) == S);
  const int64_t M = x2.size(0);
  std::vector<float> xsum(M * S);  // each block's sum of inputs, for the minimums
  const float* xp = x2.data_ptr<float>();
  for (int64_t i = 0; i < M * S; ++i) {
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (int j = 0; j < 32; ++j) t += xp[i * 32 + j];
    xsum[i] = t;
  }
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const c10::Half *dp = d.data_ptr<c10::Half>(), *mp = m.data_ptr<c10::Half>();
  const float* xs = xsum.data();
#ifdef __AVX512F__
  if (M == 1)  // one row: memory-bound, each weight byte read once
    return one_row(x2, N, bias, [&](int64_t n, int64_t rows, float* out) {
             dot_rows_i4(xp, xs, qp + n * K / 2, dp + n * S, mp + n * S, K, rows, out);
           }).reshape(out_shape(x, N));
#endif
  auto y = run(x2, N, bias,
               [&](int64_t i, int64_t n) {
                 return dot_row_i4(xp + i * K, xs + i * S, qp + n * K / 2, dp + n * S, mp + n * S, K);
               },
               [&](int64_t n, float* out) { deq_row_i4(qp + n * K / 2, dp + n * S, mp + n * S, K, out); });
  return y.reshape(out_shape(x, N));
}

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// One query token per row against that row's first lengths[b] cached positions; each kv head's keys
// and values are read once for all the query heads that share it (grouped-query attention). An int8 cache
// (T = int8_t) carries one float16 scale per row, head and position in ks and vs; other caches pass null.
template <typename T>
void decode_attention_impl(const float* q, const T* k, const T* v, const c10::Half* ks, const c10::Half* vs,
                           const int64_t* lengths, float* out, int64_t B, int64_t Hq, int64_t Hk, int64_t S,
                           int64_t D, float scale) {
  const int64_t group = Hq / Hk;
  at::parallel_for(0, B * Hk, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    std::vector<float> kf(D), acc(D);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / Hk, kh = t % Hk, n = std::max<int64_t>(1, std::min(lengths[b], S));
      const T* kp = k + (b * Hk + kh) * S * D;
      const T* vp = v + (b * Hk + kh) * S * D;
      const c10::Half* ksp = ks ? ks + (b * Hk + kh) * S : nullptr;
      const c10::Half* vsp = vs ? vs + (b * Hk + kh) * S : nullptr;
      scores.assign(group * n, 0.f);
      for (int64_t l = 0; l < n; ++l) {
        for (int64_t d = 0; d < D; ++d) kf[d] = to_float(kp[l * D + d]);
        const float ksc = ksp ? static_cast<float>(ksp[l]) * scale : scale;
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = q + (b * Hq + kh * group + g) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * kf[d];
          scores[g * n + l] = dot * ksc;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * n;
        float mx = sc[0];
        for (int64_t l = 1; l < n; ++l) mx = std::max(mx, sc[l]);
        float sum = 0.f;
        for (int64_t l = 0; l < n; ++l) {
          sc[l] = std::exp(sc[l] - mx);
          sum += sc[l];
        }
        const float inv = 1.f / sum;
        for (int64_t l = 0; l < n; ++l) sc[l] *= inv;
      }
      for (int64_t g = 0; g < group; ++g) {
        std::fill(acc.begin(), acc.end(), 0.f);
        const float* sc = scores.data() + g * n;
        for (int64_t l = 0; l < n; ++l) {
          const float p = vsp ? sc[l] * static_cast<float>(vsp[l]) : sc[l];
          const T* vl = vp + l * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += p * to_float(vl[d]);
        }
        std::copy(acc.begin(), acc.end(), out + (b * Hq + kh * group + g) * D);
      }
    }
  });
}

}  // namespace

// Scales of an int8 cache: float16 [rows, Hk, S] for keys and for values; none for other caches.
using Scales = c10::optional<torch::Tensor>;

const c10::Half* scales_of(const Scales& s, const torch::Tensor& cache) {
  if (cache.scalar_type() != at::kChar) return nullptr;
  TORCH_CHECK(s.has_value() && s->scalar_type() == at::kHalf && s->is_contiguous(), "an int8 cache needs float16 scales");
  TORCH_CHECK(s->dim() == 3 && s->size(0) == cache.size(0) && s->size(1) == cache.size(1) && s->size(2) == cache.size(2));
  return s->data_ptr<c10::Half>();
}

// Calls f with the element type of a float32, bfloat16, float16 or int8 cache.
template <typename F>
void dispatch_cache(const torch::Tensor& cache, F f) {
  switch (cache.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kChar: f(int8_t{}); break;
    default: TORCH_CHECK(false, "KV cache type must be float32, bfloat16, float16 or int8");
  }
}

// q [B, Hq, D] float; k, v [rows >= B, Hk, S, D] float, bfloat16, float16 or int8 (with ks, vs); lengths [B]
// -> [B, Hq, D]
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const Scales& ks, const Scales& vs, const torch::Tensor& lengths, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.is_contiguous() && v.is_contiguous() && k.dim() == 4);
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && lengths.scalar_type() == at::kLong);
  auto qc = q.contiguous();
  auto lc = lengths.contiguous();
  const int64_t B = qc.size(0), Hq = qc.size(1), D = qc.size(2), Hk = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) >= B && k.size(3) == D && Hq % Hk == 0 && lc.size(0) == B);
  auto out = torch::empty({B, Hq, D}, qc.options());
  const c10::Half *ksp = scales_of(ks, k), *vsp = scales_of(vs, v);
  dispatch_cache(k, [&](auto zero) {
    using T = decltype(zero);
    decode_attention_impl<T>(qc.data_ptr<float>(), static_cast<const T*>(k.data_ptr()),
                             static_cast<const T*>(v.data_ptr()), ksp, vsp, lc.data_ptr<int64_t>(),
                             out.data_ptr<float>(), B, Hq, Hk, S, D, static_cast<float>(scale));
  });
  return out;
}

// RMSNorm of each row of x [M, H] (float32): x / sqrt(mean(x^2) + eps) * w
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat);
  auto x2 = flat(x);
  const int64_t M = x2.size(0), H = x2.size(1);
  auto y = torch::empty_like(x2);
  const float *xp = x2.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i) {
    const float* r = xp + i * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < H; ++j) ss += r[j] * r[j];
    const float inv = 1.f / std::sqrt(ss / H + static_cast<float>(eps));
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) yp[i * H + j] = wp[j] * (r[j] * inv);
  }
  return y.view(x.sizes());
}

// silu(gate) * up for gu [M, 2F] = [gate | up] -> [M, F]
torch::Tensor silu_mul(const torch::Tensor& gu) {
  TORCH_CHECK(gu.scalar_type() == at::kFloat);
  auto g2 = flat(gu);
  const int64_t M = g2.size(0), F = g2.size(1) / 2;
  auto y = torch::empty({M, F}, g2.options());
  const float* gp = g2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i)
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) {
      const float g = gp[i * 2 * F + j];
      yp[i * F + j] = g / (1.f + std::exp(-g)) * gp[i * 2 * F + F + j];
    }
  return y;
}

namespace {

inline void rope_row(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < h; ++j) {
    out[j] = x[j] * c[j] - x[j + h] * s[j];
    out[j + h] = x[j + h] * c[j + h] + x[j] * s[j + h];
  }
}

// One head vector into a cache position: cast, or for an int8 cache rounded to 127 steps of its own
// float16 scale (max |x| / 127), the scale stored beside it.
template <typename T>
inline void store_head(const float* x, int64_t D, T* dst, c10::Half* scale) {
  if constexpr (std::is_same_v<T, int8_t>) {
    float mx = 0.f;
    for (int64_t d = 0; d < D; ++d) mx = std::max(mx, std::fabs(x[d]));
    const c10::Half s = static_cast<c10::Half>(mx / 127.f);
    const float sf = static_cast<float>(s);
    const float inv = sf > 0.f ? 1.f / sf : 0.f;
    for (int64_t d = 0; d < D; ++d)
      dst[d] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[d] * inv))));
    *scale = s;
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(x[d]);
  }
}

template <typename T>
void rope_store_impl(const float* qkv, const float* cos, const float* sin, T* kc, T* vc, c10::Half* ks,
                     c10::Half* vs, const int64_t* pos, float* q, int64_t B, int64_t Hq, int64_t Hk, int64_t S,
                     int64_t D) {
  std::vector<float> tmp(D);
  const int64_t width = (Hq + 2 * Hk) * D;
  for (int64_t b = 0; b < B; ++b) {
    const float* row = qkv + b * width;
    const float *c = cos + b * D, *s = sin + b * D;
    for (int64_t h = 0; h < Hq; ++h) rope_row(row + h * D, c, s, D, q + (b * Hq + h) * D);
    for (int64_t h = 0; h < Hk; ++h) {
      const int64_t at = (b * Hk + h) * S + pos[b];
      rope_row(row + (Hq + h) * D, c, s, D, tmp.data());
      store_head(tmp.data(), D, kc + at * D, ks ? ks + at : nullptr);
      store_head(row + (Hq + Hk + h) * D, D, vc + at * D, vs ? vs + at : nullptr);
    }
  }
}

}  // namespace

// Decode step of one layer: rotary embedding on the query and key heads of qkv [B, (Hq + 2 Hk) * D], the
// key and value of row b written into the caches [rows, Hk, S, D] at position pos[b] (an int8 cache with
// their float16 scales into ks, vs [rows, Hk, S]); returns q [B, Hq, D].
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor& kc, torch::Tensor& vc, const Scales& ks, const Scales& vs,
                         const torch::Tensor& pos, int64_t Hq) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && kc.is_contiguous());
  TORCH_CHECK(pos.scalar_type() == at::kLong && kc.scalar_type() == vc.scalar_type() && vc.is_contiguous());
  auto x = flat(qkv);
  auto cc = cos.contiguous(), sc = sin.contiguous(), pc = pos.contiguous();
  const int64_t B = x.size(0), Hk = kc.size(1), S = kc.size(2), D = kc.size(3);
  TORCH_CHECK(x.size(1) == (Hq + 2 * Hk) * D && kc.size(0) >= B && pc.size(0) == B && cc.size(-1) == D);
  auto q = torch::empty({B, Hq, D}, x.options());
  auto* ksp = const_cast<c10::Half*>(scales_of(ks, kc));
  auto* vsp = const_cast<c10::Half*>(scales_of(vs, vc));
  dispatch_cache(kc, [&](auto zero) {
    using T = decltype(zero);
    rope_store_impl<T>(x.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), static_cast<T*>(kc.data_ptr()),
                       static_cast<T*>(vc.data_ptr()), ksp, vsp, pc.data_ptr<int64_t>(), q.data_ptr<float>(), B, Hq,
                       Hk, S, D);
  });
  return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_int8", &linear_int8, "x @ (q * s)^T, 8-bit weight groups");
  m.def("linear_int4", &linear_int4, "x @ (d * q + m)^T, 4-bit weight groups of 32");
  m.def("decode_attention", &decode_attention, "one query token per row over its cached positions");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rope_store", &rope_store, "rotary embedding for a decode step, keys and values into the cache");
}
