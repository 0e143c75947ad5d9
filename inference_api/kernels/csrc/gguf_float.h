// GGUF's float16 and bfloat16 weights, read in blocks of 32 as block_form.h reads the quantized types (no codes:
// the float kernels only).
#pragma once
#include "common.h"

namespace woq {
#ifdef WOQ_SIMD

struct F16 {
  static constexpr int TYPE = 1, QK = 32, BYTES = 64;
  static void deq(const uint8_t* b, float* out) {
    for (int j = 0; j < 32; j += 8)
      _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 2 * j))));
  }
};

struct BF16 {
  static constexpr int TYPE = 30, QK = 32, BYTES = 64;
  static void deq(const uint8_t* b, float* out) {
    for (int j = 0; j < 32; j += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(b + 2 * j)));
      _mm256_storeu_ps(out + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
};

#endif  // WOQ_SIMD
}  // namespace woq
