// GGUF's k-quant super-blocks of 256 weights (ggml-common.h): Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, and IQ4_XS, read as
// gguf_legacy.h reads its blocks: per sub-block of 16 or 32 a scale d and minimum m (w = d * code + m; the codes
// unsigned, IQ4_XS's signed levels), and the codes of each chunk of 32 weights in the weights' order.
#pragma once
#include "gguf_legacy.h"

namespace woq {
#ifdef WOQ_SIMD

// Q4_K and Q5_K's eight 6-bit scales and minimums packed in 12 bytes, unpacked 4 bytes at a time as llama.cpp
// does, in registers (a store of 4-byte halves read back as 8 bytes stalls the load): byte j of sc is scale j, of
// mn minimum j
inline void k4_scale_bytes(const uint8_t* q, __m128i& sc, __m128i& mn) {
  uint32_t u0, u1, u2;
  std::memcpy(&u0, q, 4);
  std::memcpy(&u1, q + 4, 4);
  std::memcpy(&u2, q + 8, 4);
  const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  const uint64_t s = (u0 & k1) | static_cast<uint64_t>((u2 & k2) | (((u0 >> 6) & k3) << 4)) << 32;
  const uint64_t m = (u1 & k1) | static_cast<uint64_t>(((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4)) << 32;
  sc = _mm_cvtsi64_si128(static_cast<long long>(s));
  mn = _mm_cvtsi64_si128(static_cast<long long>(m));
}

// the scales and minimums as floats times d and -dmin
inline void scale_min_k4(const uint8_t* q, float dd, float dmin, float* d, float* m) {
  __m128i sc, mn;
  k4_scale_bytes(q, sc, mn);
  _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)), _mm256_set1_ps(dd)));
  _mm256_storeu_ps(m, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)), _mm256_set1_ps(-dmin)));
}

// the same as integers (the int8-input kernels scale a super-block's sums in integers), stored whole (the kernels
// read them back whole: no store-forwarding stall)
inline void scale_min_k4_int(const uint8_t* q, int16_t* sc, int16_t* mn) {
  __m128i s, m;
  k4_scale_bytes(q, s, m);
  _mm_storeu_si128((__m128i*)sc, _mm_cvtepu8_epi16(s));
  _mm_storeu_si128((__m128i*)mn, _mm_cvtepu8_epi16(m));
}

// 16 sub-block scales given as 16 bytes (signed or unsigned) into floats times f
inline void scale16(__m128i bytes, bool is_signed, float f, float* out) {
  const __m128i hi = _mm_srli_si128(bytes, 8);
  const __m256i a = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  const __m256i b = is_signed ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(f)));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(b), _mm256_set1_ps(f)));
}

struct Q2_K {  // scales[16] (4-bit scale, 4-bit minimum), qs[64] (2 bits), d, dmin
  static constexpr int TYPE = 10, QK = 256, BYTES = 84, SUB = 16;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) {
    const __m128i sc = _mm_loadu_si128((const __m128i*)b), low = _mm_set1_epi8(15);
    scale16(_mm_and_si128(sc, low), false, f16_at(b + 80), d);
    scale16(_mm_and_si128(_mm_srli_epi16(sc, 4), low), false, -f16_at(b + 82), m);
  }
  // the same as integers and the block's two factors: w = D * S[j] * code + M * N[j] (KQuant's form)
  static void iscales(const uint8_t* b, int16_t* S, int16_t* N, float& D, float& M) {
    const __m128i sc = _mm_loadu_si128((const __m128i*)b), low = _mm_set1_epi8(15);
    _mm256_storeu_si256((__m256i*)S, _mm256_cvtepu8_epi16(_mm_and_si128(sc, low)));
    _mm256_storeu_si256((__m256i*)N, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), low)));
    D = f16_at(b + 80), M = -f16_at(b + 82);
  }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    return bit_field<V>(a, b, 16 + (c / 4) * 32, 2 * (c % 4), 3);
  }
};

struct Q3_K {  // hmask[32] (third bit), qs[64] (low 2 bits), scales[12] (6-bit, minus 32), d; w = d * sc * (code - 4)
  static constexpr int TYPE = 11, QK = 256, BYTES = 110, SUB = 16;
  static constexpr bool SIGNED = false, MINS = true;
  static __m128i signed_scales(const uint8_t* b) {  // the 6-bit scales, minus 32, built in registers
    uint32_t a0, a1, t;
    std::memcpy(&a0, b + 96, 4);
    std::memcpy(&a1, b + 100, 4);
    std::memcpy(&t, b + 104, 4);
    const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f;
    return _mm_sub_epi8(_mm_setr_epi32(static_cast<int>((a0 & k2) | (((t >> 0) & k1) << 4)),
                                       static_cast<int>((a1 & k2) | (((t >> 2) & k1) << 4)),
                                       static_cast<int>(((a0 >> 4) & k2) | (((t >> 4) & k1) << 4)),
                                       static_cast<int>(((a1 >> 4) & k2) | (((t >> 6) & k1) << 4))),
                        _mm_set1_epi8(32));
  }
  static void scales(const uint8_t* b, float* d, float* m) {
    const __m128i sc = signed_scales(b);
    const float dd = f16_at(b + 108);
    scale16(sc, true, dd, d);
    scale16(sc, true, -4.f * dd, m);
  }
  static void iscales(const uint8_t* b, int16_t* S, int16_t* N, float& D, float& M) {
    const __m256i sc = _mm256_cvtepi8_epi16(signed_scales(b));
    _mm256_storeu_si256((__m256i*)S, sc);
    _mm256_storeu_si256((__m256i*)N, sc);
    D = f16_at(b + 108), M = -4.f * D;
  }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    return V::or_(bit_field<V>(a, b, 32 + (c / 4) * 32, 2 * (c % 4), 3), V::slli(bit_field<V>(a, b, 0, c, 1), 2));
  }
};

struct Q4_K {  // d, dmin, scales[12] (6-bit scales and minimums), qs[128] (nibbles)
  static constexpr int TYPE = 12, QK = 256, BYTES = 144, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) { scale_min_k4(b + 4, f16_at(b), f16_at(b + 2), d, m); }
  static void iscales(const uint8_t* b, int16_t* S, int16_t* N, float& D, float& M) {
    scale_min_k4_int(b + 4, S, N);
    D = f16_at(b), M = -f16_at(b + 2);
  }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    return bit_field<V>(a, b, 16 + (c / 2) * 32, 4 * (c % 2), 15);
  }
};

struct Q5_K {  // d, dmin, scales[12], qh[32] (fifth bit), qs[128] (nibbles)
  static constexpr int TYPE = 13, QK = 256, BYTES = 176, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) { Q4_K::scales(b, d, m); }
  static void iscales(const uint8_t* b, int16_t* S, int16_t* N, float& D, float& M) { Q4_K::iscales(b, S, N, D, M); }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    return V::or_(bit_field<V>(a, b, 48 + (c / 2) * 32, 4 * (c % 2), 15), V::slli(bit_field<V>(a, b, 16, c, 1), 4));
  }
};

struct Q6_K {  // ql[128] (low nibbles), qh[64] (high 2 bits), scales[16] (int8), d; w = d * sc * (code - 32)
  static constexpr int TYPE = 14, QK = 256, BYTES = 210, SUB = 16;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) {
    const __m128i sc = _mm_loadu_si128((const __m128i*)(b + 192));
    const float dd = f16_at(b + 208);
    scale16(sc, true, dd, d);
    scale16(sc, true, -32.f * dd, m);
  }
  static void iscales(const uint8_t* b, int16_t* S, int16_t* N, float& D, float& M) {
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));
    _mm256_storeu_si256((__m256i*)S, sc);
    _mm256_storeu_si256((__m256i*)N, sc);
    D = f16_at(b + 208), M = -32.f * D;
  }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    const int h = c / 4, cc = c % 4;
    return V::or_(bit_field<V>(a, b, h * 64 + (cc % 2) * 32, 4 * (cc / 2), 15),
                  V::slli(bit_field<V>(a, b, 128 + h * 32, 2 * cc, 3), 4));
  }
};

// IQ4_XS: d, scales_h (2 bits a sub-block), scales_l[4] (4 bits a sub-block), qs[128]: per sub-block of 32 a 6-bit
// scale less 32, each nibble indexing IQ4_NL's 16 non-linear int8 levels; w = d * (ls - 32) * level. Its codes are
// the signed levels (SIGNED); the kernels multiply them exactly (the sign trick, or plus 128 in vpdpbusd's unsigned
// side with the inputs' sums times the scales taken off: N, the minimums' integers, are the scales and M is 0).
struct IQ4_XS {
  static constexpr int TYPE = 23, QK = 256, BYTES = 136, SUB = 32;
  static constexpr bool SIGNED = true, MINS = false;
  static void iscales(const uint8_t* b, int16_t* S, int16_t* N, float& D, float& M) {
    uint16_t h;
    std::memcpy(&h, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | ((h >> (2 * j)) & 3) << 4;
      S[j] = N[j] = static_cast<int16_t>(ls - 32);
    }
    for (int j = 8; j < 16; ++j) S[j] = N[j] = 0;
    D = f16_at(b), M = 0.f;
  }
  static void scales(const uint8_t* b, float* d, float* m) {
    alignas(32) int16_t S[16], N[16];
    float D, M;
    iscales(b, S, N, D, M);
    for (int j = 0; j < 8; ++j) d[j] = D * static_cast<float>(S[j]), m[j] = 0.f;
  }
  template <typename V>  // the nibbles of chunk c: indices into the levels
  static typename V::T indices(const uint8_t* a, const uint8_t* b, int c) {
    return V::nibbles(a + 8 + 16 * c, b + 8 + 16 * c);
  }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    return V::lookup(IQ4_NL::levels(), indices<V>(a, b, c));
  }
};

#endif  // WOQ_SIMD
}  // namespace woq
