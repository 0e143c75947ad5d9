// Weight-only quantized linear layers for CPU: y = x @ dequant(W)^T (+ bias), float32 activations and
// accumulation, weights read as 8-bit or 4-bit groups (the layouts of GGUF's Q8_0 and Q4_1 blocks).
// The math is that of float32 F.linear on the dequantized weight, up to summation order.
//
// One row (decode of one stream): each weight row is read once, straight from its packed bytes, with
// AVX-512 or AVX2 (FMA, F16C) where the CPU has them. Up to 16 rows with int8 inputs: the same, each pass
// of weight rows serving every input row from L1. More rows (decode of many streams, prefill): each
// thread dequantizes chunks of weight rows into a buffer that stays in its cache and multiplies them by
// tiles of the inputs held in registers (tiled_rows; the BLAS sgemm for fewer rows than a vector holds,
// and on CPUs without the vector units); compute bounds these, and no float copy of the weights is held.
// Decoder runs a llama decode step's layers in one call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

// the BLAS that torch links (MKL in the x86 wheels): Fortran sgemm, column-major
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define WOQ_SIMD
#endif

namespace {


// int8: q [N, K] int8, s [N, K / G] float; w[n, k] = q[n, k] * s[n, k / G]. Inputs k0 .. k0 + kc of the row
// at q, s into out.
inline void deq_row_i8(const int8_t* q, const float* s, int64_t k0, int64_t kc, int64_t G, float* out) {
  for (int64_t j = k0; j < k0 + kc;) {
    const int64_t end = std::min(k0 + kc, (j / G + 1) * G);
    const float sc = s[j / G];
#pragma omp simd
    for (int64_t i = j; i < end; ++i) out[i - k0] = sc * static_cast<float>(q[i]);
    j = end;
  }
}

inline float dot_row_i8(const float* x, const int8_t* q, const float* s, int64_t K, int64_t G) {
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

#ifdef WOQ_SIMD
// the sum of 8 floats (AVX2, so on AVX-512 CPUs as well)
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The few vector operations the kernels need, over W floats: AVX-512 or AVX2 (with FMA and F16C).
#ifdef __AVX512F__
struct Vec {
  using T = __m512;
  static constexpr int W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
  // the sums of four vectors into out[0..4)
  static void sum4(T a, T b, T c, T d, float* out) {
    out[0] = sum(a), out[1] = sum(b), out[2] = sum(c), out[3] = sum(d);
  }
  static T halves(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static T int8s(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T abs(T a) { return _mm512_abs_ps(a); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T floor(T a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // 2 ** n for whole numbers n in [-126, 127]
  static T pow2(T n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  // where c >= 0: a, else b
  static T select_nonnegative(T c, T a, T b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, zero(), _CMP_GE_OQ), b, a); }
  // W nibbles: the low (shift 0) or high (shift 4) halves of the W bytes at p
  static T nibbles(const uint8_t* p, int shift) {
    const __m128i b = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i*)p), shift), _mm_set1_epi8(15));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  }
};
#else
struct Vec {
  using T = __m256;
  static constexpr int W = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(T v) { return sum8(v); }
  static void sum4(T a, T b, T c, T d, float* out) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  static T halves(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static T int8s(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T abs(T a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T floor(T a) { return _mm256_floor_ps(a); }
  static T pow2(T n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static T select_nonnegative(T c, T a, T b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(c, zero(), _CMP_GE_OQ)); }
  static T nibbles(const uint8_t* p, int shift) {
    const __m128i b = _mm_and_si128(_mm_srli_epi16(_mm_loadl_epi64((const __m128i*)p), shift), _mm_set1_epi8(15));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  }
};
#endif
constexpr int W = Vec::W;
constexpr int R = 4;  // weight rows per pass of the one-row kernel: independent accumulators, x loaded once
constexpr int AHEAD = 4;  // passes of R rows prefetched ahead

inline float half_to_float(c10::Half h) { return _cvtsh_ss(h.x); }

// sum over g of v[g] * w[g] for float16 v
inline float dot_half(const c10::Half* v, const float* w, int64_t n) {
  Vec::T acc = Vec::zero();
  int64_t g = 0;
  for (; g + W <= n; g += W) acc = Vec::fma(Vec::halves(v + g), Vec::load(w + g), acc);
  float sum = Vec::sum(acc);
  for (; g < n; ++g) sum += half_to_float(v[g]) * w[g];
  return sum;
}

// y[n0 .. n0 + rows) for one input row: sum over blocks g of d[n, g] * (x_g . nibbles) + m[n, g] * sum(x_g),
// R weight rows at a time so each block of x is loaded once and the rows' chains overlap. Weight j of a
// block is the low nibble of byte j for j < 16, the high nibble of byte j - 16 above.
inline void dot_rows_i4(const float* x, const float* xsum, const uint8_t* q, const c10::Half* d, const c10::Half* m,
                        int64_t K, int64_t rows, float* y) {
  constexpr int V = 32 / W;  // vectors per block
  const int64_t S = K / 32, half = K / 2;
  Vec::T acc[R];
  const uint8_t* qr[R];
  const c10::Half* dr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = Vec::zero();
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
    Vec::T xv[V];
    for (int v = 0; v < V; ++v) xv[v] = Vec::load(x + g * 32 + v * W);
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = qr[r] + g * 16;
      Vec::T part = Vec::mul(Vec::nibbles(b, 0), xv[0]);
      for (int v = 1; v < V; ++v) part = Vec::fma(Vec::nibbles(b + v * W % 16, v * W / 16 * 4), xv[v], part);
      acc[r] = Vec::fma(part, Vec::set1(half_to_float(dr[r][g])), acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r) y[r] = Vec::sum(acc[r]) + dot_half(m + r * S, xsum, S);
}

// The same for int8 groups of G (a multiple of W): sum over groups of s[n, g] * (x_g . q[n, g]).
inline void dot_rows_i8(const float* x, const int8_t* q, const float* sc, int64_t K, int64_t G, int64_t rows,
                        float* y) {
  const int64_t S = K / G;
  Vec::T acc[R];
  const int8_t* qr[R];
  const float* sr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = Vec::zero();
    qr[r] = q + (r < rows ? r : 0) * K;
    sr[r] = sc + (r < rows ? r : 0) * S;
  }
  const char* ahead = reinterpret_cast<const char*>(q + AHEAD * R * K);  // R * K contiguous bytes
  for (int64_t i = 0; i < R * S * 4; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(sc + AHEAD * R * S) + i, _MM_HINT_T0);
  for (int64_t g = 0; g < S; ++g) {
    for (int64_t i = g * R * G; i < (g + 1) * R * G; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    Vec::T part[R];
    for (int r = 0; r < R; ++r) part[r] = Vec::zero();
    for (int64_t j = g * G; j < (g + 1) * G; j += W) {
      const Vec::T xv = Vec::load(x + j);
      for (int r = 0; r < R; ++r) part[r] = Vec::fma(Vec::int8s(qr[r] + j), xv, part[r]);
    }
    for (int r = 0; r < R; ++r) acc[r] = Vec::fma(part[r], Vec::set1(sr[r][g]), acc[r]);
  }
  for (int r = 0; r < rows; ++r) y[r] = Vec::sum(acc[r]);
}

#ifdef __AVX2__
// One row with int8 inputs (--dtype auto): x rounded per block of 32 to 127 steps of its own scale, as
// llama.cpp's Q8 activations, so a block's dot product is two integer instructions (u8 x s8 pairs, then
// pairs of those) instead of float conversions of every weight. 256-bit AVX2, on AVX-512 CPUs too.

// sum of the 32 products of u8 a and s8 b, as 8 int32 lanes, in float
inline __m256 dot_u8s8(__m256i a, __m256i b) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}

// dot_rows_i4 on int8 inputs, for RW weight rows and MR input rows (xq [MR, K], dx and xsum [MR, K / 32]):
// y[i * ldy + r] = sum over blocks of d * dx_i * (nibbles . xq_i) + m * sum(x_i). Each weight block is
// unpacked once for the MR rows.
template <int RW, int MR>
inline void dot_rows_i4_q8(const int8_t* xq, const float* dx, const float* xsum, const uint8_t* q, const c10::Half* d,
                           const c10::Half* m, int64_t K, int64_t rows, float* y, int64_t ldy) {
  const int64_t S = K / 32, half = K / 2;
  const __m128i low = _mm_set1_epi8(15);
  __m256 acc[RW][MR];
  const uint8_t* qr[RW];
  const c10::Half* dr[RW];
  for (int r = 0; r < RW; ++r) {
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_setzero_ps();
    qr[r] = q + (r < rows ? r : 0) * half;
    dr[r] = d + (r < rows ? r : 0) * S;
  }
  const char* ahead = reinterpret_cast<const char*>(q + AHEAD * RW * half);  // RW * K / 2 contiguous bytes
  for (int64_t i = 0; i < RW * S * 2; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(d + AHEAD * RW * S) + i, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + AHEAD * RW * S) + i, _MM_HINT_T0);
  }
  for (int64_t g = 0; g < S; ++g) {
    if (g * RW * 16 % 64 == 0) _mm_prefetch(ahead + g * RW * 16, _MM_HINT_T0);
    for (int r = 0; r < RW; ++r) {
      const __m128i b = _mm_loadu_si128((const __m128i*)(qr[r] + g * 16));  // weights 0..15 low, 16..31 high
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
      const float dw = half_to_float(dr[r][g]);
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + i * K + g * 32));
        acc[r][i] = _mm256_fmadd_ps(dot_u8s8(w, xv), _mm256_set1_ps(dw * dx[i * S + g]), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < MR; ++i) y[i * ldy + r] = sum8(acc[r][i]) + dot_half(m + r * S, xsum + i * S, S);
}

// dot_rows_i8 on int8 inputs, weight groups G a multiple of 32, RW weight rows and MR input rows (dx
// [MR, K / 32]): sum over blocks of s * dx_i * (q . xq_i)
template <int RW, int MR>
inline void dot_rows_i8_q8(const int8_t* xq, const float* dx, const int8_t* q, const float* sc, int64_t K, int64_t G,
                           int64_t rows, float* y, int64_t ldy) {
  const int64_t S = K / G, B = K / 32;
  __m256 acc[RW][MR];
  const int8_t* qr[RW];
  const float* sr[RW];
  for (int r = 0; r < RW; ++r) {
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_setzero_ps();
    qr[r] = q + (r < rows ? r : 0) * K;
    sr[r] = sc + (r < rows ? r : 0) * S;
  }
  const char* ahead = reinterpret_cast<const char*>(q + AHEAD * RW * K);  // RW * K contiguous bytes
  for (int64_t i = 0; i < RW * S * 4; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(sc + AHEAD * RW * S) + i, _MM_HINT_T0);
  for (int64_t j = 0; j < K; j += 32) {
    for (int64_t i = j * RW; i < (j + 32) * RW; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    for (int r = 0; r < RW; ++r) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(qr[r] + j));
      const __m256i aw = _mm256_abs_epi8(w);
      const float sw = sr[r][j / G];
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + i * K + j));
        const __m256 dot = dot_u8s8(aw, _mm256_sign_epi8(xv, w));  // |w| * (x * sign w)
        acc[r][i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sw * dx[i * B + j / 32]), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < MR; ++i) y[i * ldy + r] = sum8(acc[r][i]);
}

// Rows of inputs rounded to int8 blocks of 32 (127 steps of each block's own scale, max |x| / 127, to nearest
// even): q [M, K], each block's step d and float sum [M, K / 32]. plus128: q holds the rounded values plus 128,
// as bytes (the unsigned side of the VNNI tiles over int8 weights).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  Q8Rows(const float* x, int64_t M, int64_t K, bool plus128 = false) : q(M * K), d(M * K / 32), sum(M * K / 32) {
    const int64_t blocks = M * K / 32;
    auto run = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) block(x + b * 32, b, plus128 ? 128 : 0);
    };
    if (blocks >= 2048) at::parallel_for(0, blocks, 256, run);  // a prefill's rows
    else run(0, blocks);
  }

 private:
  void block(const float* xb, int64_t b, int offset) {
#ifdef __AVX512F__
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    const __m512i off = _mm512_set1_epi32(offset);
    const __m512i ql = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), off);  // nearest even
    const __m512i qh = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv)), off);
    _mm_storeu_si128((__m128i*)(q.data() + b * 32), offset ? _mm512_cvtusepi32_epi8(ql) : _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128((__m128i*)(q.data() + b * 32 + 16), offset ? _mm512_cvtusepi32_epi8(qh) : _mm512_cvtsepi32_epi8(qh));
    sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
#else
    float mx = 0.f, t = 0.f;
    for (int j = 0; j < 32; ++j) mx = std::max(mx, std::fabs(xb[j]));
    const float inv = mx > 0.f ? 127.f / mx : 0.f;
    for (int j = 0; j < 32; ++j)
      q[b * 32 + j] = static_cast<int8_t>(static_cast<uint8_t>(static_cast<int>(std::nearbyint(xb[j] * inv)) + offset));
#pragma omp simd reduction(+ : t)
    for (int j = 0; j < 32; ++j) t += xb[j];
    sum[b] = t;
#endif
    d[b] = mx / 127.f;
  }
};
#endif

template <int V>
using Int = std::integral_constant<int, V>;

// Up to FEW_ROWS input rows with int8 inputs: each pass of weight rows is read from memory once and serves
// the input rows, 4 at a time, from L1. More rows go to the tiles on dequantized chunks (tiled_rows).
constexpr int64_t FEW_ROWS = 16;

// group(Int<MR>, i) for the input rows i .. i + MR, in groups of up to 4
template <typename Group>
inline void row_groups(int64_t M, Group group) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) group(Int<4>{}, i);
  if (M - i == 3) group(Int<3>{}, i);
  else if (M - i == 2) group(Int<2>{}, i);
  else if (M - i == 1) group(Int<1>{}, i);
}

// Dequantized rows with the vector unit (several rows' chunks are dequantized before the tiles or sgemm
// multiply them).
inline void deq_row_i4_vec(const uint8_t* q, const c10::Half* d, const c10::Half* m, int64_t K, float* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const Vec::T dv = Vec::set1(half_to_float(d[g])), mv = Vec::set1(half_to_float(m[g]));
#ifdef __AVX512F__
    for (int v = 0; v < 2; ++v)
      Vec::store(out + g * 32 + v * W, Vec::fma(Vec::nibbles(q + g * 16, v * 4), dv, mv));
#else  // the block's 16 bytes loaded once: low nibbles are weights 0..15, high 16..31
    const __m128i b = _mm_loadu_si128((const __m128i*)(q + g * 16)), low = _mm_set1_epi8(15);
    const __m128i half[2] = {_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low)};
    for (int h = 0; h < 2; ++h) {
      Vec::store(out + g * 32 + h * 16, Vec::fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half[h])), dv, mv));
      Vec::store(out + g * 32 + h * 16 + 8,
                 Vec::fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(half[h], 8))), dv, mv));
    }
#endif
  }
}

// deq_row_i8 for G, k0 and kc multiples of W
inline void deq_row_i8_vec(const int8_t* q, const float* s, int64_t k0, int64_t kc, int64_t G, float* out) {
  for (int64_t j = k0; j < k0 + kc; j += W) Vec::store(out + j - k0, Vec::mul(Vec::int8s(q + j), Vec::set1(s[j / G])));
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

// f(Int<n>) for a run-time n in 1 .. MAX (a kernel's tile size picked at compile time)
template <int MAX, typename F>
inline void with_count(int64_t n, F f) {
  if constexpr (MAX > 1) {
    if (n < MAX) return with_count<MAX - 1>(n, f);
  }
  f(Int<MAX>{});
}

// deq(n, k0, kc, out): weight row n's inputs k0 .. k0 + kc dequantized into out; K a multiple of W
template <typename Deq>
torch::Tensor tiled_rows(const torch::Tensor& x2, int64_t N, const c10::optional<torch::Tensor>& bias, Deq deq) {
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
  auto y = torch::empty({M, N}, x2.options());
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

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define WOQ_VNNI
// Any number of rows with int8 inputs on AVX512-VNNI: each vpdpbusd multiplies 16 weight rows by 4 inputs of one
// input row and adds the 4 products into each row's int32 lane (64 multiply-adds per instruction, against
// 16 for a float32 FMA). The weights are packed once at load (quant.py: vnni_int4, vnni_int8) so that one
// 64-byte load gives 16 rows x 4 inputs: [N / 16, blocks of 32, steps of 4 inputs, 16 rows, 4] bytes. The
// input's 4 bytes are broadcast; each block's integer sums are scaled into float accumulators.

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// y[i * ldy + 0 .. 16) for MR input rows and one group of 16 weight rows of 4-bit blocks: wp [S, 4, 16, 4]
// bytes (byte j of step a: weight 4a + j in its low nibble, 16 + 4a + j in its high), dm [S, 2, 16]
// float16 (scales, minimums); xq [MR, K] int8, dx and xs [MR, S]
template <int MR>
inline void vnni_i4_tile(const uint8_t* wp, const c10::Half* dm, int64_t S, const int8_t* xq, const float* dx,
                         const float* xs, int64_t K, float* y, int64_t ldy) {
  const __m512i low = _mm512_set1_epi8(15);
  __m512 accf[MR];
  for (int i = 0; i < MR; ++i) accf[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < S; ++g) {
    __m512i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
    for (int a = 0; a < 4; ++a) {
      const __m512i v = _mm512_loadu_si512(wp + (g * 4 + a) * 64);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = xq + i * K + g * 32 + 4 * a;
        acc[i] = _mm512_dpbusd_epi32(acc[i], lo, broadcast4(x));
        acc[i] = _mm512_dpbusd_epi32(acc[i], hi, broadcast4(x + 16));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dm + g * 32)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dm + g * 32 + 16)));
    for (int i = 0; i < MR; ++i) {
      accf[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_mul_ps(d, _mm512_set1_ps(dx[i * S + g])), accf[i]);
      accf[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i * S + g]), accf[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + i * ldy, accf[i]);
}

// The same for 8-bit weights: wp [S, 8, 16, 4] int8, sc [S, 2, 16] float (each block's scale, and 128 times
// the sum of its weights); xu [MR, K] the int8 inputs plus 128 (u8: vpdpbusd's unsigned side), so each sum is
// corrected by 128 * sum(w)
template <int MR>
inline void vnni_i8_tile(const int8_t* wp, const float* sc, int64_t S, const int8_t* xu, const float* dx, int64_t K,
                         float* y, int64_t ldy) {
  __m512 accf[MR];
  for (int i = 0; i < MR; ++i) accf[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < S; ++g) {
    __m512i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
    for (int a = 0; a < 8; ++a) {
      const __m512i w = _mm512_loadu_si512(wp + (g * 8 + a) * 64);
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], broadcast4(xu + i * K + g * 32 + 4 * a), w);
    }
    const __m512 s = _mm512_loadu_ps(sc + g * 32), corr = _mm512_loadu_ps(sc + g * 32 + 16);
    for (int i = 0; i < MR; ++i)
      accf[i] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(acc[i]), corr), _mm512_mul_ps(s, _mm512_set1_ps(dx[i * S + g])),
                                accf[i]);
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + i * ldy, accf[i]);
}

constexpr int VNNI_MR = 8;  // input rows per tile: 8 int32 and 8 float accumulators

// y [M, N]: groups of 16 weight rows split between the threads; each group's packed weights (K * 8 or K * 16
// bytes) stay in L1 while tiles of up to VNNI_MR input rows pass over them. tile(Int<MR>, group, i0, out)
template <typename Tile>
torch::Tensor vnni_rows(const torch::Tensor& x2, int64_t N, const c10::optional<torch::Tensor>& bias, Tile tile) {
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x2.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp)
      for (int64_t i0 = 0; i0 < M; i0 += VNNI_MR)
        with_count<VNNI_MR>(std::min<int64_t>(VNNI_MR, M - i0), [&](auto mr) { tile(mr, grp, i0, yp + i0 * N + grp * 16); });
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
#endif

// M input rows (y [M, N]) over passes of RW weight rows, split between the threads: pass(Int<RW>, n, rows, y + n)
// computes y[i, n .. n + rows) for every input row i (row stride N).
template <int RW, typename Pass>
torch::Tensor few_rows(int64_t M, const torch::Tensor& x2, int64_t N, const c10::optional<torch::Tensor>& bias,
                       Pass pass) {
  auto y = torch::empty({M, N}, x2.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + RW - 1) / RW, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) pass(Int<RW>{}, blk * RW, std::min<int64_t>(RW, N - blk * RW), yp + blk * RW);
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
#endif

// Several input rows (fewer than a vector holds, or no vector units): each thread dequantizes a chunk of
// weight rows into a float buffer that stays in its cache and multiplies it with the BLAS sgemm
// (single-threaded inside the parallel region), so no float copy of the whole weight is ever held. Chunks of
// about 256 KB: the buffer and the inputs fit in L2. deq as tiled_rows takes it.
template <typename Deq>
torch::Tensor many_rows(const torch::Tensor& x2, int64_t N, const c10::optional<torch::Tensor>& bias, Deq deq) {
  const int M = static_cast<int>(x2.size(0)), K = static_cast<int>(x2.size(1));
  const int64_t NC = std::max<int64_t>(16, std::min<int64_t>(256, 65536 / K / 16 * 16));
  auto y = torch::empty({M, N}, x2.options());
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
torch::Tensor each_row(const torch::Tensor& x2, int64_t N, const c10::optional<torch::Tensor>& bias, DotRow dot_row) {
  auto y = torch::empty({1, N}, x2.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) yp[n] = dot_row(n);
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

// The weights packed for the VNNI kernels (quant.py's vnni_int4, vnni_int8), or none.
using Packed = c10::optional<torch::Tensor>;

// Whether these kernels were built with the VNNI tiles (AVX512-VNNI): quant.py packs the weights for them only then.
bool vnni() {
#ifdef WOQ_VNNI
  return true;
#else
  return false;
#endif
}

#ifdef WOQ_VNNI
// every row count with int8 inputs goes to the VNNI tiles when the weights were packed for them (4-bit: a
// byte per two weights, float16 scales; 8-bit: a byte per weight, float scales)
inline bool use_vnni(bool int8_inputs, const Packed& vq, const Packed& vs, int64_t N, int64_t K, at::ScalarType q_type) {
  if (!int8_inputs || !vq.has_value()) return false;
  const bool four = q_type == at::kByte;
  TORCH_CHECK(vs.has_value() && vq->is_contiguous() && vs->is_contiguous() && vq->scalar_type() == q_type &&
              vs->scalar_type() == (four ? at::kHalf : at::kFloat) && N % 16 == 0 && K % 32 == 0,
              "VNNI weights packed wrongly");
  TORCH_CHECK(vq->numel() == N * K / (four ? 2 : 1) && vs->numel() == N / 16 * (K / 32) * 32,
              "VNNI weights packed wrongly: their sizes do not fit the layer");
  return true;
}
#endif

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                          const c10::optional<torch::Tensor>& bias, bool int8_inputs, const Packed& vq,
                          const Packed& vs) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat);
  auto x2 = flat(x);
  const int64_t N = q.size(0), K = q.size(1), G = K / s.size(1);
  TORCH_CHECK(x2.size(1) == K && G * s.size(1) == K);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  const float* xp = x2.data_ptr<float>();
  const int64_t S = s.size(1);
  auto deq = [&](int64_t n, int64_t k0, int64_t kc, float* out) {
#ifdef WOQ_SIMD
    if (G % W == 0) return deq_row_i8_vec(qp + n * K, sp + n * S, k0, kc, G, out);
#endif
    deq_row_i8(qp + n * K, sp + n * S, k0, kc, G, out);
  };
  const int64_t M = x2.size(0);
#ifdef WOQ_VNNI
  if (use_vnni(int8_inputs, vq, vs, N, K, at::kChar)) {
    const Q8Rows xr(xp, M, K, true);
    const int8_t* wq = vq->data_ptr<int8_t>();
    const float* ws = vs->data_ptr<float>();
    const int64_t B = K / 32;
    return vnni_rows(x2, N, bias, [&](auto mr, int64_t grp, int64_t i0, float* out) {
             vnni_i8_tile<decltype(mr)::value>(wq + grp * B * 512, ws + grp * B * 32, B, xr.q.data() + i0 * K,
                                               xr.d.data() + i0 * B, K, out, N);
           }).reshape(out_shape(x, N));
  }
#endif
#if defined(WOQ_SIMD) && defined(__AVX2__)
  if (int8_inputs && G % 32 == 0) {
    const Q8Rows xr(xp, M, K);
    auto pass = [&](auto rw, int64_t n, int64_t rows, float* out) {
      row_groups(M, [&](auto mr, int64_t i) {
        dot_rows_i8_q8<decltype(rw)::value, decltype(mr)::value>(xr.q.data() + i * K, xr.d.data() + i * K / 32,
                                                                 qp + n * K, sp + n * S, K, G, rows, out + i * N, N);
      });
    };
    return (M == 1 ? few_rows<R>(M, x2, N, bias, pass) : few_rows<2>(M, x2, N, bias, pass)).reshape(out_shape(x, N));
  }
#endif
#ifdef WOQ_SIMD
  if (M >= W && G % W == 0) return tiled_rows(x2, N, bias, deq).reshape(out_shape(x, N));
#endif
  if (M > 1) return many_rows(x2, N, bias, deq).reshape(out_shape(x, N));
#ifdef WOQ_SIMD
  if (G % W == 0)  // one row: memory-bound, each weight byte read once
    return few_rows<R>(1, x2, N, bias, [&](auto, int64_t n, int64_t rows, float* out) {
             dot_rows_i8(xp, qp + n * K, sp + n * S, K, G, rows, out);
           }).reshape(out_shape(x, N));
#endif
  return each_row(x2, N, bias, [&](int64_t n) { return dot_row_i8(xp, qp + n * K, sp + n * S, K, G); })
      .reshape(out_shape(x, N));
}

torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                          const torch::Tensor& m, const c10::optional<torch::Tensor>& bias, bool int8_inputs,
                          const Packed& vq, const Packed& vs) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kByte);
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf, "int4 scales and minimums are float16");
  auto x2 = flat(x);
  const int64_t N = q.size(0), K = q.size(1) * 2, S = K / 32;
  TORCH_CHECK(x2.size(1) == K && K % 32 == 0 && d.size(1) == S && m.size(1) == S);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const c10::Half *dp = d.data_ptr<c10::Half>(), *mp = m.data_ptr<c10::Half>();
  const float* xp = x2.data_ptr<float>();
  const int64_t M = x2.size(0);
  auto deq = [&](int64_t n, int64_t k0, int64_t kc, float* out) {  // k0 and kc: multiples of 32
#ifdef WOQ_SIMD
    deq_row_i4_vec(qp + (n * K + k0) / 2, dp + n * S + k0 / 32, mp + n * S + k0 / 32, kc, out);
#else
    deq_row_i4(qp + (n * K + k0) / 2, dp + n * S + k0 / 32, mp + n * S + k0 / 32, kc, out);
#endif
  };
#ifdef WOQ_VNNI
  if (use_vnni(int8_inputs, vq, vs, N, K, at::kByte)) {
    const Q8Rows xr(xp, M, K);
    const uint8_t* wq = vq->data_ptr<uint8_t>();
    const c10::Half* wdm = vs->data_ptr<c10::Half>();
    return vnni_rows(x2, N, bias, [&](auto mr, int64_t grp, int64_t i0, float* out) {
             vnni_i4_tile<decltype(mr)::value>(wq + grp * S * 256, wdm + grp * S * 32, S, xr.q.data() + i0 * K,
                                               xr.d.data() + i0 * S, xr.sum.data() + i0 * S, K, out, N);
           }).reshape(out_shape(x, N));
  }
#endif
#if defined(WOQ_SIMD) && defined(__AVX2__)
  if (int8_inputs) {
    const Q8Rows xr(xp, M, K);
    auto pass = [&](auto rw, int64_t n, int64_t rows, float* out) {
      row_groups(M, [&](auto mr, int64_t i) {
        dot_rows_i4_q8<decltype(rw)::value, decltype(mr)::value>(xr.q.data() + i * K, xr.d.data() + i * S,
                                                                 xr.sum.data() + i * S, qp + n * K / 2, dp + n * S,
                                                                 mp + n * S, K, rows, out + i * N, N);
      });
    };
    return (M == 1 ? few_rows<R>(M, x2, N, bias, pass) : few_rows<2>(M, x2, N, bias, pass)).reshape(out_shape(x, N));
  }
#endif
#ifdef WOQ_SIMD
  if (M >= W) return tiled_rows(x2, N, bias, deq).reshape(out_shape(x, N));
#endif
  if (M > 1) return many_rows(x2, N, bias, deq).reshape(out_shape(x, N));
  std::vector<float> xsum(S);  // each block's sum of inputs, for the minimums
  for (int64_t g = 0; g < S; ++g) {
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (int j = 0; j < 32; ++j) t += xp[g * 32 + j];
    xsum[g] = t;
  }
  const float* xs = xsum.data();
#ifdef WOQ_SIMD
  // one row: memory-bound, each weight byte read once
  return few_rows<R>(1, x2, N, bias, [&](auto, int64_t n, int64_t rows, float* out) {
           dot_rows_i4(xp, xs, qp + n * K / 2, dp + n * S, mp + n * S, K, rows, out);
         }).reshape(out_shape(x, N));
#else
  return each_row(x2, N, bias, [&](int64_t n) {
           return dot_row_i4(xp, xs, qp + n * K / 2, dp + n * S, mp + n * S, K);
         }).reshape(out_shape(x, N));
#endif
}

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (softmax after subtracting the maximum): Cephes' expf, 2 ** n times a degree-6
// polynomial on [-ln 2 / 2, ln 2 / 2], about 1e-7 relative; plain code the compiler vectorizes.
struct ExpConstants {
  static constexpr float lowest = -87.f, log2e = 1.44269504f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
  static constexpr float poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                    4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

inline float fast_exp(float x) {
  using C = ExpConstants;
  x = std::max(x, C::lowest);
  const float n = std::floor(x * C::log2e + 0.5f);
  const float r = x - n * C::ln2_hi - n * C::ln2_lo;
  float p = C::poly[0];
  for (int i = 1; i < 6; ++i) p = p * r + C::poly[i];
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

#ifdef WOQ_SIMD
// fast_exp over a vector, the same steps
inline Vec::T fast_exp(Vec::T x) {
  using C = ExpConstants;
  x = Vec::max(x, Vec::set1(C::lowest));
  const Vec::T n = Vec::floor(Vec::fma(x, Vec::set1(C::log2e), Vec::set1(0.5f)));
  const Vec::T r = Vec::fma(n, Vec::set1(-C::ln2_lo), Vec::fma(n, Vec::set1(-C::ln2_hi), x));
  Vec::T p = Vec::set1(C::poly[0]);
  for (int i = 1; i < 6; ++i) p = Vec::fma(p, r, Vec::set1(C::poly[i]));
  p = Vec::add(Vec::fma(Vec::mul(p, r), r, r), Vec::set1(1.f));
  return Vec::mul(p, Vec::pow2(n));
}
#endif

// silu(g) * u = g * sigmoid(g) * u, the sigmoid from one exponential of -|g|
inline float silu_mul_one(float g, float u) {
  const float e = fast_exp(-std::fabs(g)), r = 1.f / (1.f + e);
  return g * (g >= 0.f ? r : e * r) * u;
}

// the caches the vector paths of decode attention read: float32 and int8
template <typename T>
constexpr bool vector_cache = std::is_same_v<T, float> || std::is_same_v<T, int8_t>;

inline bool vector_rows(int64_t D) {
#ifdef WOQ_SIMD
  return D % W == 0;
#else
  return false;
#endif
}

#ifdef WOQ_SIMD
// rows [n, D] of an int8 cache into float out [n, D] (their scales are applied to the scores)
inline void rows_to_float(const int8_t* p, int64_t n, int64_t D, float* out) {
  for (int64_t j = 0; j < n * D; j += W) Vec::store(out + j, Vec::int8s(p + j));
}

// W elements of a float32 or int8 cache as floats
template <typename T>
inline Vec::T cache_vec(const T* p) {
  if constexpr (std::is_same_v<T, float>) return Vec::load(p);
  else return Vec::int8s(p);
}

// scores[g * stride + l] = (q_g . k_l) * scale * (ks[l], or 1) for the group's query heads q [group, D] and
// float keys kf [n, D], four positions at a time (one horizontal reduction for the four)
inline void vector_scores(const float* q, const float* kf, const c10::Half* ks, int64_t n, int64_t stride, int64_t D,
                          int64_t group, float scale, float* scores) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * D;
    float* sg = scores + g * stride;
    int64_t l = 0;
    for (; l + 4 <= n; l += 4) {
      const float* k0 = kf + l * D;
      Vec::T a0 = Vec::zero(), a1 = Vec::zero(), a2 = Vec::zero(), a3 = Vec::zero();
      for (int64_t j = 0; j < D; j += W) {
        const Vec::T qv = Vec::load(qg + j);
        a0 = Vec::fma(Vec::load(k0 + j), qv, a0);
        a1 = Vec::fma(Vec::load(k0 + D + j), qv, a1);
        a2 = Vec::fma(Vec::load(k0 + 2 * D + j), qv, a2);
        a3 = Vec::fma(Vec::load(k0 + 3 * D + j), qv, a3);
      }
      Vec::sum4(a0, a1, a2, a3, sg + l);
    }
    for (; l < n; ++l) {
      Vec::T acc = Vec::zero();
      for (int64_t j = 0; j < D; j += W) acc = Vec::fma(Vec::load(kf + l * D + j), Vec::load(qg + j), acc);
      sg[l] = Vec::sum(acc);
    }
    for (l = 0; l < n; ++l) sg[l] *= ks ? scale * half_to_float(ks[l]) : scale;
  }
}

// p[0 .. n) <- softmax(p) * (vs[l], or 1): the weights of the values as the cache stores them
inline void softmax_weights(float* p, const c10::Half* vs, int64_t n) {
  int64_t l = 0;
  Vec::T mv = Vec::set1(p[0]);
  for (; l + W <= n; l += W) mv = Vec::max(mv, Vec::load(p + l));
  float lanes[W], mx = p[0];
  Vec::store(lanes, mv);
  for (int64_t i = 0; i < W; ++i) mx = std::max(mx, lanes[i]);
  for (; l < n; ++l) mx = std::max(mx, p[l]);
  const Vec::T mxv = Vec::set1(mx);
  Vec::T sv = Vec::zero();
  for (l = 0; l + W <= n; l += W) {
    const Vec::T e = fast_exp(Vec::sub(Vec::load(p + l), mxv));
    Vec::store(p + l, e);
    sv = Vec::add(sv, e);
  }
  float sum = Vec::sum(sv);
  for (; l < n; ++l) sum += p[l] = fast_exp(p[l] - mx);
  const float inv = 1.f / sum;
  const Vec::T iv = Vec::set1(inv);
  for (l = 0; l + W <= n; l += W)
    Vec::store(p + l, vs ? Vec::mul(Vec::load(p + l), Vec::mul(iv, Vec::halves(vs + l))) : Vec::mul(Vec::load(p + l), iv));
  for (; l < n; ++l) p[l] *= vs ? inv * half_to_float(vs[l]) : inv;
}

// out[g, j .. j + MV W) = sum over l of p[g * stride + l] * v[l, j .. j + MV W) for G heads: each value
// converted once, in registers, for all G heads (G * MV accumulators, at most 12)
template <int G, int MV, typename T>
inline void weighted_values(const float* p, int64_t stride, const T* v, int64_t n, int64_t D, int64_t j, float* out) {
  Vec::T acc[G][MV];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < MV; ++u) acc[g][u] = Vec::zero();
  for (int64_t l = 0; l < n; ++l) {
    Vec::T vv[MV];
    for (int u = 0; u < MV; ++u) vv[u] = cache_vec(v + l * D + j + u * W);
    for (int g = 0; g < G; ++g) {
      const Vec::T pl = Vec::set1(p[g * stride + l]);
      for (int u = 0; u < MV; ++u) acc[g][u] = Vec::fma(pl, vv[u], acc[g][u]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < MV; ++u) Vec::store(out + g * D + j + u * W, acc[g][u]);
}

// the group's outputs [group, D] from its weights p [group, stride] and the values v [n, D]: heads six at a time,
// two vectors of each value at a time
template <typename T>
inline void vector_values(const float* p, int64_t stride, const T* v, int64_t n, int64_t D, int64_t group, float* out) {
  for (int64_t g0 = 0; g0 < group; g0 += 6)
    with_count<6>(std::min<int64_t>(6, group - g0), [&](auto heads) {
      constexpr int G = decltype(heads)::value;
      int64_t j = 0;
      for (; j + 2 * W <= D; j += 2 * W) weighted_values<G, 2>(p + g0 * stride, stride, v, n, D, j, out + g0 * D);
      if (j < D) weighted_values<G, 1>(p + g0 * stride, stride, v, n, D, j, out + g0 * D);
    });
}

#endif

// positions whose int8 keys the vector path converts to float at a time: 16 KB for D = 64, in L1
constexpr int64_t POSITION_BLOCK = 64;

// One query token per entry b against cached positions starts[b] .. lengths[b] - 1 of its cache row rows[b]
// (rows null: row b; starts null: from 0, else a sliding window's first position); each kv head's keys and
// values are read once for all the query heads that share it (grouped-query attention). An int8 cache
// (T = int8_t) carries one float16 scale per row, head and position in ks and vs; other caches pass null.
// A query's result depends only on its own row, positions and values: never on the other entries (the same
// numbers for a token whether it is decoded alone, among 32 rows, or prefilled in any chunk).
template <typename T>
void decode_attention_impl(const float* q, const T* k, const T* v, const c10::Half* ks, const c10::Half* vs,
                           const int64_t* lengths, const int64_t* rows, const int64_t* starts, float* out,
                           int64_t B, int64_t Hq, int64_t Hk, int64_t S, int64_t D, float scale) {
  const int64_t group = Hq / Hk;
  at::parallel_for(0, B * Hk, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores, vf;
    std::vector<float> kf(D), acc(D);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / Hk, kh = t % Hk, row = rows ? rows[b] : b;
      const int64_t end = std::max<int64_t>(1, std::min(lengths[b], S));
      const int64_t first = starts ? std::min(std::max<int64_t>(0, starts[b]), end - 1) : 0, n = end - first;
      const T* kp = k + ((row * Hk + kh) * S + first) * D;
      const T* vp = v + ((row * Hk + kh) * S + first) * D;
      const c10::Half* ksp = ks ? ks + (row * Hk + kh) * S + first : nullptr;
      const c10::Half* vsp = vs ? vs + (row * Hk + kh) * S + first : nullptr;
      scores.assign(group * n, 0.f);
      const float* qb = q + (b * Hq + kh * group) * D;  // the group's query heads, one after another
      float* ob = out + (b * Hq + kh * group) * D;
#ifdef WOQ_SIMD
      if constexpr (vector_cache<T>) {
        if (vector_rows(D)) {
          vf.resize(POSITION_BLOCK * D);
          for (int64_t l0 = 0; l0 < n; l0 += POSITION_BLOCK) {
            const int64_t nb = std::min(POSITION_BLOCK, n - l0);
            const float* kf = vf.data();
            if constexpr (std::is_same_v<T, float>) kf = kp + l0 * D;
            else rows_to_float(kp + l0 * D, nb, D, vf.data());
            vector_scores(qb, kf, ksp ? ksp + l0 : nullptr, nb, n, D, group, scale, scores.data() + l0);
          }
          for (int64_t g = 0; g < group; ++g) softmax_weights(scores.data() + g * n, vsp, n);
          vector_values(scores.data(), n, vp, n, D, group, ob);
          continue;
        }
      }
#endif
      for (int64_t l = 0; l < n; ++l) {
        const float ksc = ksp ? static_cast<float>(ksp[l]) * scale : scale;
        for (int64_t d = 0; d < D; ++d) kf[d] = to_float(kp[l * D + d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = qb + g * D;
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
          sc[l] = fast_exp(sc[l] - mx);
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
        std::copy(acc.begin(), acc.end(), ob + g * D);
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

// q [B, Hq, D] float; k, v [rows, Hk, S, D] float, bfloat16, float16 or int8 (with ks, vs); lengths [B];
// rows [B] each query's cache row (none: rows 0 .. B-1); starts [B] its first attended position (none: 0)
// -> [B, Hq, D]
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const Scales& ks, const Scales& vs, const torch::Tensor& lengths, double scale,
                               const c10::optional<torch::Tensor>& rows, const c10::optional<torch::Tensor>& starts) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.is_contiguous() && v.is_contiguous() && k.dim() == 4);
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && lengths.scalar_type() == at::kLong);
  auto qc = q.contiguous();
  auto lc = lengths.contiguous();
  const int64_t B = qc.size(0), Hq = qc.size(1), D = qc.size(2), Hk = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(3) == D && Hq % Hk == 0 && lc.size(0) == B);
  torch::Tensor rc, sc;
  if (rows.has_value()) {
    rc = rows->contiguous();
    TORCH_CHECK(rc.scalar_type() == at::kLong && rc.numel() == B, "rows: one long per query");
    TORCH_CHECK(B == 0 || (rc.min().item<int64_t>() >= 0 && rc.max().item<int64_t>() < k.size(0)), "rows out of range");
  } else {
    TORCH_CHECK(k.size(0) >= B);
  }
  if (starts.has_value()) {
    sc = starts->contiguous();
    TORCH_CHECK(sc.scalar_type() == at::kLong && sc.numel() == B, "starts: one long per query");
  }
  auto out = torch::empty({B, Hq, D}, qc.options());
  const c10::Half *ksp = scales_of(ks, k), *vsp = scales_of(vs, v);
  dispatch_cache(k, [&](auto zero) {
    using T = decltype(zero);
    decode_attention_impl<T>(qc.data_ptr<float>(), static_cast<const T*>(k.data_ptr()),
                             static_cast<const T*>(v.data_ptr()), ksp, vsp, lc.data_ptr<int64_t>(),
                             rows.has_value() ? rc.data_ptr<int64_t>() : nullptr,
                             starts.has_value() ? sc.data_ptr<int64_t>() : nullptr, out.data_ptr<float>(), B, Hq,
                             Hk, S, D, static_cast<float>(scale));
  });
  return out;
}

// elements per piece of a parallel elementwise pass: a decode step's rows stay on one thread
constexpr int64_t ELEMENTWISE_GRAIN = 32768;

// RMSNorm of each row of x [M, H] (float32): x / sqrt(mean(x^2) + eps) * w
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat);
  auto x2 = flat(x);
  const int64_t M = x2.size(0), H = x2.size(1);
  auto y = torch::empty_like(x2);
  const float *xp = x2.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, ELEMENTWISE_GRAIN / H), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* r = xp + i * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < H; ++j) ss += r[j] * r[j];
      const float inv = 1.f / std::sqrt(ss / H + static_cast<float>(eps));
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) yp[i * H + j] = wp[j] * (r[j] * inv);
    }
  });
  return y.view(x.sizes());
}

// silu(gate) * up of x [..., 2F] = [gate | up] -> [..., F] in one pass: gate * sigmoid(gate) * up, the
// sigmoid from one exponential of -|gate|
torch::Tensor silu_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) % 2 == 0);
  auto x2 = flat(x);
  const int64_t M = x2.size(0), F = x2.size(1) / 2;
  auto y = torch::empty({M, F}, x2.options());
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, ELEMENTWISE_GRAIN / F), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float *g = xp + i * 2 * F, *u = g + F;
      float* o = yp + i * F;
      int64_t j = 0;
#ifdef WOQ_SIMD
      for (; j + W <= F; j += W) {
        const Vec::T gv = Vec::load(g + j), one = Vec::set1(1.f);
        const Vec::T e = fast_exp(Vec::sub(Vec::zero(), Vec::abs(gv))), r = Vec::div(one, Vec::add(one, e));
        Vec::store(o + j, Vec::mul(Vec::mul(gv, Vec::select_nonnegative(gv, r, Vec::mul(e, r))), Vec::load(u + j)));
      }
#endif
      for (; j < F; ++j) o[j] = silu_mul_one(g[j], u[j]);
    }
  });
  return y.view(out_shape(x, F));
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

// The heads are split between the threads (never the positions: a prefill's padding tokens all write
// their row's scratch position); a decode step's rows stay on one thread.
template <typename T>
void rope_store_impl(const float* qkv, const float* cos, const float* sin, T* kc, T* vc, c10::Half* ks,
                     c10::Half* vs, const int64_t* pos, const int64_t* rows, float* q, int64_t B, int64_t Hq,
                     int64_t Hk, int64_t S, int64_t D) {
  const int64_t width = (Hq + 2 * Hk) * D;
  at::parallel_for(0, Hq + Hk, B * width < ELEMENTWISE_GRAIN ? Hq + Hk : 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> tmp(D);
    for (int64_t b = 0; b < B; ++b) {
      const float* row = qkv + b * width;
      const float *c = cos + b * D, *s = sin + b * D;
      for (int64_t h = h0; h < h1; ++h) {
        if (h < Hq) {
          rope_row(row + h * D, c, s, D, q + (b * Hq + h) * D);
          continue;
        }
        const int64_t kh = h - Hq, at = ((rows ? rows[b] : b) * Hk + kh) * S + pos[b];
        rope_row(row + h * D, c, s, D, tmp.data());
        store_head(tmp.data(), D, kc + at * D, ks ? ks + at : nullptr);
        store_head(row + (Hq + Hk + kh) * D, D, vc + at * D, vs ? vs + at : nullptr);
      }
    }
  });
}

}  // namespace

// Rotary embedding on the query and key heads of qkv [B, (Hq + 2 Hk) * D] (B tokens: a decode step's rows,
// or a prefill's tokens flattened), each token's key and value written into the caches [rows, Hk, S, D]
// at position pos[b] of cache row rows[b] (none: row b), an int8 cache's float16 scales into ks, vs
// [rows, Hk, S]; returns q [B, Hq, D].
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor& kc, torch::Tensor& vc, const Scales& ks, const Scales& vs,
                         const torch::Tensor& pos, int64_t Hq, const c10::optional<torch::Tensor>& rows) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && kc.is_contiguous());
  TORCH_CHECK(pos.scalar_type() == at::kLong && kc.scalar_type() == vc.scalar_type() && vc.is_contiguous());
  auto x = flat(qkv);
  auto cc = flat(cos), sc = flat(sin), pc = pos.reshape({-1}).contiguous();
  const int64_t B = x.size(0), Hk = kc.size(1), S = kc.size(2), D = kc.size(3);
  TORCH_CHECK(x.size(1) == (Hq + 2 * Hk) * D && pc.size(0) == B && cc.size(0) == B && cc.size(1) == D);
  torch::Tensor rc;
  if (rows.has_value()) {
    rc = rows->reshape({-1}).contiguous();
    TORCH_CHECK(rc.scalar_type() == at::kLong && rc.size(0) == B);
    const int64_t* r = rc.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(r[b] >= 0 && r[b] < kc.size(0), "cache row out of range");
  } else {
    TORCH_CHECK(kc.size(0) >= B);
  }
  const int64_t* p = pc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(p[b] >= 0 && p[b] < S, "cache position out of range");
  auto q = torch::empty({B, Hq, D}, x.options());
  auto* ksp = const_cast<c10::Half*>(scales_of(ks, kc));
  auto* vsp = const_cast<c10::Half*>(scales_of(vs, vc));
  dispatch_cache(kc, [&](auto zero) {
    using T = decltype(zero);
    rope_store_impl<T>(x.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), static_cast<T*>(kc.data_ptr()),
                       static_cast<T*>(vc.data_ptr()), ksp, vsp, p, rows.has_value() ? rc.data_ptr<int64_t>() : nullptr,
                       q.data_ptr<float>(), B, Hq, Hk, S, D);
  });
  return q;
}

// A quantized linear layer as the kernels take it: 4-bit (q uint8, a = d, b = m) or 8-bit (q int8, a = s).
struct QuantLinear {
  torch::Tensor q, a;
  c10::optional<torch::Tensor> b, bias;
  bool int8_inputs;
  Packed vq, vs;
  torch::Tensor operator()(const torch::Tensor& x) const {
    return q.scalar_type() == at::kByte ? linear_int4(x, q, a, *b, bias, int8_inputs, vq, vs)
                                        : linear_int8(x, q, a, bias, int8_inputs, vq, vs);
  }
};
using LinearParts = std::tuple<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                               c10::optional<torch::Tensor>, bool, Packed, Packed>;  // q, a, b, bias, int8_inputs, VNNI q, scales
using LayerParts = std::tuple<torch::Tensor, LinearParts, LinearParts, torch::Tensor, LinearParts, LinearParts>;

// The decoder layers of a llama-family decode step in one call (compact.py's CompactLM._decode, same kernels,
// same order): no Python between the dozen calls of each layer. The weights are held; the cache and the
// step's positions are passed in.
class Decoder {
 public:
  Decoder(const std::vector<LayerParts>& layers, int64_t heads, double eps) : heads_(heads), eps_(eps) {
    auto linear = [](const LinearParts& p) {
      auto [q, a, b, bias, int8_inputs, vq, vs] = p;
      TORCH_CHECK(q.scalar_type() == at::kChar || b.has_value(), "a 4-bit linear needs its minimums");
      return QuantLinear{q, a, b, bias, int8_inputs, vq, vs};
    };
    for (const auto& [attn_norm, qkv, o, mlp_norm, gate_up, down] : layers)
      layers_.push_back({attn_norm, mlp_norm, linear(qkv), linear(o), linear(gate_up), linear(down)});
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
      auto q = rope_store(l.qkv(rms_norm(h, l.attn_norm, eps_)), cos, sin, keys[i], values[i], ks, vs, write, heads_, c10::nullopt);
      auto a = decode_attention(q, keys[i], values[i], ks, vs, lengths, 1.0 / std::sqrt(double(keys[i].size(3))),
                                c10::nullopt, c10::nullopt);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // module_local: the module may be imported again from another path in one process (a relative and an
  // absolute model cache), which would otherwise register the class twice and fail the import
  py::class_<Decoder>(m, "Decoder", py::module_local(), "a llama-family decode step's layers over quantized weights, in one call")
      .def(py::init<const std::vector<LayerParts>&, int64_t, double>(), py::arg("layers"), py::arg("heads"),
           py::arg("eps"))
      .def("forward", &Decoder::forward);
  m.def("linear_int8", &linear_int8, "x @ (q * s)^T, 8-bit weight groups", py::arg("x"), py::arg("q"), py::arg("s"),
        py::arg("bias"), py::arg("int8_inputs") = false, py::arg("vnni_q") = py::none(), py::arg("vnni_s") = py::none());
  m.def("linear_int4", &linear_int4, "x @ (d * q + m)^T, 4-bit weight groups of 32", py::arg("x"), py::arg("q"),
        py::arg("d"), py::arg("m"), py::arg("bias"), py::arg("int8_inputs") = false, py::arg("vnni_q") = py::none(),
        py::arg("vnni_s") = py::none());
  m.def("vnni", &vnni, "whether the VNNI tiles were built (AVX512-VNNI)");
  m.def("decode_attention", &decode_attention, "one query token per entry over its row's cached positions",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("ks"), py::arg("vs"), py::arg("lengths"), py::arg("scale"),
        py::arg("rows") = py::none(), py::arg("starts") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over the last dimension's halves [gate | up]");
  m.def("rope_store", &rope_store, "rotary embedding, each token's key and value into the cache", py::arg("qkv"),
        py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("key_scales"),
        py::arg("value_scales"), py::arg("positions"), py::arg("heads"), py::arg("rows") = py::none());
}
