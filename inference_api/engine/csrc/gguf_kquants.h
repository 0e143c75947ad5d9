// GGUF's k-quant super-blocks of 256 weights (ggml-common.h): Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, read as
// gguf_legacy.h reads its blocks: per sub-block of 16 or 32 a scale d and minimum m (w = d * code + m, the
// codes unsigned), and the codes of each chunk of 32 weights in the weights' order.
#pragma once
#include "gguf_legacy.h"

namespace woq {
#ifdef WOQ_SIMD

// Q4_K and Q5_K's eight 6-bit scales and minimums packed in 12 bytes (llama.cpp's get_scale_min_k4)
inline void scale_min_k4(const uint8_t* q, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63, mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

struct Q2_K {  // scales[16] (4-bit scale, 4-bit minimum), qs[64] (2 bits), d, dmin
  static constexpr int TYPE = 10, QK = 256, BYTES = 84, SUB = 16;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) {
    const float dd = f16_at(b + 80), dmin = f16_at(b + 82);
    for (int j = 0; j < 16; ++j) d[j] = dd * (b[j] & 15), m[j] = -dmin * (b[j] >> 4);
  }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    return bit_field<V>(a, b, 16 + (c / 4) * 32, 2 * (c % 4), 3);
  }
};

struct Q3_K {  // hmask[32] (third bit), qs[64] (low 2 bits), scales[12] (6-bit, minus 32), d; w = d * sc * (code - 4)
  static constexpr int TYPE = 11, QK = 256, BYTES = 110, SUB = 16;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) {
    uint32_t aux[4];
    std::memcpy(aux, b + 96, 12);
    const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, t = aux[2];
    aux[2] = ((aux[0] >> 4) & k2) | (((t >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((t >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | (((t >> 0) & k1) << 4);
    aux[1] = (aux[1] & k2) | (((t >> 2) & k1) << 4);
    const int8_t* sc = reinterpret_cast<const int8_t*>(aux);
    const float dd = f16_at(b + 108);
    for (int j = 0; j < 16; ++j) d[j] = dd * (sc[j] - 32), m[j] = -4.f * d[j];
  }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    return V::or_(bit_field<V>(a, b, 32 + (c / 4) * 32, 2 * (c % 4), 3), V::slli(bit_field<V>(a, b, 0, c, 1), 2));
  }
};

struct Q4_K {  // d, dmin, scales[12] (6-bit scales and minimums), qs[128] (nibbles)
  static constexpr int TYPE = 12, QK = 256, BYTES = 144, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) {
    const float dd = f16_at(b), dmin = f16_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(b + 4, j, sc, mn);
      d[j] = dd * sc, m[j] = -dmin * mn;
    }
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
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    return V::or_(bit_field<V>(a, b, 48 + (c / 2) * 32, 4 * (c % 2), 15), V::slli(bit_field<V>(a, b, 16, c, 1), 4));
  }
};

struct Q6_K {  // ql[128] (low nibbles), qh[64] (high 2 bits), scales[16] (int8), d; w = d * sc * (code - 32)
  static constexpr int TYPE = 14, QK = 256, BYTES = 210, SUB = 16;
  static constexpr bool SIGNED = false, MINS = true;
  static void scales(const uint8_t* b, float* d, float* m) {
    const float dd = f16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 16; ++j) d[j] = dd * sc[j], m[j] = -32.f * d[j];
  }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    const int h = c / 4, cc = c % 4;
    return V::or_(bit_field<V>(a, b, h * 64 + (cc % 2) * 32, 4 * (cc / 2), 15),
                  V::slli(bit_field<V>(a, b, 128 + h * 32, 2 * cc, 3), 4));
  }
};

#endif  // WOQ_SIMD
}  // namespace woq
