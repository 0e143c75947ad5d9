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

// The byte operations the block types' codes are written in, over one block's 32 codes (V256) or, on AVX-512,
// two blocks' side by side (V512: rows a and b in one register, the VNNI tiles' packing). Each reads its bytes at
// a (and b).
struct V256 {
  using T = __m256i;
  static T load(const uint8_t* a, const uint8_t*) { return _mm256_loadu_si256((const __m256i*)a); }
  // the 16 bytes at a as 32 nibbles: low nibbles are weights 0..15, high nibbles 16..31
  static T nibbles(const uint8_t* a, const uint8_t*) {
    const __m128i v = _mm_loadu_si128((const __m128i*)a), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
  }
  // the 32 bits at a as 32 bytes of 16 where the bit is set, else 0 (the fifth bit of Q5 weights)
  static T fifth(const uint8_t* a, const uint8_t*) {
    uint32_t bits;
    std::memcpy(&bits, a, 4);
    const T spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread_mask());
    const T hit =
        _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(hit, _mm256_set1_epi8(16));
  }
  static T spread_mask() {
    return _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
  }
  static T set1(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static T srli(T v, int n) { return _mm256_srli_epi16(v, n); }
  static T slli(T v, int n) { return _mm256_slli_epi16(v, n); }
  static T and_(T a, T b) { return _mm256_and_si256(a, b); }
  static T or_(T a, T b) { return _mm256_or_si256(a, b); }
  static T lookup(__m128i table, T idx) { return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), idx); }
};

#ifdef WOQ_VNNI
struct V512 {
  using T = __m512i;
  static T pair(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
  static T load(const uint8_t* a, const uint8_t* b) {
    return pair(_mm256_loadu_si256((const __m256i*)a), _mm256_loadu_si256((const __m256i*)b));
  }
  static T nibbles(const uint8_t* a, const uint8_t* b) {  // [a a b b] in 128-bit lanes, shifted 0, 4, 0, 4
    const T v = pair(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                     _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)b)));
    const T shifts =
        _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004, 0x0004000400040004);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shifts), _mm512_set1_epi8(15));
  }
  static T fifth(const uint8_t* a, const uint8_t* b) {  // bit j of a's 32 bits: byte j; of b's: byte 32 + j
    uint32_t ba, bb;
    std::memcpy(&ba, a, 4);
    std::memcpy(&bb, b, 4);
    return _mm512_maskz_mov_epi8(_cvtu64_mask64(ba | static_cast<uint64_t>(bb) << 32), _mm512_set1_epi8(16));
  }
  static T set1(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static T srli(T v, int n) { return _mm512_srli_epi16(v, n); }
  static T slli(T v, int n) { return _mm512_slli_epi16(v, n); }
  static T and_(T a, T b) { return _mm512_and_si512(a, b); }
  static T or_(T a, T b) { return _mm512_or_si512(a, b); }
  static T lookup(__m128i table, T idx) { return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(table), idx); }
};
#endif

// bits shift .. of each byte, under mask (the 2-bit or 4-bit fields of the k-quants), at a (and b) plus off
template <typename V>
inline typename V::T bit_field(const uint8_t* a, const uint8_t* b, int off, int shift, int mask) {
  return V::and_(V::srli(V::load(a + off, b + off), shift), V::set1(mask));
}

// The scales of a block of 32 whose scale d is the float16 at its start, and its minimum the float16 after it
// (MinF16) or d times MinOfD.
template <int MinOfD, bool MinF16>
struct Scale32 {
  static void scales(const uint8_t* b, float* d, float* m) {
    d[0] = f16_at(b), m[0] = MinF16 ? f16_at(b + 2) : static_cast<float>(MinOfD) * d[0];
  }
};

// The traits every block type gives: TYPE (ggml's type number), QK weights in BYTES bytes, a scale (and minimum)
// per SUB weights; SIGNED codes are int8 (else unsigned bytes); MINS: some m is not zero.
struct Q4_0 : Scale32<-8, false> {
  static constexpr int TYPE = 2, QK = 32, BYTES = 18, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int) {
    return V::nibbles(a + 2, b + 2);
  }
};

struct Q4_1 : Scale32<0, true> {
  static constexpr int TYPE = 3, QK = 32, BYTES = 20, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int) {
    return V::nibbles(a + 4, b + 4);
  }
};

struct Q5_0 : Scale32<-16, false> {
  static constexpr int TYPE = 6, QK = 32, BYTES = 22, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int) {
    return V::or_(V::nibbles(a + 6, b + 6), V::fifth(a + 2, b + 2));
  }
};

struct Q5_1 : Scale32<0, true> {
  static constexpr int TYPE = 7, QK = 32, BYTES = 24, SUB = 32;
  static constexpr bool SIGNED = false, MINS = true;
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int) {
    return V::or_(V::nibbles(a + 8, b + 8), V::fifth(a + 4, b + 4));
  }
};

struct Q8_0 : Scale32<0, false> {
  static constexpr int TYPE = 8, QK = 32, BYTES = 34, SUB = 32;
  static constexpr bool SIGNED = true, MINS = false;
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int) {
    return V::load(a + 2, b + 2);
  }
};

// Blocks of 32 whose nibbles index 16 int8 levels of the type (w = d * level, d first): IQ4_NL (d a float16),
// and the i-quants whose blocks of 32 take few enough levels, in IQ4_NL's bytes but for d, a float32 (F32D: their
// scales, a float16 times a factor of 4 bits, take up to 15 significant bits; model/gguf_blocks.py writes them from
// the file's blocks: type numbers of their own, past ggml's). NL4: the trait the tiles look for.
template <int Type, bool F32D_, int8_t... L>
struct NonLinear4 {
  static_assert(sizeof...(L) == 16, "16 levels");
  static constexpr bool F32D = F32D_;
  static constexpr int TYPE = Type, QK = 32, BYTES = F32D ? 20 : 18, SUB = 32;
  static constexpr bool SIGNED = true, MINS = false, NL4 = true;
  static void scales(const uint8_t* b, float* d, float* m) {
    if constexpr (F32D) std::memcpy(d, b, 4);
    else d[0] = f16_at(b);
    m[0] = 0.f;
  }
  static __m128i levels() { return _mm_setr_epi8(static_cast<char>(L)...); }
  // the levels plus 128, as bytes: vpdpbusd's unsigned side
  static __m128i unsigned_levels() { return _mm_xor_si128(levels(), _mm_set1_epi8(static_cast<char>(0x80))); }
  template <typename V>  // the nibbles: indices into the levels
  static typename V::T indices(const uint8_t* a, const uint8_t* b, int) {
    return V::nibbles(a + BYTES - 16, b + BYTES - 16);
  }
  template <typename V>
  static typename V::T codes(const uint8_t* a, const uint8_t* b, int c) {
    return V::lookup(levels(), indices<V>(a, b, c));
  }
};

// IQ4_NL: llama.cpp's 16 non-linear int8 levels
using IQ4_NL = NonLinear4<20, false, -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113>;
// IQ3_XXS: its grid's values with a sign (quant.LEVEL_TYPES holds the same numbers)
using IQ3_XXS_L = NonLinear4<120, true, -62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62>;
// IQ2_XXS: its grid's 8, 25, 43 with a sign (ten levels unused)
using IQ2_XXS_L = NonLinear4<121, true, -43, -25, -8, 8, 25, 43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0>;
// IQ1_S: 8 x grid +- 1 (its shift of 1/8 a block's sign), grid -1, 0, 1
using IQ1_S_L = NonLinear4<122, true, -9, -7, -1, 1, 7, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0>;

template <typename B, typename = void>
struct is_nl4 : std::false_type {};
template <typename B>
struct is_nl4<B, std::void_t<decltype(B::NL4)>> : std::true_type {};
// a NonLinear4 type whose block scale is a float32
template <typename B, typename = void>
struct f32_scale : std::false_type {};
template <typename B>
struct f32_scale<B, std::enable_if_t<B::F32D>> : std::true_type {};

#endif  // WOQ_SIMD
}  // namespace woq
