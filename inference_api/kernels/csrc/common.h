// What every unit of the CPU kernels shares: the vector unit (AVX-512, or AVX2 with FMA and F16C), a few
// helpers over it, and the tensors' flattening. The units: common.h (this), q8.h (int8 inputs), drivers.h
// (how rows of inputs pass over rows of weights), int_forms.h (the 4-bit and 8-bit layouts of quant.py),
// gguf_legacy.h, gguf_kquants.h and gguf_float.h (a GGUF tensor's own blocks), block_form.h (the kernels over
// any of those blocks), linear.cpp (the one kernel-choice ladder), ops.cpp (attention, norms, rotary), sample.cpp (the
// sampler's draw), decoder.h and decoder.cpp (a decode step's layers in one call) and bindings.cpp (the only unit that
// reads torch/extension.h: the others read ATen alone, which compiles in a quarter of the time).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

// the BLAS that torch links (MKL in the x86 wheels): Fortran sgemm, column-major
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define WOQ_SIMD
#endif
#if defined(WOQ_SIMD) && defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define WOQ_VNNI
#endif

namespace woq {

template <int V>
using Int = std::integral_constant<int, V>;

// f(Int<n>) for a run-time n in 1 .. MAX (a kernel's tile size picked at compile time)
template <int MAX, typename F>
inline void with_count(int64_t n, F f) {
  if constexpr (MAX > 1) {
    if (n < MAX) return with_count<MAX - 1>(n, f);
  }
  f(Int<MAX>{});
}

inline at::Tensor flat(const at::Tensor& x) { return x.reshape({-1, x.size(-1)}).contiguous(); }

inline std::vector<int64_t> out_shape(const at::Tensor& x, int64_t N) {
  auto s = x.sizes().vec();
  s.back() = N;
  return s;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

#ifdef WOQ_SIMD
// the sum of 8 floats (AVX2, so on AVX-512 CPUs as well)
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// the 4 bytes at p in every 32-bit lane, each 4 loaded on their own, so that the broadcast is a load (vpbroadcastd
// from memory): an input's 8 bytes loaded into a general register and split, as a memcpy of two int32 compiles to,
// move each half into a vector on the one port that does that, one a cycle, where a Zen 5 runs two vpdpbusd a cycle
// (Qwen2.5 1.5B's Q4_K gate through the packed tile at 16 rows on the AVX512-VNNI level: 0.49 -> 0.33 ms)
inline int32_t load4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline __m256i bcast4_256(const void* p) { return _mm256_set1_epi32(load4(p)); }
#ifdef __AVX512F__
inline __m512i bcast4_512(const void* p) { return _mm512_set1_epi32(load4(p)); }
#endif

// body(0), ..., body(N - 1): the AVX2 tiles' steps over one weight vector's loads. Rolled for several input rows:
// unrolled, GCC computed every product of the steps first and spilled them all from the 16 ymm registers, a store
// and a load each (Qwen2.5 1.5B's Q4_K gate at 32 rows: 2.24 -> 1.76 ms, at 2 rows 0.17 -> 0.15); unrolled for one,
// where a step's work is too little to pay the loop (the gate at one row: 0.11 -> 0.10 ms)
template <int MR, int N, typename Body>
inline void avx2_steps(Body body) {
  if constexpr (MR == 1) {
#pragma GCC unroll 16
    for (int s = 0; s < N; ++s) body(s);
  } else {
#pragma GCC unroll 1
    for (int s = 0; s < N; ++s) body(s);
  }
}

// the sum of 8 int32 lanes (exact, in any order)
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
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
  // the sums of four vectors into out[0..4), each the same additions in the same order as sum (GCC's
  // _mm512_reduce_add_ps: lane i + lane i + 8, then + 4, then + 2, then + 1), done for the four at once
  static void sum4(T a, T b, T c, T d, float* out) {
    const T ab = add(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)), _mm512_shuffle_f32x4(a, b, 0x44));
    const T cd = add(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)), _mm512_shuffle_f32x4(c, d, 0x44));
    // [a b c d], four lanes each: lanes i + 4 k of each vector summed, as sum sums them
    const T q = add(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)), _mm512_shuffle_f32x4(ab, cd, 0x88));
    const T h = add(q, _mm512_permute_ps(q, _MM_SHUFFLE(1, 0, 3, 2)));
    const T s = add(h, _mm512_permute_ps(h, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);  // lanes 0, 4, 8, 12
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, s)));
  }
  static T halves(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static T bf16s(const c10::BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static T int8s(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T abs(T a) { return _mm512_abs_ps(a); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  // v rounded to nearest even (the default rounding, as std::nearbyint), within -127 .. 127, as W int8 at p
  static void store_int8(T v, int8_t* p) {
    const __m512i r = _mm512_min_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(127));
    _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(_mm512_max_epi32(r, _mm512_set1_epi32(-127))));
  }
  static T floor(T a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // 2 ** n for whole numbers n in [-126, 127]
  static T pow2(T n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  // where c >= 0: a, else b
  static T select_nonnegative(T c, T a, T b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, zero(), _CMP_GE_OQ), b, a);
  }
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
  static T bf16s(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static T int8s(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T abs(T a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static void store_int8(T v, int8_t* p) {
    const __m256i r =
        _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w, w));
  }
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

// std::vector's allocator but that sizing a vector leaves trivial elements uninitialized: the kernels' buffers whose
// every element is written before it is read (the rounded inputs of a call) skip the memset the sizing would do
// (a 32-row decode step of SmolLM2-135M spent 1 ms of it on the main thread while the other waited)
template <typename T>
struct NoInit : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = NoInit<U>;
  };
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <typename T>
using Buffer = std::vector<T, NoInit<T>>;

// past this many elements a pass over a call's rows (rounding the inputs, a norm, the rotary) runs in parallel, in
// pieces of about as many (the grain at::parallel_for takes, in the pass's rows or blocks): a 32-row decode step's
// (18,432 inputs of 576 on SmolLM2-135M) split between the cores instead of one core working while the other waits
// at the next barrier; one row's stay on one thread
constexpr int64_t PARALLEL_GRAIN = 8192;
constexpr int R = 4;      // weight rows per pass of the one-row kernel: independent accumulators, x loaded once
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
// One row with int8 inputs (--dtype auto): x rounded per block of 32 to 127 steps of its own scale, as
// llama.cpp's Q8 activations, so a block's dot product is two integer instructions (u8 x s8 pairs, then
// pairs of those) instead of float conversions of every weight. 256-bit AVX2, on AVX-512 CPUs too.

// sum of the 32 products of u8 a and s8 b, as 8 int32 lanes, in float
inline __m256 dot_u8s8(__m256i a, __m256i b) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}

// the same without the 16-bit saturation of the pairs: one vpdpbusd where the CPU has AVX512-VNNI, else pairs of
// 16-bit sums, exact while each pair's sum fits (|a| * |b| * 2 < 32768: codes up to 127 against int8 inputs)
inline __m256i dot_u8s8_i32(__m256i a, __m256i b) {
#ifdef WOQ_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}
// the 8 lanes of acc as outputs 8h .. 8h + 7 of a group of 16 weight rows at y, as far as its first rows
inline void store_half(__m256 acc, int h, int64_t rows, float* y) {
  alignas(32) float out[8];
  _mm256_store_ps(out, acc);
  for (int64_t r = 8 * h; r < std::min<int64_t>(rows, 8 * h + 8); ++r) y[r] = out[r - 8 * h];
}
#endif  // WOQ_SIMD

// the largest magnitude of x[0 .. n) (exact in any order: the vector lanes, then the tail)
inline float max_abs(const float* x, int64_t n) {
  int64_t i = 0;
  float m = 0.f;
#ifdef WOQ_SIMD
  Vec::T v = Vec::zero();
  for (; i + W <= n; i += W) v = Vec::max(v, Vec::abs(Vec::load(x + i)));
  alignas(64) float lanes[W];
  Vec::store(lanes, v);
  for (int l = 0; l < W; ++l) m = std::max(m, lanes[l]);
#endif
  for (; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

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

}  // namespace woq
