// Inputs rounded to int8 blocks of 32, as llama.cpp's Q8 activations (--dtype auto).
#pragma once
#include "common.h"

namespace woq {
#ifdef WOQ_SIMD

// Rows of inputs rounded to int8 blocks of 32 (127 steps of each block's own scale, max |x| / 127, to nearest
// even): q [M, K], each block's step d and float sum [M, K / 32]. plus128: q holds the rounded values plus 128,
// as bytes (the unsigned side of the VNNI tiles over int8 weights). halves: also each half block's float sum
// [M, K / 16] (the minimums of blocks with sub-blocks of 16 multiply them); each block's sum of its rounded values
// (qsum [M, K / 32], as float: the VNNI tiles over signed codes, which go in plus 128, take 128 of them back).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, sum, half, qsum;
  Q8Rows(const float* x, int64_t M, int64_t K, bool plus128 = false, bool halves = false)
      : q(M * K), d(M * K / 32), sum(M * K / 32), half(halves ? M * K / 16 : 0), qsum(M * K / 32) {
    const int64_t blocks = M * K / 32;
    auto run = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        block(x + b * 32, b, plus128 ? 128 : 0);
        if (halves) half_sums(x + b * 32, b);
      }
    };
    if (blocks >= 2048) at::parallel_for(0, blocks, 256, run);  // a prefill's rows
    else run(0, blocks);
  }

 private:
  void half_sums(const float* xb, int64_t b) {
    float s0 = 0.f, s1 = 0.f;
#pragma omp simd reduction(+ : s0, s1)
    for (int j = 0; j < 16; ++j) s0 += xb[j], s1 += xb[j + 16];
    half[2 * b] = s0, half[2 * b + 1] = s1;
  }

  void block(const float* xb, int64_t b, int offset) {
#ifdef __AVX512F__
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    const __m512i off = _mm512_set1_epi32(offset);
    const __m512i ql = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), off);  // nearest even
    const __m512i qh = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv)), off);
    _mm_storeu_si128((__m128i*)(q.data() + b * 32), offset ? _mm512_cvtusepi32_epi8(ql) : _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128((__m128i*)(q.data() + b * 32 + 16),
                     offset ? _mm512_cvtusepi32_epi8(qh) : _mm512_cvtsepi32_epi8(qh));
    sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    qsum[b] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh)) - 32 * offset);
#else
    float mx = 0.f, t = 0.f;
    for (int j = 0; j < 32; ++j) mx = std::max(mx, std::fabs(xb[j]));
    const float inv = mx > 0.f ? 127.f / mx : 0.f;
    int qs = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
      q[b * 32 + j] = static_cast<int8_t>(static_cast<uint8_t>(v + offset));
      qs += v;
    }
    qsum[b] = static_cast<float>(qs);
#pragma omp simd reduction(+ : t)
    for (int j = 0; j < 32; ++j) t += xb[j];
    sum[b] = t;
#endif
    d[b] = mx / 127.f;
  }
};
#endif  // WOQ_SIMD
}  // namespace woq
