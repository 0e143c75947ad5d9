// The weight layouts of quant.py: 8-bit groups (int8 q, a float scale per group of G inputs: GGUF's Q8_0 for
// G = 32) and 4-bit blocks of 32 (nibbles, float16 scale d and minimum m: Q4_1's blocks, Q4_0's with m = -8 d),
// with their kernels and the forms the ladder reads them through.
#pragma once
#include "q8.h"

namespace woq {

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
// Dequantized rows with the vector unit (several rows' chunks are dequantized before the tiles or sgemm
// multiply them).
inline void deq_row_i4_vec(const uint8_t* q, const c10::Half* d, const c10::Half* m, int64_t K, float* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const Vec::T dv = Vec::set1(half_to_float(d[g])), mv = Vec::set1(half_to_float(m[g]));
#ifdef __AVX512F__
    for (int v = 0; v < 2; ++v) Vec::store(out + g * 32 + v * W, Vec::fma(Vec::nibbles(q + g * 16, v * 4), dv, mv));
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
#ifndef WOQ_VNNI
// vnni_i4_tile's numbers on AVX2 (below), over the same packing: per half of the group (8 weight rows, 32 of each
// step's 64 bytes), vpmaddubsw of the nibbles against the input's 4 bytes broadcast, the pair sums of a whole block
// added in int16 (8 steps of at most 2 * 15 * 127), then summed into int32 per row (vpmaddwd by ones): each block's
// integer sum is exact, so the floats after it are vnni_i4_tile's to the bit.
template <int MR>
inline void avx2_i4_tile(const uint8_t* wp, const c10::Half* dm, int64_t S, const int8_t* xq, const float* dx,
                         const float* xs, int64_t K, float* y, int64_t ldy, int64_t rows) {
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 accf[MR];
    for (int i = 0; i < MR; ++i) accf[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < S; ++g) {
      __m256i acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
      avx2_steps<MR, 4>([&](int a) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wp + (g * 4 + a) * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int i = 0; i < MR; ++i) {
          const int8_t* x = xq + i * K + g * 32 + 4 * a;
          acc[i] = _mm256_add_epi16(acc[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4_256(x)),
                                                             _mm256_maddubs_epi16(hi, bcast4_256(x + 16))));
        }
      });
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + g * 32 + 8 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + g * 32 + 16 + 8 * h)));
      for (int i = 0; i < MR; ++i) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[i], ones));
        accf[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[i * S + g])), accf[i]);
        accf[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[i * S + g]), accf[i]);
      }
    }
    for (int i = 0; i < MR; ++i) store_half(accf[i], h, rows, y + i * ldy);
  }
}

// 8 scales of a half group's block, float or float16 (a GGUF's Q8_0 and IQ4_NL: float16 values)
inline __m256 half_scales(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 half_scales(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// vnni_i8_tile's numbers on AVX2, over the same packing (quant.vnni_int8: each weight plus 128): each step's 8 rows x
// 4 weights of a half group back to signed (xor 128) and their magnitudes, once for the MR input rows; per input row
// the sign trick (vpsignb moves each weight's sign onto the input's broadcast bytes), vpmaddubsw and vpmaddwd by
// ones into int32 per row (a pair of int8 products fills int16: no sums in int16 here). Up to 2 input rows take
// both halves in one pass over the weights (one stream reads each byte once, ahead of use), more a half a pass.
// Each block's integer sum is exact, so the floats after it are vnni_i8_tile's to the bit.
template <int MR, typename T>
inline void avx2_i8_tile(const uint8_t* wp, const T* sc, int64_t S, const int8_t* xq, const float* dx, int64_t K,
                         float* y, int64_t ldy, int64_t rows, bool ahead) {
  constexpr int HS = MR <= 2 ? 2 : 1;  // halves a pass
  constexpr int64_t AHEAD_BLOCKS = 32;
  const __m256i ones = _mm256_set1_epi16(1), plus128 = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int h0 = 0; h0 < 2; h0 += HS) {
    __m256 accf[HS][MR];
    for (int h = 0; h < HS; ++h)
      for (int i = 0; i < MR; ++i) accf[h][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < S; ++g) {
      if (ahead && h0 == 0)
        for (int l = 0; l < 512; l += 64) _mm_prefetch((const char*)(wp + (g + AHEAD_BLOCKS) * 512 + l), _MM_HINT_T0);
      __m256i acc[HS][MR];
      for (int h = 0; h < HS; ++h)
        for (int i = 0; i < MR; ++i) acc[h][i] = _mm256_setzero_si256();
      for (int a = 0; a < 8; ++a) {
        __m256i xb[MR];
        for (int i = 0; i < MR; ++i) xb[i] = bcast4_256(xq + i * K + g * 32 + 4 * a);
        for (int h = 0; h < HS; ++h) {
          const __m256i w =
              _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(wp + (g * 8 + a) * 64 + (h0 + h) * 32)), plus128);
          const __m256i aw = _mm256_abs_epi8(w);
          for (int i = 0; i < MR; ++i) {
            const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb[i], w));
            acc[h][i] = _mm256_add_epi32(acc[h][i], _mm256_madd_epi16(p, ones));
          }
        }
      }
      for (int h = 0; h < HS; ++h) {
        const __m256 s = half_scales(sc + g * 16 + 8 * (h0 + h));
        for (int i = 0; i < MR; ++i)
          accf[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[h][i]), _mm256_mul_ps(s, _mm256_set1_ps(dx[i * S + g])),
                                       accf[h][i]);
      }
    }
    for (int h = 0; h < HS; ++h)
      for (int i = 0; i < MR; ++i) store_half(accf[h][i], h0 + h, rows, y + i * ldy);
  }
}
#endif  // !WOQ_VNNI

#ifdef WOQ_VNNI
// Any number of rows with int8 inputs on AVX512-VNNI: each vpdpbusd multiplies 16 weight rows by 4 inputs of one
// input row and adds the 4 products into each row's int32 lane (64 multiply-adds per instruction, against
// 16 for a float32 FMA). The weights are packed once at load (quant.py: vnni_int4, vnni_int8) so that one
// 64-byte load gives 16 rows x 4 inputs: [N / 16, blocks of 32, steps of 4 inputs, 16 rows, 4] bytes. The
// input's 4 bytes are broadcast; each block's integer sums are scaled into float accumulators.

// how many blocks of 32 ahead a group's first tile prefetches (about 32 KB of a group's weights)
constexpr int64_t TILE_AHEAD = 64;

// y[i * ldy + 0 .. 16) for MR input rows and one group of 16 weight rows of 4-bit blocks: wp [S, 4, 16, 4]
// bytes (byte j of step a: weight 4a + j in its low nibble, 16 + 4a + j in its high), dm [S, 2, 16]
// float16 (scales, minimums); xq [MR, K] int8, dx and xs [MR, S]; ahead: the group's first tile (it prefetches)
template <int MR>
inline void vnni_i4_tile(const uint8_t* wp, const c10::Half* dm, int64_t S, const int8_t* xq, const float* dx,
                         const float* xs, int64_t K, float* y, int64_t ldy, bool ahead) {
  const __m512i low = _mm512_set1_epi8(15);
  __m512 accf[MR];
  for (int i = 0; i < MR; ++i) accf[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < S; ++g) {
    __m512i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
    if (ahead) {  // the blocks TILE_AHEAD on into L2, as the packed k-quants do (the later tiles read the cache)
      for (int l = 0; l < 256; l += 64) _mm_prefetch((const char*)(wp + (g + TILE_AHEAD) * 256 + l), _MM_HINT_T1);
      _mm_prefetch((const char*)(dm + (g + TILE_AHEAD) * 32), _MM_HINT_T1);
    }
    for (int a = 0; a < 4; ++a) {
      const __m512i v = _mm512_loadu_si512(wp + (g * 4 + a) * 64);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = xq + i * K + g * 32 + 4 * a;
        acc[i] = _mm512_dpbusd_epi32(acc[i], lo, bcast4_512(x));
        acc[i] = _mm512_dpbusd_epi32(acc[i], hi, bcast4_512(x + 16));
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

// 16 scales of a group's block, float or float16 (the scales of a GGUF's Q8_0 and IQ4_NL are float16 values)
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// The same for 8-bit weights: wp [S, 8, 16, 4] bytes, each weight plus 128 (u8: vpdpbusd's unsigned side), sc
// [S, 16] each block's scale; xq [MR, K] the int8 inputs, dx [MR, S] their scales and less [MR, S] -128 times the
// sums of their rounded values, where each block's integer sum starts: the exact integer sum of the products, as
// from the weights themselves. A block of a row reads 32 bytes and its scale, as the file's Q8_0.
template <int MR, typename T>
inline void vnni_i8_tile(const uint8_t* wp, const T* sc, int64_t S, const int8_t* xq, const float* dx,
                         const int32_t* less, int64_t K, float* y, int64_t ldy, bool ahead) {
  __m512 accf[MR];
  for (int i = 0; i < MR; ++i) accf[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < S; ++g) {
    __m512i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_set1_epi32(less[i * S + g]);
    if (ahead) {
      for (int l = 0; l < 512; l += 64) _mm_prefetch((const char*)(wp + (g + TILE_AHEAD) * 512 + l), _MM_HINT_T1);
      _mm_prefetch((const char*)(sc + (g + TILE_AHEAD) * 16), _MM_HINT_T1);
    }
    for (int a = 0; a < 8; ++a) {
      const __m512i w = _mm512_loadu_si512(wp + (g * 8 + a) * 64);
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, bcast4_512(xq + i * K + g * 32 + 4 * a));
    }
    const __m512 s = load_scales(sc + g * 16);
    for (int i = 0; i < MR; ++i)
      accf[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_mul_ps(s, _mm512_set1_ps(dx[i * S + g])), accf[i]);
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + i * ldy, accf[i]);
}

#endif  // WOQ_VNNI
#endif  // WOQ_SIMD

// The 8-bit form as the ladder (linear.cpp) reads it: q [N, K] int8, s [N, K / G] float; vq, vs (or vsh, float16
// scales): the weights packed for the VNNI tiles (quant.vnni_int8), or null.
struct I8Form {
  const int8_t* q;
  const float* s;
  int64_t N, K, G, S;
  const uint8_t* vq = nullptr;
  const float* vs = nullptr;
  const c10::Half* vsh = nullptr;
  static constexpr bool Q8 = true, VNNI = true, K8 = false;  // integer kernels for int8 inputs; VNNI tiles
  static constexpr bool ONE_ROW = false;                     // packed at load: one row goes through the tiles too
  static constexpr bool HALVES = false, AVX2_TILE = true, B32 = false;  // the packing's tiles without VNNI too
  bool vnni_ready() const { return vq != nullptr; }
  bool avx2_ready() const { return vq != nullptr; }
  void vnni_prepare(int64_t) const {}
  bool q8_ready() const { return G % 32 == 0; }
  bool vec_ready() const;
  void deq(int64_t n, int64_t k0, int64_t kc, float* out) const {
#ifdef WOQ_SIMD
    if (G % W == 0) return deq_row_i8_vec(q + n * K, s + n * S, k0, kc, G, out);
#endif
    deq_row_i8(q + n * K, s + n * S, k0, kc, G, out);
  }
  std::vector<float> one_row_inputs(const float*) const { return {}; }
  float dot_row(const float* x, const std::vector<float>&, int64_t n) const {
    return dot_row_i8(x, q + n * K, s + n * S, K, G);
  }
#ifdef WOQ_SIMD
  template <int RW, int MR>
  void dot_q8(const Q8Rows& x, int64_t i, int64_t n, int64_t rows, float* y, int64_t ldy) const {
    dot_rows_i8_q8<RW, MR>(x.q.data() + i * K, x.d.data() + i * K / 32, q + n * K, s + n * S, K, G, rows, y, ldy);
  }
  void dot_rows(const float* x, const std::vector<float>&, int64_t n, int64_t rows, float* y) const {
    dot_rows_i8(x, q + n * K, s + n * S, K, G, rows, y);
  }
#endif
#if defined(WOQ_SIMD) && !defined(WOQ_VNNI)
  template <int MR>
  void avx2_tile(const Q8Rows& x, int64_t grp, int64_t i0, float* y, int64_t ldy) const {
    const int64_t B = K / 32, rows = std::min<int64_t>(16, N - grp * 16);
    const int8_t* xq = x.q.data() + i0 * K;
    const float* dx = x.d.data() + i0 * B;
    if (vsh != nullptr) avx2_i8_tile<MR>(vq + grp * B * 512, vsh + grp * B * 16, B, xq, dx, K, y, ldy, rows, i0 == 0);
    else avx2_i8_tile<MR>(vq + grp * B * 512, vs + grp * B * 16, B, xq, dx, K, y, ldy, rows, i0 == 0);
  }
#endif
#ifdef WOQ_VNNI
  template <int MR>
  void vnni_tile(const Q8Rows& x, int64_t grp, int64_t i0, float* y, int64_t ldy) const {
    const int64_t B = K / 32;
    const int8_t* xq = x.q.data() + i0 * K;
    const float* dx = x.d.data() + i0 * B;
    const int32_t* less = x.less128.data() + i0 * B;
    if (vsh != nullptr) vnni_i8_tile<MR>(vq + grp * B * 512, vsh + grp * B * 16, B, xq, dx, less, K, y, ldy, i0 == 0);
    else vnni_i8_tile<MR>(vq + grp * B * 512, vs + grp * B * 16, B, xq, dx, less, K, y, ldy, i0 == 0);
  }
#endif
};

// The 4-bit form: q [N, K / 2] uint8 (blocks of 32), d and m [N, K / 32] float16; vq, vs: packed for the VNNI
// tiles (quant.vnni_int4), or null.
struct I4Form {
  const uint8_t* q;
  const c10::Half *d, *m;
  int64_t N, K, S;
  const uint8_t* vq = nullptr;
  const c10::Half* vs = nullptr;
  static constexpr bool Q8 = true, VNNI = true, K8 = false, HALVES = false, ONE_ROW = false;
  static constexpr bool AVX2_TILE = true, B32 = false;  // the packing's tiles without VNNI too (avx2_i4_tile)
  bool vnni_ready() const { return vq != nullptr; }
  bool avx2_ready() const { return vq != nullptr; }
  void vnni_prepare(int64_t) const {}
  bool q8_ready() const { return true; }
  bool vec_ready() const { return true; }
  void deq(int64_t n, int64_t k0, int64_t kc, float* out) const {  // k0 and kc: multiples of 32
#ifdef WOQ_SIMD
    deq_row_i4_vec(q + (n * K + k0) / 2, d + n * S + k0 / 32, m + n * S + k0 / 32, kc, out);
#else
    deq_row_i4(q + (n * K + k0) / 2, d + n * S + k0 / 32, m + n * S + k0 / 32, kc, out);
#endif
  }
  // each block's sum of inputs, for the minimums
  std::vector<float> one_row_inputs(const float* x) const {
    std::vector<float> xsum(S);
    for (int64_t g = 0; g < S; ++g) {
      float t = 0.f;
#pragma omp simd reduction(+ : t)
      for (int j = 0; j < 32; ++j) t += x[g * 32 + j];
      xsum[g] = t;
    }
    return xsum;
  }
  float dot_row(const float* x, const std::vector<float>& xsum, int64_t n) const {
    return dot_row_i4(x, xsum.data(), q + n * K / 2, d + n * S, m + n * S, K);
  }
#ifdef WOQ_SIMD
  template <int RW, int MR>
  void dot_q8(const Q8Rows& x, int64_t i, int64_t n, int64_t rows, float* y, int64_t ldy) const {
    dot_rows_i4_q8<RW, MR>(x.q.data() + i * K, x.d.data() + i * S, x.sum.data() + i * S, q + n * K / 2, d + n * S,
                           m + n * S, K, rows, y, ldy);
  }
  void dot_rows(const float* x, const std::vector<float>& xsum, int64_t n, int64_t rows, float* y) const {
    dot_rows_i4(x, xsum.data(), q + n * K / 2, d + n * S, m + n * S, K, rows, y);
  }
#endif
#if defined(WOQ_SIMD) && !defined(WOQ_VNNI)
  template <int MR>
  void avx2_tile(const Q8Rows& x, int64_t grp, int64_t i0, float* y, int64_t ldy) const {
    avx2_i4_tile<MR>(vq + grp * S * 256, vs + grp * S * 32, S, x.q.data() + i0 * K, x.d.data() + i0 * S,
                     x.sum.data() + i0 * S, K, y, ldy, std::min<int64_t>(16, N - grp * 16));
  }
#endif
#ifdef WOQ_VNNI
  template <int MR>
  void vnni_tile(const Q8Rows& x, int64_t grp, int64_t i0, float* y, int64_t ldy) const {
    vnni_i4_tile<MR>(vq + grp * S * 256, vs + grp * S * 32, S, x.q.data() + i0 * K, x.d.data() + i0 * S,
                     x.sum.data() + i0 * S, K, y, ldy, i0 == 0);
  }
#endif
};

#ifdef WOQ_SIMD
inline bool I8Form::vec_ready() const { return G % W == 0; }
#else
inline bool I8Form::vec_ready() const { return false; }
#endif

}  // namespace woq
