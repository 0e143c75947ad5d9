// Inputs rounded to int8 blocks of 32, as llama.cpp's Q8 activations (--dtype auto), or of 256 against the
// k-quants' super-blocks, as its Q8_K.
#pragma once
#include "common.h"

namespace woq {
#ifdef WOQ_SIMD

// Rows of inputs rounded to int8 blocks of 32 (127 steps of each block's own scale, max |x| / 127, to nearest
// even): q [M, K], each block's step d and the sum of its rounded inputs, d * sum(q) [M, K / 32], which the
// weights' minimums multiply (llama.cpp's Q8_1 s: w = d q + m times the rounded inputs, the whole weight's product
// rounded alike; the exact float sum instead left m's share out of the rounding, and the error of d q alone, codes
// 0 .. 15 all of one sign, did not cancel: twice the error on Q4_1, 0.994 cosine where llama.cpp's vectors were
// 0.9992 of the float ones). halves: also each half block's d * sum(q) [M, K / 16] (the minimums of blocks with
// sub-blocks of 16 multiply them). less128 [M, K / 32]: -128 times each block's integer sum of its rounded values,
// which takes back the 128 that the VNNI tiles' unsigned side carries (signed codes and 8-bit weights go in plus
// 128): exact as an int32 and as a float.
struct Q8Rows {
  Buffer<int8_t> q;
  Buffer<float> d, sum, half;
  Buffer<int32_t> less128;
  Q8Rows(const float* x, int64_t M, int64_t K, bool halves = false)
      : q(M * K), d(M * K / 32), sum(M * K / 32), half(halves ? M * K / 16 : 0), less128(M * K / 32) {
    const int64_t blocks = M * K / 32;
    auto run = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) block(x + b * 32, b, halves);
    };
    at::parallel_for(0, blocks, PARALLEL_GRAIN / 32, run);
  }

 private:
  void block(const float* xb, int64_t b, bool halves) {
    int s0, s1;  // the two half blocks' sums of the rounded values
#ifdef __AVX512F__
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // nearest even
    const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128((__m128i*)(q.data() + b * 32), _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128((__m128i*)(q.data() + b * 32 + 16), _mm512_cvtsepi32_epi8(qh));
    s0 = _mm512_reduce_add_epi32(ql), s1 = _mm512_reduce_add_epi32(qh);
#else
    float mx = 0.f;
    for (int j = 0; j < 32; ++j) mx = std::max(mx, std::fabs(xb[j]));
    const float inv = mx > 0.f ? 127.f / mx : 0.f;
    s0 = s1 = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
      q[b * 32 + j] = static_cast<int8_t>(v);
      (j < 16 ? s0 : s1) += v;
    }
#endif
    const float step = mx / 127.f;
    d[b] = step;
    less128[b] = -128 * (s0 + s1);
    sum[b] = step * static_cast<float>(s0 + s1);
    if (halves) half[2 * b] = step * static_cast<float>(s0), half[2 * b + 1] = step * static_cast<float>(s1);
  }
};

// Rows of inputs rounded to int8 blocks of 256 (llama.cpp's Q8_K, the inputs of the k-quants): q [M, K], each
// block's step d = max |x| / 127 [M, K / 256], and the sums of each 16 of its rounded values, bsum [M, K / 16]
// (the sub-blocks' minimums multiply them). With integer sub-block scales a super-block's dot product is then one
// integer sum, scaled once.
struct Q8KRows {
  Buffer<int8_t> q;
  Buffer<float> d;
  Buffer<int16_t> bsum, bsum32;  // each 16 inputs' integer sum, each 32's
  Q8KRows(const float* x, int64_t M, int64_t K) : q(M * K), d(M * K / 256), bsum(M * K / 16), bsum32(M * K / 32) {
    const int64_t blocks = M * K / 256;
    auto run = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) block(x + b * 256, b);
      for (int64_t j = b0 * 8; j < b1 * 8; ++j) bsum32[j] = static_cast<int16_t>(bsum[2 * j] + bsum[2 * j + 1]);
    };
    at::parallel_for(0, blocks, PARALLEL_GRAIN / 256, run);
  }

 private:
  void block(const float* xb, int64_t b) {
    const float amax = max_abs(xb, 256);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    int8_t* out = q.data() + b * 256;
    for (int j = 0; j < 256; j += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), inv));  // nearest even
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), inv));
      const __m256i s = _mm256_add_epi32(a, c);  // |values| <= 127: the sum of 16 fits int16
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
      bsum[b * 16 + j / 16] = static_cast<int16_t>(_mm_cvtsi128_si32(t));
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
      const __m128i v16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      _mm_storeu_si128((__m128i*)(out + j), _mm_packs_epi16(w16, v16));
    }
    d[b] = amax / 127.f;
  }
};
#endif  // WOQ_SIMD
}  // namespace woq
