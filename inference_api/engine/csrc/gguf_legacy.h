// GGUF's blocks of 32 weights (ggml-common.h): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL, each as block_form.h reads
// a block: its scales (w = d * code + m per sub-block) and its codes, 32 bytes a chunk in the weights' order.
#pragma once
#include "common.h"

namespace woq {
#ifdef WOQ_SIMD

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// the 16 bytes at p as 32 nibbles: low nibbles are weights 0..15, high nibbles 16..31
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p), low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

// the 32 bits at p as 32 bytes of 16 where the bit is set, else 0 (the fifth bit of Q5 weights)
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i hit = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));
  return _mm256_and_si256(hit, _mm256_set1_epi8(16));
}

// The traits every block type gives: TYPE (ggml's type number), QK weights in BYTES bytes, a scale (and minimum)
// per SUB weights; SIGNED codes are int8 (else unsigned bytes); MINS: some m is not zero.
struct Q4_0 {
  static constexpr int TYPE = 2, QK = 32, BYTES = 18, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) { d[0] = f16_at(b), m[0] = -8.f * d[0]; }
  static __m256i codes(const uint8_t* b, int) { return nibbles32(b + 2); }
};

struct Q4_1 {
  static constexpr int TYPE = 3, QK = 32, BYTES = 20, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) { d[0] = f16_at(b), m[0] = f16_at(b + 2); }
  static __m256i codes(const uint8_t* b, int) { return nibbles32(b + 4); }
};

struct Q5_0 {
  static constexpr int TYPE = 6, QK = 32, BYTES = 22, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) { d[0] = f16_at(b), m[0] = -16.f * d[0]; }
  static __m256i codes(const uint8_t* b, int) { return _mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2)); }
};

struct Q5_1 {
  static constexpr int TYPE = 7, QK = 32, BYTES = 24, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) { d[0] = f16_at(b), m[0] = f16_at(b + 2); }
  static __m256i codes(const uint8_t* b, int) { return _mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4)); }
};

struct Q8_0 {
  static constexpr int TYPE = 8, QK = 32, BYTES = 34, SUB = 32;
  static constexpr bool SIGNED = true, MINS = false;
  static void scales(const uint8_t* b, float* d, float* m) { d[0] = f16_at(b), m[0] = 0.f; }
  static __m256i codes(const uint8_t* b, int) { return _mm256_loadu_si256((const __m256i*)(b + 2)); }
};

// IQ4_NL: each nibble indexes llama.cpp's 16 non-linear int8 levels
struct IQ4_NL {
  static constexpr int TYPE = 20, QK = 32, BYTES = 18, SUB = 32;
  static constexpr bool SIGNED = true, MINS = false;
  static void scales(const uint8_t* b, float* d, float* m) { d[0] = f16_at(b), m[0] = 0.f; }
  static __m256i codes(const uint8_t* b, int) {
    const __m256i levels = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
    return _mm256_shuffle_epi8(levels, nibbles32(b + 2));
  }
};

#endif  // WOQ_SIMD
}  // namespace woq
