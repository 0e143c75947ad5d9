// The k-quants packed once at load for the tiles, as llama.cpp repacks its k-quants: the tiles then read every
// group of 16 weight rows in the layout vpdpbusd takes (AVX512-VNNI: tile), or as two halves of 8 rows that
// vpmaddubsw takes (AVX2: tile_avx2), for every row count, with no packing per call. Per group of 16 rows and
// super-block of 256 inputs, PB bytes:
// - the codes' low bits, CB of them (Q4_K, Q5_K, Q6_K: a nibble; Q2_K, Q3_K: two), in vectors of 64 bytes:
//   - nibbles, 32 vectors: byte 4r + e of vector p holds input 8p + e of row r in its low nibble and input 8p + 4 + e
//     in its high one (two steps of [16 rows][4 inputs]);
//   - two bits, 16 vectors: byte 4r + e of vector v holds input 16v + 4s + e of row r at bits 2s (four steps);
// - HB high bits of each code (Q5_K one, Q6_K two; Q3_K its third bit):
//   - over nibbles, 16 * HB bytes per vector: the HB bits of both codes of byte t side by side (2 HB bits),
//     8 / (2 HB) bytes t to a byte, t + 64 / G * g at bits 2 HB (G - 1 - g) (G groups): Q6_K's t at bits 4 .. 7,
//     where the codes take them, Q5_K's t + 16 at bits 4 and 5, the other groups a shift away;
//   - over two bits, 8 vectors: byte 4r + e of vector u holds the bit of input 32u + 4b + e at bit b;
// - each sub-block's integer scale per row, int8 [NS][16] (Q2_K: the file's byte, scale and minimum nibbles);
// - Q4_K and Q5_K: the minimums' integers as int16 pairs per row for vpdpwssd, int8 [NS / 2][16][2] (widened at
//   use; Q6_K's and Q3_K's are their scales, min_pairs; Q2_K's the high nibbles of its scales' bytes);
// - each row's D, float16 [16], then Q2_K's, Q4_K's and Q5_K's M (Q6_K's is -32 D, Q3_K's -4 D).
// That is the file's bytes but for 4 a row in 148 (Q4_K), 180 (Q5_K) and 114 (Q3_K); Q6_K's 210 and Q2_K's 84
// exactly: one stream's decode reads about as much as from the blocks.
// The numbers are those of BlockForm::k8_dot and k8_tile to the bit: each super-block's sums are exact integers,
// then acc = fma(D * dx, isum, acc), acc = fma(M * dx, imin, acc). A row's numbers are the same whatever the batch.
#pragma once
#include <type_traits>
#include "gguf_kquants.h"
#include "q8.h"

namespace woq {
#ifdef WOQ_SIMD

// The codes of 16 rows (row r's at codes + r * stride, 8 nv of them) as nv vectors of 64 bytes at low: byte 4r + e
// of vector p holds code 8p + e of row r in its low nibble and 8p + 4 + e in its high one; and their HB high bits
// at high, 16 HB bytes a vector: the HB bits of both codes of byte t side by side, 8 / (2 HB) bytes t to a byte,
// t + 64 / G * g at bits 2 HB (G - 1 - g) (G groups: HB = 2, t's bits where the codes take them, t + 32's a shift away)
template <int HB>
inline void pack_codes(const uint8_t* codes, int64_t stride, int nv, uint8_t* low, uint8_t* high) {
  for (int p = 0; p < nv; ++p) {
    uint8_t hv[64];
    for (int t = 0; t < 64; ++t) {
      const int r = t / 4, e = t % 4;
      const uint8_t a = codes[r * stride + 8 * p + e], c = codes[r * stride + 8 * p + 4 + e];
      low[p * 64 + t] = static_cast<uint8_t>((a & 15) | (c & 15) << 4);
      hv[t] = static_cast<uint8_t>((a >> 4) | (c >> 4) << HB);
    }
    if constexpr (HB > 0) {
      constexpr int G = 8 / (2 * HB), L = 64 / G;
      for (int u = 0; u < L; ++u) {
        uint8_t v = 0;
        for (int g = 0; g < G; ++g) v = static_cast<uint8_t>(v | hv[u + g * L] << (2 * HB * (G - 1 - g)));
        high[p * L + u] = v;
      }
    }
  }
}

// half h of vector p of pack_codes' layout (rows 8h .. 8h + 7): its two steps of codes, [8 rows][4 inputs] each
template <int HB>
inline void half_codes(const uint8_t* low, const uint8_t* high, int p, int h, __m256i& w0, __m256i& w1) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)(low + p * 64 + h * 32)), nib = _mm256_set1_epi8(15);
  w0 = _mm256_and_si256(v, nib);
  w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  if constexpr (HB == 2) {  // byte u: t = u's two pairs of high bits at bits 4 .. 7, t = u + 32's at bits 0 .. 3
    __m256i hv = _mm256_loadu_si256((const __m256i*)(high + p * 32));
    if (h) hv = _mm256_slli_epi16(hv, 4);
    const __m256i mask = _mm256_set1_epi8(0x30);
    w0 = _mm256_or_si256(w0, _mm256_and_si256(hv, mask));
    w1 = _mm256_or_si256(w1, _mm256_and_si256(_mm256_srli_epi16(hv, 2), mask));
  } else if constexpr (HB == 1) {  // byte u: t = u + 16 g's pair of bits at 6 - 2 g, brought to bits 4 and 5
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(high + p * 16)));
    const __m256i hv =
        h ? _mm256_sllv_epi64(b, _mm256_setr_epi64x(2, 2, 4, 4)) : _mm256_srlv_epi64(b, _mm256_setr_epi64x(2, 2, 0, 0));
    const __m256i mask = _mm256_set1_epi8(0x10);
    w0 = _mm256_or_si256(w0, _mm256_and_si256(hv, mask));
    w1 = _mm256_or_si256(w1, _mm256_and_si256(_mm256_srli_epi16(hv, 1), mask));
  }
}

#ifdef WOQ_VNNI
// vector p of pack_codes' layout whole (the 16 rows): its two steps of codes, [16 rows][4 inputs] each, as vpdpbusd
// takes them
template <int HB>
inline void step_codes(const uint8_t* low, const uint8_t* high, int p, __m512i& w0, __m512i& w1) {
  const __m512i v = _mm512_loadu_si512(low + p * 64), nib = _mm512_set1_epi8(15);
  w0 = _mm512_and_si512(v, nib);
  w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  if constexpr (HB == 2) {  // bytes 32 .. 63 take the high bits at bits 0 .. 3 of bytes 0 .. 31 (pack_codes)
    __m512i hv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(high + p * 32)));
    hv = _mm512_mask_slli_epi16(hv, 0xffff0000u, hv, 4);
    const __m512i mask = _mm512_set1_epi8(0x30);
    w0 = _mm512_or_si512(w0, _mm512_and_si512(hv, mask));
    w1 = _mm512_or_si512(w1, _mm512_and_si512(_mm512_srli_epi16(hv, 2), mask));
  } else if constexpr (HB == 1) {  // byte u: t = u + 16 g's pair of bits at 6 - 2 g, shifted to bits 0 and 1 (a
    // rotation to bits 4 and 5 saves two operations but ran 5 % slower on a Zen 5)
    __m512i hv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(high + p * 16)));
    hv = _mm512_srlv_epi16(
        hv, _mm512_setr_epi64(0x0006000600060006LL, 0x0006000600060006LL, 0x0004000400040004LL, 0x0004000400040004LL,
                              0x0002000200020002LL, 0x0002000200020002LL, 0, 0));
    const __m512i mask = _mm512_set1_epi8(1);
    w0 = _mm512_or_si512(w0, _mm512_slli_epi16(_mm512_and_si512(hv, mask), 4));
    w1 = _mm512_or_si512(w1, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hv, 1), mask), 4));
  }
}
#endif

// The codes of 16 rows (row r's at codes + r * stride, 256 of them, each below 2^(2 + HB)) in the two-bit layout:
// 16 vectors of 64 bytes at low, byte 4r + e of vector v holding code 16v + 4s + e of row r at bits 2s; and, HB = 1,
// 8 vectors at high, byte 4r + e of vector u holding the third bit of code 32u + 4b + e at bit b
template <int HB>
inline void pack_codes2(const uint8_t* codes, int64_t stride, uint8_t* low, uint8_t* high) {
  for (int t = 0; t < 64; ++t) {
    const int r = t / 4, e = t % 4;
    const uint8_t* c = codes + r * stride;
    for (int v = 0; v < 16; ++v) {
      uint8_t b = 0;
      for (int s = 0; s < 4; ++s) b = static_cast<uint8_t>(b | (c[16 * v + 4 * s + e] & 3) << (2 * s));
      low[v * 64 + t] = b;
    }
    if constexpr (HB > 0)
      for (int u = 0; u < 8; ++u) {
        uint8_t b = 0;
        for (int k = 0; k < 8; ++k) b = static_cast<uint8_t>(b | (c[32 * u + 4 * k + e] >> 2 & 1) << k);
        high[u * 64 + t] = b;
      }
  }
}

// bit k of each byte of v as that byte's bit 2 (the third bit of a code)
template <typename V>
inline typename V::T third_bit(typename V::T v, int k) {
  return V::and_(k >= 2 ? V::srli(v, k - 2) : V::slli(v, 2 - k), V::set1(4));
}
// inputs 8p .. 8p + 3 and 8p + 4 .. 8p + 7 of the two-bit layout as two steps of codes, [rows][4 inputs] each: v, the
// low bits' vector p / 2 (the whole vector's 16 rows with V512, half a vector's 8 with V256), and hv, the third
// bits' vector p / 4 (HB = 1)
template <int HB, typename V>
inline void codes2(typename V::T v, typename V::T hv, int p, typename V::T& w0, typename V::T& w1) {
  const int sh = 4 * (p % 2);
  w0 = V::and_(V::srli(v, sh), V::set1(3));
  w1 = V::and_(V::srli(v, sh + 2), V::set1(3));
  if constexpr (HB > 0) {
    const int k = 2 * (p % 4);
    w0 = V::or_(w0, third_bit<V>(hv, k));
    w1 = V::or_(w1, third_bit<V>(hv, k + 1));
  }
}

// The AVX2 tiles' products of a NonLinear4 type's levels L (IQ4_NL's for IQ4_XS) by a step's inputs: the indices
// w0 and w1 of two steps looked up as the signed levels, multiplied by the inputs' 4 bytes x0 and x1 (broadcast) by
// the sign trick (pairs of at most 2 x 127 x 127, no saturation), each step's pairs into int32 at once by the rows'
// scales sc (int16 pairs)
template <typename L = IQ4_NL>
inline __m256i level_products(__m256i w0, __m256i w1, __m256i x0, __m256i x1, __m256i sc) {
  w0 = V256::lookup(L::levels(), w0), w1 = V256::lookup(L::levels(), w1);
  const __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0)),
                p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));
  return _mm256_add_epi32(_mm256_madd_epi16(p0, sc), _mm256_madd_epi16(p1, sc));
}

template <typename B>
struct K8Pack {
  static constexpr int TY = B::TYPE;
  static constexpr int HB = TY == Q2_K::TYPE || TY == Q4_K::TYPE || TY == IQ4_XS::TYPE ? 0
                            : TY == Q3_K::TYPE || TY == Q5_K::TYPE                     ? 1
                            : TY == Q6_K::TYPE                                         ? 2
                                                                                       : -1;
  static constexpr bool ON = HB >= 0;  // the types packed (the others pack a group per call)
  static constexpr int CB = TY == Q2_K::TYPE || TY == Q3_K::TYPE ? 2 : 4;  // the codes' low bits: two or a nibble
  static constexpr int64_t AHEAD = 40;  // how many super-blocks ahead few rows prefetch
  static constexpr int64_t QK = 256;    // inputs a packed block covers
  static constexpr int NS = 256 / B::SUB, NP = NS / 2;
  static constexpr bool NIB_SC = TY == Q2_K::TYPE;  // scale and minimum nibbles in one byte, as the file's
  // IQ4_XS: the nibbles index the levels, looked up where used (plus 128 for vpdpbusd: the minimums' integers are the
  // scales, so the tiles take 128 times their sums with the inputs' sums off the exact integer sums)
  static constexpr bool LUT = TY == IQ4_XS::TYPE;
  // Q6_K's, Q3_K's and IQ4_XS's minimums are their scales, their M -32 D, -4 D and 0
  static constexpr bool OWN_MINS = TY != Q6_K::TYPE && TY != Q3_K::TYPE && !LUT;
  static constexpr float M_OF_D = TY == Q6_K::TYPE ? -32.f : TY == Q3_K::TYPE ? -4.f : 0.f;
  // where each part begins in a super-block's PB bytes
  static constexpr int64_t HIGH = 512 * CB, SC = HIGH + 512 * (HB > 0 ? HB : 0), MN = SC + NS * 16,
                           DM = MN + (OWN_MINS && !NIB_SC ? NP * 32 : 0), PB = DM + (OWN_MINS ? 64 : 32);

  // the 16 rows of group grp (rows past N repeat the group's first) of raw [N, row_bytes] into out [K / 256][PB]
  static void pack(const uint8_t* raw, int64_t N, int64_t row_bytes, int64_t grp, uint8_t* out) {
    const int64_t nb = row_bytes / B::BYTES, n0 = grp * 16;
    alignas(32) uint8_t codes[16][256];
    for (int64_t blk = 0; blk < nb; ++blk) {
      uint8_t* o = out + blk * PB;
      uint16_t* dm = reinterpret_cast<uint16_t*>(o + DM);
      for (int r = 0; r < 16; ++r) {
        const uint8_t* b = raw + (n0 + (n0 + r < N ? r : 0)) * row_bytes + blk * B::BYTES;
        for (int c = 0; c < 8; ++c) {
          __m256i v;
          if constexpr (LUT) v = B::template indices<V256>(b, b, c);
          else v = B::template codes<V256>(b, b, c);
          _mm256_storeu_si256((__m256i*)(codes[r] + c * 32), v);
        }
        alignas(32) int16_t S[16], Nm[16];
        float D, M;  // float16 values (the file's), so float16 holds them exactly
        B::iscales(b, S, Nm, D, M);
        dm[r] = _cvtss_sh(D, 0);
        if constexpr (OWN_MINS) dm[16 + r] = _cvtss_sh(M, 0);
        for (int j = 0; j < NS; ++j)
          o[SC + j * 16 + r] =
              NIB_SC ? static_cast<uint8_t>(S[j] | Nm[j] << 4) : static_cast<uint8_t>(static_cast<int8_t>(S[j]));
        if constexpr (OWN_MINS && !NIB_SC)
          for (int q = 0; q < NP; ++q)
            for (int h = 0; h < 2; ++h)
              o[MN + q * 32 + r * 2 + h] = static_cast<uint8_t>(static_cast<int8_t>(Nm[2 * q + h]));
      }
      if constexpr (CB == 2) pack_codes2<(HB > 0 ? HB : 0)>(&codes[0][0], 256, o, o + HIGH);
      else pack_codes<(HB > 0 ? HB : 0)>(&codes[0][0], 256, 32, o, o + HIGH);
    }
  }

  // sub-block j's integer scales of the 16 rows, int8 [16]
  static __m128i scales(const uint8_t* o, int j) {
    const __m128i v = _mm_loadu_si128((const __m128i*)(o + SC + j * 16));
    return NIB_SC ? _mm_and_si128(v, _mm_set1_epi8(15)) : v;
  }
  // the minimums of sub-blocks 2q and 2q + 1 as int8 pairs of the 16 rows, [16][2]
  static __m256i min_pairs(const uint8_t* o, int q) {
    if constexpr (OWN_MINS && !NIB_SC) {
      return _mm256_loadu_si256((const __m256i*)(o + MN + q * 32));
    } else {
      __m128i a = _mm_loadu_si128((const __m128i*)(o + SC + 2 * q * 16)),
              b = _mm_loadu_si128((const __m128i*)(o + SC + (2 * q + 1) * 16));
      if constexpr (NIB_SC) {
        const __m128i low = _mm_set1_epi8(15);
        a = _mm_and_si128(_mm_srli_epi16(a, 4), low), b = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      }
      return _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
    }
  }
  // rows 8h .. 8h + 7's D and M
  static void dm_half(const uint8_t* o, int h, __m256& d, __m256& m) {
    d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + DM + 16 * h)));
    if constexpr (OWN_MINS) m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + DM + 32 + 16 * h)));
    else m = _mm256_mul_ps(d, _mm256_set1_ps(M_OF_D));
  }

#ifdef WOQ_VNNI
  // vector p's two steps of codes (inputs 8p .. 8p + 3 and 8p + 4 .. 8p + 7 of the 16 rows) from a super-block
  static void step_pair(const uint8_t* o, int p, __m512i& w0, __m512i& w1) {
    if constexpr (CB == 2)
      codes2<(HB > 0 ? HB : 0), V512>(_mm512_loadu_si512(o + (p / 2) * 64),
                                      HB > 0 ? _mm512_loadu_si512(o + HIGH + (p / 4) * 64) : _mm512_setzero_si512(), p,
                                      w0, w1);
    else step_codes<(HB > 0 ? HB : 0)>(o, o + HIGH, p, w0, w1);
    if constexpr (LUT)
      w0 = V512::lookup(IQ4_NL::unsigned_levels(), w0), w1 = V512::lookup(IQ4_NL::unsigned_levels(), w1);
  }

  // y[i * ldy + r] for the MR input rows from i0 (Q8_K inputs) and the rows r of the group packed at g (its first
  // rows written)
  template <int MR>
  static void tile(const uint8_t* g, int64_t K, const Q8KRows& x, int64_t i0, float* y, int64_t ldy, int64_t rows) {
    constexpr int VP = B::SUB / 8;  // vectors a sub-block
    const int64_t nb = K / 256;
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; ++blk) {
      const uint8_t* o = g + blk * PB;
      if (i0 == 0)  // the group's first tile: the bytes AHEAD super-blocks on into L2, as k8_dot does
        for (int64_t l = 0; l < PB; l += 64) _mm_prefetch((const char*)(o + AHEAD * PB + l), _MM_HINT_T1);
      __m512i isum[MR];
      for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
      for (int j = 0; j < NS; ++j) {
        __m512i dot[MR];
        for (int i = 0; i < MR; ++i) dot[i] = _mm512_setzero_si512();
        for (int s = 0; s < VP; ++s) {
          const int p = j * VP + s;
          __m512i w0, w1;
          step_pair(o, p, w0, w1);
          for (int i = 0; i < MR; ++i) {
            const int8_t* v = x.q.data() + (i0 + i) * K + blk * 256 + p * 8;
            dot[i] = _mm512_dpbusd_epi32(dot[i], w0, bcast4_512(v));
            dot[i] = _mm512_dpbusd_epi32(dot[i], w1, bcast4_512(v + 4));
          }
        }
        const __m512i sc = _mm512_cvtepi8_epi32(scales(o, j));
        for (int i = 0; i < MR; ++i) isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(dot[i], sc));
      }
      __m256 d0, m0, d1, m1;
      dm_half(o, 0, d0, m0), dm_half(o, 1, d1, m1);
      const __m512 dv = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1),
                   mv = _mm512_insertf32x8(_mm512_castps256_ps512(m0), m1, 1);
      __m512i mn[NP];  // the minimums of sub-blocks 2q and 2q + 1 as int16 pairs
      for (int q = 0; q < NP; ++q) mn[q] = _mm512_cvtepi8_epi16(min_pairs(o, q));
      // the inputs' sums of each sub-block (16 or 32 inputs)
      const int16_t* xs = B::SUB == 16 ? x.bsum.data() + i0 * nb * 16 : x.bsum32.data() + i0 * nb * 8;
      for (int i = 0; i < MR; ++i) {
        const float dx = x.d[(i0 + i) * nb + blk];
        const int16_t* bs = xs + (i * nb + blk) * NS;
        __m512i imin = _mm512_setzero_si512();
        for (int q = 0; q < NP; ++q) imin = _mm512_dpwssd_epi32(imin, mn[q], bcast4_512(bs + 2 * q));
        if constexpr (LUT) isum[i] = _mm512_sub_epi32(isum[i], _mm512_slli_epi32(imin, 7));  // the levels' + 128
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum[i]), acc[i]);
        if constexpr (B::MINS)
          acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(mv, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(imin), acc[i]);
      }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * ldy, keep, acc[i]);
  }
#endif  // WOQ_VNNI

  // half h of vector p (rows 8h .. 8h + 7): its two steps of codes, [8 rows][4 inputs] each
  static void half_pair(const uint8_t* o, int p, int h, __m256i& w0, __m256i& w1) {
    if constexpr (CB == 2)
      codes2<(HB > 0 ? HB : 0), V256>(
          _mm256_loadu_si256((const __m256i*)(o + (p / 2) * 64 + 32 * h)),
          HB > 0 ? _mm256_loadu_si256((const __m256i*)(o + HIGH + (p / 4) * 64 + 32 * h)) : _mm256_setzero_si256(), p,
          w0, w1);
    else half_codes<(HB > 0 ? HB : 0)>(o, o + HIGH, p, h, w0, w1);
  }

  // tile's numbers with AVX2: per half of 8 rows, the u8 x s8 pair sums (vpmaddubsw) of FLUSH vectors summed in int16
  // (each step's pairs are at most 2 * 127 * (2^(CB + HB) - 1): 8 steps of 4-bit codes, 4 of 5-bit, 2 of 6-bit, a
  // sub-block's 4 of 2- or 3-bit), then times the rows' integer scales into int32 (vpmaddwd): the same exact
  // integers, the same floats
  template <int MR>
  static void tile_avx2(const uint8_t* g, int64_t K, const Q8KRows& x, int64_t i0, float* y, int64_t ldy,
                        int64_t rows) {
    constexpr int VP = B::SUB / 8, FLUSH = CB == 2 ? VP : HB == 0 ? 4 : HB == 1 ? 2 : 1;
    static_assert(VP % FLUSH == 0, "a sub-block's vectors in whole flushes");
    const int64_t nb = K / 256;
    alignas(32) float acc[2][MR][8];
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < MR; ++i) _mm256_store_ps(acc[h][i], _mm256_setzero_ps());
    const int16_t* xs = B::SUB == 16 ? x.bsum.data() + i0 * nb * 16 : x.bsum32.data() + i0 * nb * 8;
    for (int64_t blk = 0; blk < nb; ++blk) {
      const uint8_t* o = g + blk * PB;
      if (i0 == 0)  // the group's first tile: the bytes AHEAD super-blocks on into L2, as k8_dot does
        for (int64_t l = 0; l < PB; l += 64) _mm_prefetch((const char*)(o + AHEAD * PB + l), _MM_HINT_T1);
      const int8_t* xq = x.q.data() + i0 * K + blk * 256;
      for (int h = 0; h < 2; ++h) {
        __m256i isum[MR];
        for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
        for (int j = 0; j < NS; ++j) {
          const __m128i s8 = h ? _mm_unpackhi_epi64(scales(o, j), scales(o, j)) : scales(o, j);
          const __m256i sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8));  // each row's scale in both its lanes
          if constexpr (LUT) {  // the signed levels: each step's pairs into int32 at once
            for (int s = 0; s < VP; ++s) {
              const int p = j * VP + s;
              __m256i w0, w1;
              half_pair(o, p, h, w0, w1);
              for (int i = 0; i < MR; ++i) {
                const int8_t* v = xq + i * K + p * 8;
                const __m256i x0 = bcast4_256(v), x1 = bcast4_256(v + 4);
                isum[i] = _mm256_add_epi32(isum[i], level_products(w0, w1, x0, x1, sc));
              }
            }
            continue;
          }
          for (int f = 0; f < VP; f += FLUSH) {
            __m256i d16[MR];
            for (int i = 0; i < MR; ++i) d16[i] = _mm256_setzero_si256();
            avx2_steps<MR, FLUSH>([&](int s) {
              const int p = j * VP + f + s;
              __m256i w0, w1;
              half_pair(o, p, h, w0, w1);
              for (int i = 0; i < MR; ++i) {
                const int8_t* v = xq + i * K + p * 8;
                const __m256i x0 = bcast4_256(v), x1 = bcast4_256(v + 4);
                d16[i] = _mm256_add_epi16(d16[i],
                                          _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)));
              }
            });
            for (int i = 0; i < MR; ++i) isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(d16[i], sc));
          }
        }
        __m256 dv, mv;
        dm_half(o, h, dv, mv);
        __m256i mn[NP];  // the minimums of sub-blocks 2q and 2q + 1 as int16 pairs (IQ4_XS: none)
        if constexpr (B::MINS)
          for (int q = 0; q < NP; ++q) {
            const __m256i pairs = min_pairs(o, q);
            mn[q] = _mm256_cvtepi8_epi16(h ? _mm256_extracti128_si256(pairs, 1) : _mm256_castsi256_si128(pairs));
          }
        for (int i = 0; i < MR; ++i) {
          const __m256 dx = _mm256_set1_ps(x.d[(i0 + i) * nb + blk]);
          __m256 a = _mm256_fmadd_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(isum[i]), _mm256_load_ps(acc[h][i]));
          if constexpr (B::MINS) {
            const int16_t* bs = xs + (i * nb + blk) * NS;
            __m256i imin = _mm256_setzero_si256();
            for (int q = 0; q < NP; ++q)
              imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mn[q], bcast4_256(bs + 2 * q)));
            a = _mm256_fmadd_ps(_mm256_mul_ps(mv, dx), _mm256_cvtepi32_ps(imin), a);
          }
          _mm256_store_ps(acc[h][i], a);
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < rows; ++r) y[i * ldy + r] = acc[r / 8][i][r % 8];
  }
};

// Q5_0, Q5_1 and IQ4_NL packed once at load for the tiles (the other blocks of 32 are packed a group per call with
// VNNI): per group of 16 rows and block of 32 inputs, the codes as pack_codes lays them (4 vectors, then Q5's plane
// of fifth bits; IQ4_NL's nibbles are indices of its levels, looked up where used), each row's d, float16 [16] (the
// level types' float32 [16]), then Q5_1's m (Q5_0's is -16 d, IQ4_NL's 0): 384 bytes, 24 a row (Q5_1's own; Q5_0's
// 22, IQ4_NL's 18, the level types' 20).
// The VNNI tile's numbers are BlockForm::vnni_tile's to the bit (each block's exact integer sum times d and the
// input block's step, plus m times the input block's rounded sum, in that order; IQ4_NL's levels go in plus 128 and
// each block's sum starts at -128 times the input block's: vnni_i8_tile's numbers too); the AVX2 tile's the same way.
template <typename B>
struct B32Pack {
  static constexpr bool LUT = is_nl4<B>::value;  // IQ4_NL and the i-quants in its bytes
  static constexpr bool ON = B::TYPE == Q5_0::TYPE || B::TYPE == Q5_1::TYPE || LUT;
  static constexpr bool OWN_MINS = B::TYPE == Q5_1::TYPE;
  static constexpr bool F32D = f32_scale<B>::value;  // each row's d a float32 (the level types'), else a float16
  static constexpr int HB = LUT ? 0 : 1;             // high bits a code beside its nibble
  static constexpr int64_t QK = 32;                  // inputs a packed block covers
  static constexpr int64_t HIGH = 256, D = HIGH + 64 * HB, PB = D + (OWN_MINS || F32D ? 64 : 32);
  static constexpr int64_t AHEAD = 96;  // how many blocks ahead one or two rows prefetch (about K8Pack's distance)

  // the 16 rows of group grp (rows past N repeat the group's first) of raw [N, row_bytes] into out [K / 32][PB]
  static void pack(const uint8_t* raw, int64_t N, int64_t row_bytes, int64_t grp, uint8_t* out) {
    const int64_t nb = row_bytes / B::BYTES, n0 = grp * 16;
    alignas(32) uint8_t codes[16][32];
    for (int64_t blk = 0; blk < nb; ++blk) {
      uint8_t* o = out + blk * PB;
      uint16_t* dm = reinterpret_cast<uint16_t*>(o + D);
      for (int r = 0; r < 16; ++r) {
        const uint8_t* b = raw + (n0 + (n0 + r < N ? r : 0)) * row_bytes + blk * B::BYTES;
        if constexpr (LUT) _mm256_store_si256((__m256i*)codes[r], B::template indices<V256>(b, b, 0));
        else _mm256_store_si256((__m256i*)codes[r], B::template codes<V256>(b, b, 0));
        float d, m;  // d a float16 of the file (the level types' a float32); Q5_1's m a float16 too
        B::scales(b, &d, &m);
        if constexpr (F32D) std::memcpy(o + D + 4 * r, &d, 4);
        else dm[r] = _cvtss_sh(d, 0);
        if constexpr (OWN_MINS) dm[16 + r] = _cvtss_sh(m, 0);
      }
      pack_codes<HB>(&codes[0][0], 32, 4, o, o + HIGH);
    }
  }

  // Q5_1's m, else its factor of d
  static constexpr float M_OF_D = LUT ? 0.f : -16.f;

#ifdef WOQ_VNNI
  // vector p's two steps of codes (inputs 4p .. 4p + 3 and 16 + 4p .. of the 16 rows) as vpdpbusd takes them
  static void step_pair(const uint8_t* o, int p, __m512i& w0, __m512i& w1) {
    step_codes<HB>(o, o + HIGH, p, w0, w1);
    if constexpr (LUT) w0 = V512::lookup(B::unsigned_levels(), w0), w1 = V512::lookup(B::unsigned_levels(), w1);
  }
#endif

#ifdef WOQ_VNNI
  // y[i * ldy + r] for the MR input rows from i0 (int8 blocks of 32) and the rows r of the group packed at g (its
  // first rows written): per block, each row's exact integer sum (vpdpbusd over the 4 vectors' two steps)
  template <int MR>
  static void tile(const uint8_t* g, int64_t K, const Q8Rows& x, int64_t i0, float* y, int64_t ldy, int64_t rows) {
    const int64_t nb = K / 32;
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; ++blk) {
      const uint8_t* o = g + blk * PB;
      if (i0 == 0)  // the group's first tile
        for (int64_t l = 0; l < PB; l += 64) _mm_prefetch((const char*)(o + AHEAD * PB + l), _MM_HINT_T1);
      __m512i dot[MR];  // IQ4_NL's levels plus 128: each sum starts at -128 times the input block's
      for (int i = 0; i < MR; ++i)
        dot[i] = LUT ? _mm512_set1_epi32(x.less128[(i0 + i) * nb + blk]) : _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        __m512i w0, w1;
        step_pair(o, p, w0, w1);
        for (int i = 0; i < MR; ++i) {
          const int8_t* v = x.q.data() + (i0 + i) * K + blk * 32 + p * 8;
          dot[i] = _mm512_dpbusd_epi32(dot[i], w0, bcast4_512(v));
          dot[i] = _mm512_dpbusd_epi32(dot[i], w1, bcast4_512(v + 4));
        }
      }
      const __m512 d = F32D ? _mm512_loadu_ps(o + D) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(o + D)));
      const __m512 m = OWN_MINS ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(o + D + 32)))
                                : _mm512_mul_ps(d, _mm512_set1_ps(M_OF_D));
      for (int i = 0; i < MR; ++i) {
        const int64_t b = (i0 + i) * nb + blk;
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(d, _mm512_set1_ps(x.d[b])), acc[i]);
        if constexpr (!LUT) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[b]), acc[i]);
      }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * ldy, keep, acc[i]);
  }
#endif

  // y[i * ldy + r] for the MR input rows from i0 (int8 blocks of 32) and the rows r of the group packed at g (its
  // first rows written): per half of 8 rows, the vpmaddubsw pair sums of 2 vectors (4 steps of at most 2 * 31 *
  // 127) added in int16, summed into int32 per row (vpmaddwd by ones) twice a block; then as vnni_i4_tile, each
  // block's exact integer sum times d and the input block's step, plus m times the input block's float sum
  template <int MR>
  static void tile_avx2(const uint8_t* g, int64_t K, const Q8Rows& x, int64_t i0, float* y, int64_t ldy, int64_t rows) {
    const int64_t nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {
      __m256 accf[MR];
      for (int i = 0; i < MR; ++i) accf[i] = _mm256_setzero_ps();
      for (int64_t blk = 0; blk < nb; ++blk) {
        const uint8_t* o = g + blk * PB;
        if (i0 == 0 && h == 0)  // the group's first tile
          for (int64_t l = 0; l < PB; l += 64) _mm_prefetch((const char*)(o + AHEAD * PB + l), _MM_HINT_T1);
        __m256i isum[MR];
        if constexpr (LUT) {  // the signed levels: each step's pairs into int32 at once
          for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
          for (int p = 0; p < 4; ++p) {
            __m256i w0, w1;
            half_codes<0>(o, o + HIGH, p, h, w0, w1);
            for (int i = 0; i < MR; ++i) {
              const int8_t* v = x.q.data() + (i0 + i) * K + blk * 32 + p * 8;
              const __m256i x0 = bcast4_256(v), x1 = bcast4_256(v + 4);
              isum[i] = _mm256_add_epi32(isum[i], level_products<B>(w0, w1, x0, x1, ones));
            }
          }
        } else {
          for (int f = 0; f < 2; ++f) {
            __m256i d16[MR];
            for (int i = 0; i < MR; ++i) d16[i] = _mm256_setzero_si256();
            avx2_steps<MR, 2>([&](int s) {
              const int p = 2 * f + s;
              __m256i w0, w1;
              half_codes<HB>(o, o + HIGH, p, h, w0, w1);
              for (int i = 0; i < MR; ++i) {
                const int8_t* v = x.q.data() + (i0 + i) * K + blk * 32 + p * 8;
                const __m256i x0 = bcast4_256(v), x1 = bcast4_256(v + 4);
                d16[i] = _mm256_add_epi16(d16[i],
                                          _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)));
              }
            });
            for (int i = 0; i < MR; ++i) {
              const __m256i part = _mm256_madd_epi16(d16[i], ones);
              isum[i] = f == 0 ? part : _mm256_add_epi32(isum[i], part);
            }
          }
        }
        const __m256 d = F32D ? _mm256_loadu_ps(reinterpret_cast<const float*>(o + D) + 8 * h)
                              : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + D + 16 * h)));
        const __m256 m = OWN_MINS ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + D + 32 + 16 * h)))
                                  : _mm256_mul_ps(d, _mm256_set1_ps(M_OF_D));
        for (int i = 0; i < MR; ++i) {
          const int64_t b = (i0 + i) * nb + blk;
          accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(d, _mm256_set1_ps(x.d[b])), accf[i]);
          if constexpr (!LUT) accf[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sum[b]), accf[i]);
        }
      }
      for (int i = 0; i < MR; ++i) store_half(accf[i], h, rows, y + i * ldy);
    }
  }
};

// the packing at load of block type B, if any (ON)
template <typename B>
using LoadPack = std::conditional_t<K8Pack<B>::ON, K8Pack<B>, B32Pack<B>>;

#endif  // WOQ_SIMD
}  // namespace woq
