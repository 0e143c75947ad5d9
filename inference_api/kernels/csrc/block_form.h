// A GGUF tensor served in its own blocks: the kernels over any block type of gguf_legacy.h, gguf_kquants.h and
// gguf_float.h, read through the traits those give. The weight is the file's bytes, row by row: raw [N, row_bytes].
//
// - int8 inputs (--dtype auto), any number of rows: each chunk of 32 weights' codes multiplies the inputs'
//   int8 block in integers (vpdpbusd with AVX512-VNNI, else u8 x s8 pairs), scaled by the sub-blocks' scales
//   and the input block's step; the minimums multiply the inputs' exact sums per sub-block, once per block.
//   Each weight block is unpacked once for up to 4 input rows.
// - float inputs (the exact mode, and the float types): blocks dequantized into a buffer in L1, then the
//   float kernels of drivers.h.
#pragma once
#include <tuple>
#include "drivers.h"
#include "gguf_float.h"
#include "gguf_kquants.h"
#include "k8_pack.h"
#include "q8.h"

namespace woq {
#ifdef WOQ_SIMD

template <typename B, typename = void>
struct has_codes : std::false_type {};
template <typename B>
struct has_codes<B, std::void_t<decltype(&B::template codes<V256>)>> : std::true_type {};

// a block of an integer type dequantized into out [QK]
template <typename B>
inline void deq_block(const uint8_t* b, float* out) {
  if constexpr (!has_codes<B>::value) {
    B::deq(b, out);
  } else {
    float d[B::QK / B::SUB], m[B::QK / B::SUB];
    B::scales(b, d, m);
    for (int c = 0; c < B::QK / 32; ++c) {
      const __m256i codes = B::template codes<V256>(b, b, c);
      const __m128i half[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
      for (int g = 0; g < 4; ++g) {
        const __m128i part = g % 2 ? _mm_srli_si128(half[g / 2], 8) : half[g / 2];
        const __m256i wide = B::SIGNED ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
        const int s = (c * 32 + g * 8) / B::SUB;
        _mm256_storeu_ps(out + c * 32 + g * 8,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(d[s]), _mm256_set1_ps(m[s])));
      }
    }
  }
}

// the scales of chunk c as the 8 int32 lanes of its dot products hold them (lanes 0..3: weights 0..15)
template <typename B>
inline __m256 lane_scales(const float* d, int c) {
  if constexpr (B::SUB == 16) return _mm256_set_m128(_mm_set1_ps(d[2 * c + 1]), _mm_set1_ps(d[2 * c]));
  else return _mm256_set1_ps(d[c * 32 / B::SUB]);
}

// weights per scale: a sub-block (the float types: a block)
template <typename B>
constexpr int sub_of() {
  if constexpr (has_codes<B>::value) return B::SUB;
  else return B::QK;
}

// the k-quants: super-blocks of 256 with integer sub-block scales (iscales), the kernels' Q8_K inputs
template <typename B, typename = void>
struct has_iscales : std::false_type {};
template <typename B>
struct has_iscales<B, std::void_t<decltype(&B::iscales)>> : std::true_type {};

// the 32 int16 pair sums of a chunk (maddubs) times its sub-blocks' integer scales, as 8 int32 lanes
template <typename B>
inline __m256i chunk_scales(const int16_t* S, int c) {
  if constexpr (B::SUB == 16) return _mm256_set_m128i(_mm_set1_epi16(S[2 * c + 1]), _mm_set1_epi16(S[2 * c]));
  else return _mm256_set1_epi16(S[c]);
}
// the minimums' integers against the inputs' 16 sums of a super-block (a sub-block of 32 has two of them)
template <typename B>
inline __m256i min_lanes(const int16_t* N) {
  if constexpr (B::SUB == 16) {
    return _mm256_loadu_si256((const __m256i*)N);
  } else {
    const __m128i v = _mm_loadu_si128((const __m128i*)N);
    return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v));
  }
}

template <typename B>
struct BlockForm {
  const uint8_t* w;  // raw [N, row_bytes]
  int64_t N, K, row_bytes;
  const uint8_t* packed = nullptr;  // the k-quants K8Pack packs at load (k8_pack.h), when given
  static constexpr bool Q8 = has_codes<B>::value;
  static constexpr bool K8 = has_iscales<B>::value;  // the k-quants: Q8_K inputs (k8_dot, k8_tile)
  static constexpr int64_t K8_AHEAD = 16;            // how many passes ahead k8_dot prefetches
#ifdef WOQ_VNNI
  static constexpr bool VNNI = Q8 && !K8;  // blocks of 32: the VNNI tiles, each group of 16 rows packed on the fly
#else
  static constexpr bool VNNI = false;
#endif
  static constexpr bool ONE_ROW = VNNI;  // one input row: vnni_one, the tiles' numbers without the packing
  static constexpr bool HALVES = sub_of<B>() == 16;
  static constexpr bool B32 = B32Pack<B>::ON;  // Q5_0, Q5_1 packed at load (packed_tile); the k-quants go by K8
  static constexpr bool AVX2_TILE = B32;

  BlockForm(const uint8_t* raw, int64_t n, int64_t row) : w(raw), N(n), K(row / B::BYTES * B::QK), row_bytes(row) {}
  bool vnni_ready() const { return VNNI; }
  bool avx2_ready() const { return packed != nullptr; }
  bool q8_ready() const { return Q8; }
  bool vec_ready() const { return true; }

  // weight row n's inputs k0 .. k0 + kc into out
  void deq(int64_t n, int64_t k0, int64_t kc, float* out) const {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t k = k0; k < k0 + kc;) {
      const int64_t blk = k / B::QK, off = k % B::QK, take = std::min<int64_t>(B::QK - off, k0 + kc - k);
      if (take == B::QK) {
        deq_block<B>(row + blk * B::BYTES, out + k - k0);
      } else {
        alignas(64) float t[B::QK];
        deq_block<B>(row + blk * B::BYTES, t);
        std::memcpy(out + k - k0, t + off, take * sizeof(float));
      }
      k += take;
    }
  }

  std::vector<float> one_row_inputs(const float*) const { return {}; }
  float dot_row(const float* x, const std::vector<float>& aux, int64_t n) const {
    float y;
    dot_rows(x, aux, n, 1, &y);
    return y;
  }

  // float inputs, one row: y[r] for weight rows n .. n + rows, each block dequantized into L1 first
  void dot_rows(const float* x, const std::vector<float>&, int64_t n, int64_t rows, float* y) const {
    alignas(64) float t[B::QK];
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = w + (n + r) * row_bytes;
      Vec::T acc = Vec::zero();
      for (int64_t blk = 0; blk < K / B::QK; ++blk) {
        deq_block<B>(row + blk * B::BYTES, t);
        for (int j = 0; j < B::QK; j += W) acc = Vec::fma(Vec::load(t + j), Vec::load(x + blk * B::QK + j), acc);
      }
      y[r] = Vec::sum(acc);
    }
  }

#ifdef WOQ_VNNI
  // The VNNI tiles over GGUF blocks: a group of 16 weight rows is packed once per call into this thread's buffer
  // (vnni_prepare): the codes as the tiles read them ([K / 4 steps][16 rows][4], unsigned: signed codes plus 128,
  // taken back through the inputs' integer sums), and each sub-block's scales and minimums [K / SUB][16]; then every
  // tile of input rows passes over it (vnni_tile): per sub-block, vpdpbusd sums of the codes and the int8 inputs,
  // scaled by the rows' scales times the input block's step, plus the minimums times the inputs' exact sums: the
  // numbers of dot_q8, summed in another order. A row's numbers are the same whatever the rows beside it.
  struct Group {
    std::vector<uint8_t> codes;
    std::vector<float> d, m;        // per sub-block (blocks of 32), or per super-block D and M (the k-quants)
    std::vector<int32_t> isc, imn;  // the k-quants: each sub-block's integer scale [K / SUB][16], and the
                                    // minimums of each two 16s of inputs as int16 pairs [K / 32][16]
    int64_t rows = 0;
  };
  static constexpr int64_t PREFETCH_GROUPS = 2;  // how far ahead the packing prefetches

  static Group& group_buffer() {
    thread_local Group g;
    return g;
  }

  // the 16 rows' scales and minimums of block blk (blocks of 32: one scale each), each row's in its lane: d, m [16]
  static void group_scales(const uint8_t* const* wr, int64_t blk, float* dout, float* mout) {
    static_assert(B::QK == B::SUB, "the tiles over int8 inputs in blocks of 32 take one scale a block");
    for (int r = 0; r < 16; ++r) B::scales(wr[r] + blk * B::BYTES, dout + r, mout + r);
  }

  // the 16 weight rows of the group from row n0 (rows past N read row n0 again; their sums are never stored)
  void group_rows(int64_t n0, int64_t rows, const uint8_t* wr[16]) const {
    for (int r = 0; r < 16; ++r) wr[r] = w + (n0 + (r < rows ? r : 0)) * row_bytes;
  }

  // block blk's share (of nb) of fetching the group PREFETCH_GROUPS ahead: 16 rows are one run of 16 * row_bytes
  void prefetch_ahead(int64_t n0, int64_t blk, int64_t nb) const {
    const char* ahead = reinterpret_cast<const char*>(w + (n0 + 16 * PREFETCH_GROUPS) * row_bytes);
    const int64_t lines = (16 * row_bytes + 63) / 64, per_block = (lines + nb - 1) / nb;
    for (int64_t l = blk * per_block; l < std::min(lines, (blk + 1) * per_block); ++l)
      _mm_prefetch(ahead + l * 64, _MM_HINT_T0);
  }

  // chunk c of block blk of two rows (a's bytes, then b's) as vpdpbusd's unsigned operand: signed codes plus 128
  static __m512i unsigned_codes(const uint8_t* a, const uint8_t* b, int64_t blk, int c) {
    __m512i codes = B::template codes<V512>(a + blk * B::BYTES, b + blk * B::BYTES, c);
    if constexpr (B::SIGNED) codes = _mm512_xor_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80)));
    return codes;
  }

  // One input row over the group of 16 weight rows from grp * 16, y[r] for its rows (the first min(16, N - grp * 16)
  // written), without packing: each chunk's codes are read in the rows' own layout, two rows to a register
  // (vpdpbusd against the input block broadcast to both halves), and the 16 rows' partial sums reduced by a tree
  // into the rows' lanes. The integer sums are exact, so each row's numbers are vnni_tile's to the bit.
  void vnni_one(const Q8Rows& x, int64_t grp, float* y) const {
    if constexpr (Q8) {
      constexpr int CH = B::QK / 32, NS = B::QK / B::SUB;
      const int64_t n0 = grp * 16, nb = K / B::QK, rows = std::min<int64_t>(16, N - n0);
      // register i holds rows (i, i + 4) for i < 4 and (i + 4, i + 8) after: the tree leaves row r in lane r
      const uint8_t* wr[16];
      group_rows(n0, rows, wr);
      const uint8_t *lo[8], *hi[8];
      for (int i = 0; i < 8; ++i) lo[i] = wr[i < 4 ? i : i + 4], hi[i] = wr[i < 4 ? i + 4 : i + 8];
      const float* xs = HALVES ? x.half.data() : x.sum.data();
      __m512 acc = _mm512_setzero_ps();
      for (int64_t blk = 0; blk < nb; ++blk) {
        prefetch_ahead(n0, blk, nb);
        alignas(64) float dv[NS * 16], mv[NS * 16];
        group_scales(wr, blk, dv, mv);
        for (int c = 0; c < CH; ++c) {
          const int64_t k = blk * B::QK + c * 32;
          const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(x.q.data() + k)));
          __m512i a[8];
          for (int i = 0; i < 8; ++i)
            a[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), unsigned_codes(lo[i], hi[i], blk, c), xv);
          __m512i t[4], u[2];
          for (int i = 0; i < 4; ++i)
            t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                    _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
          for (int i = 0; i < 2; ++i)
            u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                    _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
          // 128-bit lanes of u: [a0..a3's sums] over each quarter of the registers; the halves of 16 codes apart
          const __m512i first = _mm512_shuffle_i32x4(u[0], u[1], 0x88), second = _mm512_shuffle_i32x4(u[0], u[1], 0xdd);
          __m512i dots[2];
          int parts;
          if constexpr (HALVES) dots[0] = first, dots[1] = second, parts = 2;
          else dots[0] = _mm512_add_epi32(first, second), parts = 1;
          for (int p = 0; p < parts; ++p) {
            const int js = c * 32 / B::SUB + p;  // sub-block in the block
            const int64_t xb = k / 32, j = blk * NS + js;
            __m512 sums = _mm512_cvtepi32_ps(dots[p]);
            if constexpr (B::SIGNED) sums = _mm512_add_ps(sums, _mm512_set1_ps(x.less128[xb]));
            acc = _mm512_fmadd_ps(sums, _mm512_mul_ps(_mm512_load_ps(dv + js * 16), _mm512_set1_ps(x.d[xb])), acc);
            if constexpr (B::MINS) acc = _mm512_fmadd_ps(_mm512_load_ps(mv + js * 16), _mm512_set1_ps(xs[j]), acc);
          }
        }
      }
      _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << rows) - 1), acc);
    }
  }

  void vnni_prepare(int64_t grp) const {
    if constexpr (Q8) {
      constexpr int CH = B::QK / 32, NS = B::QK / B::SUB;
      Group& g = group_buffer();
      const int64_t n0 = grp * 16, nb = K / B::QK;
      g.rows = std::min<int64_t>(16, N - n0);
      g.codes.resize(K * 16);
      if constexpr (K8) {
        g.d.resize(nb * 16), g.m.resize(nb * 16), g.isc.resize(nb * NS * 16), g.imn.resize(nb * 8 * 16);
      } else {
        g.d.resize(K / B::SUB * 16), g.m.resize(K / B::SUB * 16);
      }
      const uint8_t* wr[16];
      group_rows(n0, g.rows, wr);
      const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13),
                    hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
      for (int64_t blk = 0; blk < nb; ++blk) {
        prefetch_ahead(n0, blk, nb);
        if constexpr (K8) {  // each row's integer scales and factors into its lane
          for (int r = 0; r < 16; ++r) {
            alignas(32) int16_t S[16], Nm[16];
            float D, M;
            B::iscales(wr[r] + blk * B::BYTES, S, Nm, D, M);
            g.d[blk * 16 + r] = D, g.m[blk * 16 + r] = M;
            for (int j = 0; j < NS; ++j) g.isc[(blk * NS + j) * 16 + r] = S[j];
            for (int p = 0; p < 8; ++p) {  // the minimums of inputs 32p .. 32p + 15 and 32p + 16 .. 32p + 31
              const int16_t lo = Nm[2 * p * 16 / B::SUB], hi = Nm[(2 * p + 1) * 16 / B::SUB];
              g.imn[(blk * 8 + p) * 16 + r] = static_cast<int32_t>(
                  static_cast<uint16_t>(lo) | static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
            }
          }
        } else {
          group_scales(wr, blk, g.d.data() + blk * NS * 16, g.m.data() + blk * NS * 16);
        }
        for (int c = 0; c < CH; ++c) {
          // rows i and i + 8 side by side, then an 8 x 8 transpose of 4-byte steps in each half
          __m512i a[8];
          for (int i = 0; i < 8; ++i) a[i] = unsigned_codes(wr[i], wr[i + 8], blk, c);
          __m512i t[8], u[8];
          for (int i = 0; i < 8; i += 2)
            t[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
          for (int q = 0; q < 8; q += 4) {
            u[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
            u[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
            u[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
            u[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
          }
          uint8_t* out = g.codes.data() + (blk * B::QK + c * 32) * 16;  // 8 steps of 64 bytes
          for (int s4 = 0; s4 < 4; ++s4) {
            _mm512_storeu_si512(out + s4 * 64, _mm512_permutex2var_epi64(u[s4], lo, u[s4 + 4]));
            _mm512_storeu_si512(out + (s4 + 4) * 64, _mm512_permutex2var_epi64(u[s4], hi, u[s4 + 4]));
          }
        }
      }
    }
  }

  // The k-quants' tiles: y[i * ldy + r] for the MR input rows from i0 (Q8_K inputs) and the group's rows r. Per
  // super-block and row: the sub-blocks' vpdpbusd sums times their integer scales, and the inputs' 16 sums times
  // the minimums' integers, both exact; then acc = fma(D * dx, isum, acc), acc = fma(M * dx, imin, acc): k8_dot's
  // numbers to the bit.
  template <int MR>
  void k8_tile(const Q8KRows& x, int64_t i0, float* y, int64_t ldy) const {
    if constexpr (K8) {
      constexpr int STEPS = B::SUB / 4, NS = 256 / B::SUB;
      const Group& g = group_buffer();
      const int64_t nb = K / 256;
      __m512 acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t blk = 0; blk < nb; ++blk) {
        __m512i isum[MR];
        for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
        for (int j = 0; j < NS; ++j) {
          __m512i dot[MR];
          for (int i = 0; i < MR; ++i) dot[i] = _mm512_setzero_si512();
          for (int s = 0; s < STEPS; ++s) {
            const __m512i wv = _mm512_loadu_si512(g.codes.data() + ((blk * NS + j) * STEPS + s) * 64);
            for (int i = 0; i < MR; ++i) {
              dot[i] = _mm512_dpbusd_epi32(dot[i], wv,
                                           bcast4_512(x.q.data() + (i0 + i) * K + blk * 256 + j * B::SUB + s * 4));
            }
          }
          const __m512i sc = _mm512_loadu_si512(g.isc.data() + (blk * NS + j) * 16);
          for (int i = 0; i < MR; ++i) isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(dot[i], sc));
        }
        const __m512 dv = _mm512_loadu_ps(g.d.data() + blk * 16), mv = _mm512_loadu_ps(g.m.data() + blk * 16);
        for (int i = 0; i < MR; ++i) {
          const float dx = x.d[(i0 + i) * nb + blk];
          const int16_t* bs = x.bsum.data() + ((i0 + i) * nb + blk) * 16;
          __m512i imin = _mm512_setzero_si512();
          for (int p = 0; p < 8; ++p)  // two 16s of inputs' sums against their minimums per vpdpwssd
            imin = _mm512_dpwssd_epi32(imin, _mm512_loadu_si512(g.imn.data() + (blk * 8 + p) * 16),
                                       bcast4_512(bs + 2 * p));
          // signed codes went plus 128 (unsigned_codes); their minimums' integers are the scales
          if constexpr (B::SIGNED) isum[i] = _mm512_sub_epi32(isum[i], _mm512_slli_epi32(imin, 7));
          acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum[i]), acc[i]);
          if constexpr (B::MINS)
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(mv, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(imin), acc[i]);
        }
      }
      const __mmask16 keep = static_cast<__mmask16>((1u << g.rows) - 1);
      for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * ldy, keep, acc[i]);
    }
  }

  // y[i * ldy + r] for the MR input rows from i0 and the group's rows r (its first g.rows written)
  template <int MR>
  void vnni_tile(const Q8Rows& x, int64_t, int64_t i0, float* y, int64_t ldy) const {
    if constexpr (Q8) {
      constexpr int STEPS = B::SUB / 4;
      const Group& g = group_buffer();
      const int64_t S = K / B::SUB;
      const float* xs = HALVES ? x.half.data() : x.sum.data();
      __m512 acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t j = 0; j < S; ++j) {
        __m512i dot[MR];  // signed codes went plus 128: each sum starts at -128 times the input block's
        for (int i = 0; i < MR; ++i)
          dot[i] =
              B::SIGNED ? _mm512_set1_epi32(x.less128[(i0 + i) * (K / 32) + j * B::SUB / 32]) : _mm512_setzero_si512();
        for (int s = 0; s < STEPS; ++s) {
          const __m512i wv = _mm512_loadu_si512(g.codes.data() + (j * STEPS + s) * 64);
          for (int i = 0; i < MR; ++i) {
            dot[i] = _mm512_dpbusd_epi32(dot[i], wv, bcast4_512(x.q.data() + (i0 + i) * K + j * B::SUB + s * 4));
          }
        }
        const __m512 dv = _mm512_loadu_ps(g.d.data() + j * 16), mv = _mm512_loadu_ps(g.m.data() + j * 16);
        for (int i = 0; i < MR; ++i) {
          const int64_t xb = (i0 + i) * (K / 32) + j * B::SUB / 32;
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(dv, _mm512_set1_ps(x.d[xb])), acc[i]);
          if constexpr (B::MINS) acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[(i0 + i) * S + j]), acc[i]);
        }
      }
      const __mmask16 keep = static_cast<__mmask16>((1u << g.rows) - 1);
      for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * ldy, keep, acc[i]);
    }
  }
#else
  template <int MR>
  void avx2_tile(const Q8Rows& x, int64_t grp, int64_t i0, float* y, int64_t ldy) const {
    packed_tile<MR>(x, grp, i0, y, ldy);
  }
#endif

  // the tiles over the group packed at load (LoadPack: K8Pack for the k-quants against Q8_K inputs, B32Pack for
  // Q5_0 and Q5_1 against blocks of 32; tile, or tile_avx2 without VNNI): y[i * ldy + r] for the MR input rows from
  // i0, the numbers of the tiles over the blocks packed per call
  template <int MR, typename Rows>
  void packed_tile(const Rows& x, int64_t grp, int64_t i0, float* y, int64_t ldy) const {
    using P = LoadPack<B>;
    if constexpr (P::ON) {
      const uint8_t* g = packed + grp * (K / P::QK) * P::PB;
      const int64_t rows = std::min<int64_t>(16, N - grp * 16);
#ifdef WOQ_VNNI
      P::template tile<MR>(g, K, x, i0, y, ldy, rows);
#else
      P::template tile_avx2<MR>(g, K, x, i0, y, ldy, rows);
#endif
    }
  }

  // Q8_K inputs (the k-quants), without the tiles: y[ii * ldy + r] for input rows i .. i + MR and weight rows
  // n .. n + rows (rows <= RW), each weight chunk unpacked once for the MR input rows. Per super-block and row: the
  // chunks' u8 x s8 pair sums times the sub-blocks' integer scales, and the inputs' 16 sums times the minimums'
  // integers, both exact; then acc = fma(D * dx, isum, acc), acc = fma(M * dx, imin, acc), as k8_tile does.
  template <int RW, int MR>
  void k8_dot(const Q8KRows& x, int64_t i, int64_t n, int64_t rows, float* y, int64_t ldy) const {
    if constexpr (K8) {
      const int64_t nb = K / 256;
      const uint8_t* wr[RW];
      for (int r = 0; r < RW; ++r) wr[r] = w + (n + (r < rows ? r : 0)) * row_bytes;
      float acc[RW][MR];
      for (int r = 0; r < RW; ++r)
        for (int ii = 0; ii < MR; ++ii) acc[r][ii] = 0.f;
      // the rows of the pass K8_AHEAD passes on, into L2: one stream's decode reads at 25 against 11 GB/s without it
      // on a 2-core EPYC (Qwen2.5 1.5B's Q4_K gate_up; 15 GB/s 4 passes ahead into L1)
      const uint8_t* ahead = w + (n + K8_AHEAD * RW) * row_bytes;
      for (int64_t blk = 0; blk < nb; ++blk) {
        for (int r = 0; r < RW; ++r)
          for (int64_t l = 0; l < B::BYTES; l += 64)
            _mm_prefetch((const char*)(ahead + r * row_bytes + blk * B::BYTES + l), _MM_HINT_T1);
        alignas(32) int16_t S[RW][16], Nm[RW][16];
        float D[RW], M[RW];
        for (int r = 0; r < RW; ++r) B::iscales(wr[r] + blk * B::BYTES, S[r], Nm[r], D[r], M[r]);
        __m256i isum[RW][MR];
        for (int r = 0; r < RW; ++r)
          for (int ii = 0; ii < MR; ++ii) isum[r][ii] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {  // unrolled: each chunk's offsets and shifts are constants
          __m256i codes[RW], sc[RW];
          for (int r = 0; r < RW; ++r) {
            codes[r] = B::template codes<V256>(wr[r] + blk * B::BYTES, wr[r] + blk * B::BYTES, c);
            sc[r] = chunk_scales<B>(S[r], c);
          }
          for (int ii = 0; ii < MR; ++ii) {
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(x.q.data() + (i + ii) * K + blk * 256 + c * 32));
            for (int r = 0; r < RW; ++r) {  // pairs of codes up to 63 (or levels up to 127) against |inputs| <= 127
              const __m256i pairs =
                  B::SIGNED ? _mm256_maddubs_epi16(_mm256_sign_epi8(codes[r], codes[r]), _mm256_sign_epi8(xv, codes[r]))
                            : _mm256_maddubs_epi16(codes[r], xv);
              isum[r][ii] = _mm256_add_epi32(isum[r][ii], _mm256_madd_epi16(pairs, sc[r]));
            }
          }
        }
        __m256i mins[RW];
        for (int r = 0; r < RW; ++r) mins[r] = min_lanes<B>(Nm[r]);
        for (int ii = 0; ii < MR; ++ii) {
          const __m256i bs = _mm256_loadu_si256((const __m256i*)(x.bsum.data() + ((i + ii) * nb + blk) * 16));
          const float dx = x.d[(i + ii) * nb + blk];
          for (int r = 0; r < RW; ++r) {
            acc[r][ii] = std::fma(D[r] * dx, static_cast<float>(hsum_i32(isum[r][ii])), acc[r][ii]);
            if constexpr (B::MINS)  // (IQ4_XS: signed levels, no minimums)
              acc[r][ii] =
                  std::fma(M[r] * dx, static_cast<float>(hsum_i32(_mm256_madd_epi16(bs, mins[r]))), acc[r][ii]);
          }
        }
      }
      for (int r = 0; r < rows; ++r)
        for (int ii = 0; ii < MR; ++ii) y[ii * ldy + r] = acc[r][ii];
    }
  }

  // int8 inputs: y[ii * ldy + r] for input rows i .. i + MR of x and weight rows n .. n + rows (rows <= RW)
  template <int RW, int MR>
  void dot_q8(const Q8Rows& x, int64_t i, int64_t n, int64_t rows, float* y, int64_t ldy) const {
    if constexpr (Q8) {
      constexpr int CH = B::QK / 32, NS = B::QK / B::SUB;
      const int64_t nb = K / B::QK;
      const uint8_t* wr[RW];
      for (int r = 0; r < RW; ++r) wr[r] = w + (n + (r < rows ? r : 0)) * row_bytes;
      const int8_t* xq[MR];
      const float *dx[MR], *xs[MR];
      for (int ii = 0; ii < MR; ++ii) {
        xq[ii] = x.q.data() + (i + ii) * K;
        dx[ii] = x.d.data() + (i + ii) * K / 32;
        xs[ii] = HALVES ? x.half.data() + (i + ii) * K / 16 : x.sum.data() + (i + ii) * K / 32;
      }
      __m256 acc[RW][MR];
      float macc[RW][MR];
      for (int r = 0; r < RW; ++r)
        for (int ii = 0; ii < MR; ++ii) acc[r][ii] = _mm256_setzero_ps(), macc[r][ii] = 0.f;
      const uint8_t* ahead = w + (n + AHEAD * RW) * row_bytes;  // the rows of a pass AHEAD passes on
      for (int64_t blk = 0; blk < nb; ++blk) {
        for (int r = 0; r < RW; ++r)
          for (int64_t l = 0; l < B::BYTES; l += 64)
            _mm_prefetch((const char*)(ahead + r * row_bytes + blk * B::BYTES + l), _MM_HINT_T0);
        float d[RW][NS], m[RW][NS];
        for (int r = 0; r < RW; ++r) B::scales(wr[r] + blk * B::BYTES, d[r], m[r]);
        for (int c = 0; c < CH; ++c) {
          __m256i codes[RW];
          __m256 sc[RW];
          for (int r = 0; r < RW; ++r) {
            codes[r] = B::template codes<V256>(wr[r] + blk * B::BYTES, wr[r] + blk * B::BYTES, c);
            sc[r] = lane_scales<B>(d[r], c);
          }
          for (int ii = 0; ii < MR; ++ii) {
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq[ii] + blk * B::QK + c * 32));
            const __m256 step = _mm256_set1_ps(dx[ii][blk * CH + c]);
            for (int r = 0; r < RW; ++r) {
              const __m256i p = B::SIGNED
                                    ? dot_u8s8_i32(_mm256_sign_epi8(codes[r], codes[r]), _mm256_sign_epi8(xv, codes[r]))
                                    : dot_u8s8_i32(codes[r], xv);
              acc[r][ii] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sc[r], step), acc[r][ii]);
            }
          }
        }
        if constexpr (B::MINS) {
          for (int r = 0; r < RW; ++r)
            for (int ii = 0; ii < MR; ++ii) {
              float t = 0.f;
              const float* s = xs[ii] + blk * NS;
#pragma omp simd reduction(+ : t)
              for (int j = 0; j < NS; ++j) t += m[r][j] * s[j];
              macc[r][ii] += t;
            }
        }
      }
      for (int r = 0; r < rows; ++r)
        for (int ii = 0; ii < MR; ++ii) y[ii * ldy + r] = sum8(acc[r][ii]) + macc[r][ii];
    }
  }
};

// The block types served in their own blocks, and f(Block{}) for one of them by ggml's type number (false if none)
using BlockTypes = std::tuple<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, F16, BF16,
                              IQ3_XXS_L, IQ2_XXS_L, IQ1_S_L>;

template <typename F>
inline bool with_block(int64_t type, F f) {
  return std::apply([&](auto... b) { return ((decltype(b)::TYPE == type ? (f(b), true) : false) || ...); },
                    BlockTypes{});
}

#endif  // WOQ_SIMD
}  // namespace woq
