// The decode step's other kernels: attention of one query token per entry over its cache row (grouped-query,
// float32, bfloat16, float16 or int8 caches), an encoder's bidirectional attention over its packed inputs, RMSNorm,
// silu(gate) * up, GELU, the rotary embedding with each token's key and value stored into the cache, and LoRA adapters'
// low-rank terms.
#include "common.h"
#include "kernels.h"

namespace woq {

namespace {

// silu(g) * u = g * sigmoid(g) * u, the sigmoid from one exponential of -|g|
inline float silu_mul_one(float g, float u) {
  const float e = fast_exp(-std::fabs(g)), r = 1.f / (1.f + e);
  return g * (g >= 0.f ? r : e * r) * u;
}

// the caches the vector paths of decode attention read: every type the caches come in (float32, bfloat16, float16,
// int8)
template <typename T>
constexpr bool vector_cache = std::is_same_v<T, float> || std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Half> ||
                              std::is_same_v<T, c10::BFloat16>;

inline bool vector_rows(int64_t D) {
#ifdef WOQ_SIMD
  return D % W == 0;
#else
  return false;
#endif
}

#ifdef WOQ_SIMD
// W elements of a cache as floats
template <typename T>
inline Vec::T cache_vec(const T* p) {
  if constexpr (std::is_same_v<T, float>) return Vec::load(p);
  else if constexpr (std::is_same_v<T, c10::Half>) return Vec::halves(p);
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return Vec::bf16s(p);
  else return Vec::int8s(p);
}

// rows [n, D] of a 16-bit or int8 cache into float out [n, D] (an int8 cache's scales are applied to the scores)
template <typename T>
inline void rows_to_float(const T* p, int64_t n, int64_t D, float* out) {
  for (int64_t j = 0; j < n * D; j += W) Vec::store(out + j, cache_vec(p + j));
}

// sg[l] = q . k_l for a query head of NQ vectors (D = NQ W) held in registers across the positions and float keys
// kf [n, D]: the same products and sums as vector_scores' loop (the common 64- and 128-float heads)
template <int NQ>
inline void vector_scores_held(const float* qg, const float* kf, int64_t n, float* sg) {
  Vec::T qv[NQ];
  for (int u = 0; u < NQ; ++u) qv[u] = Vec::load(qg + u * W);
  constexpr int64_t D = NQ * W;
  int64_t l = 0;
  for (; l + 4 <= n; l += 4) {
    const float* k0 = kf + l * D;
    Vec::T a0 = Vec::zero(), a1 = Vec::zero(), a2 = Vec::zero(), a3 = Vec::zero();
    for (int u = 0; u < NQ; ++u) {
      a0 = Vec::fma(Vec::load(k0 + u * W), qv[u], a0);
      a1 = Vec::fma(Vec::load(k0 + D + u * W), qv[u], a1);
      a2 = Vec::fma(Vec::load(k0 + 2 * D + u * W), qv[u], a2);
      a3 = Vec::fma(Vec::load(k0 + 3 * D + u * W), qv[u], a3);
    }
    Vec::sum4(a0, a1, a2, a3, sg + l);
  }
  for (; l < n; ++l) {
    Vec::T acc = Vec::zero();
    for (int u = 0; u < NQ; ++u) acc = Vec::fma(Vec::load(kf + l * D + u * W), qv[u], acc);
    sg[l] = Vec::sum(acc);
  }
}

// scores[g * stride + l] = (q_g . k_l) * scale * (ks[l], or 1) for the group's query heads q [group, D] and
// float keys kf [n, D], four positions at a time (one horizontal reduction for the four)
inline void vector_scores(const float* q, const float* kf, const c10::Half* ks, int64_t n, int64_t stride, int64_t D,
                          int64_t group, float scale, float* scores) {
  if (D == 4 * W || D == 8 * W) {  // the common head sizes (64 and 128 floats) in registers
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores + g * stride;
      if (D == 4 * W) vector_scores_held<4>(q + g * D, kf, n, sg);
      else vector_scores_held<8>(q + g * D, kf, n, sg);
      for (int64_t l = 0; l < n; ++l) sg[l] *= ks ? scale * half_to_float(ks[l]) : scale;
    }
    return;
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * D;
    float* sg = scores + g * stride;
    int64_t l = 0;
    for (; l + 4 <= n; l += 4) {
      const float* k0 = kf + l * D;
      Vec::T a0 = Vec::zero(), a1 = Vec::zero(), a2 = Vec::zero(), a3 = Vec::zero();
      for (int64_t j = 0; j < D; j += W) {
        const Vec::T qv = Vec::load(qg + j);
        a0 = Vec::fma(Vec::load(k0 + j), qv, a0);
        a1 = Vec::fma(Vec::load(k0 + D + j), qv, a1);
        a2 = Vec::fma(Vec::load(k0 + 2 * D + j), qv, a2);
        a3 = Vec::fma(Vec::load(k0 + 3 * D + j), qv, a3);
      }
      Vec::sum4(a0, a1, a2, a3, sg + l);
    }
    for (; l < n; ++l) {
      Vec::T acc = Vec::zero();
      for (int64_t j = 0; j < D; j += W) acc = Vec::fma(Vec::load(kf + l * D + j), Vec::load(qg + j), acc);
      sg[l] = Vec::sum(acc);
    }
    for (l = 0; l < n; ++l) sg[l] *= ks ? scale * half_to_float(ks[l]) : scale;
  }
}

// p[0 .. n) <- softmax(p) * (vs[l], or 1): the weights of the values as the cache stores them
inline void softmax_weights(float* p, const c10::Half* vs, int64_t n) {
  int64_t l = 0;
  Vec::T mv = Vec::set1(p[0]);
  for (; l + W <= n; l += W) mv = Vec::max(mv, Vec::load(p + l));
  float lanes[W], mx = p[0];
  Vec::store(lanes, mv);
  for (int64_t i = 0; i < W; ++i) mx = std::max(mx, lanes[i]);
  for (; l < n; ++l) mx = std::max(mx, p[l]);
  const Vec::T mxv = Vec::set1(mx);
  Vec::T sv = Vec::zero();
  for (l = 0; l + W <= n; l += W) {
    const Vec::T e = fast_exp(Vec::sub(Vec::load(p + l), mxv));
    Vec::store(p + l, e);
    sv = Vec::add(sv, e);
  }
  float sum = Vec::sum(sv);
  for (; l < n; ++l) sum += p[l] = fast_exp(p[l] - mx);
  const float inv = 1.f / sum;
  const Vec::T iv = Vec::set1(inv);
  for (l = 0; l + W <= n; l += W)
    Vec::store(p + l,
               vs ? Vec::mul(Vec::load(p + l), Vec::mul(iv, Vec::halves(vs + l))) : Vec::mul(Vec::load(p + l), iv));
  for (; l < n; ++l) p[l] *= vs ? inv * half_to_float(vs[l]) : inv;
}

// out[r][j .. j + MV W) = sum over l < n[r] of p[r][l] * value l [j .. j + MV W) for G weight rows r (the query
// heads of one query, or of several queries of a span, which read a prefix of the same positions), the values the
// ring's two runs (v0: values 0 .. n0 - 1, v1: the rest); each value converted once, in registers, for all G rows
// (G * MV accumulators), every row's sum in position order, whatever the rows beside it
template <int G, int MV, typename T>
inline void weighted_values(const float* const* p, const int64_t* n, const T* v0, int64_t n0, const T* v1, int64_t D,
                            int64_t j, float* const* out) {
  Vec::T acc[G][MV];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < MV; ++u) acc[g][u] = Vec::zero();
  int64_t common = n[0], most = n[0];
  for (int g = 1; g < G; ++g) common = std::min(common, n[g]), most = std::max(most, n[g]);
  auto add = [&](int64_t l, auto every) {
    const T* v = l < n0 ? v0 + l * D : v1 + (l - n0) * D;
    Vec::T vv[MV];
    for (int u = 0; u < MV; ++u) vv[u] = cache_vec(v + j + u * W);
    for (int g = 0; g < G; ++g) {
      if (!decltype(every)::value && l >= n[g]) continue;
      const Vec::T pl = Vec::set1(p[g][l]);
      for (int u = 0; u < MV; ++u) acc[g][u] = Vec::fma(pl, vv[u], acc[g][u]);
    }
  };
  int64_t l = 0;
  for (; l < common; ++l) add(l, std::true_type{});
  for (; l < most; ++l) add(l, std::false_type{});  // the positions only the later queries of a span read
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < MV; ++u) Vec::store(out[g] + j + u * W, acc[g][u]);
}

// the outputs of R weight rows (weighted_values): rows six at a time, as many vectors of each value at a time as
// the registers hold (four with AVX-512's 32, two with AVX2's 16)
template <typename T>
inline void vector_values(const float* const* p, const int64_t* n, float* const* out, int64_t R, const T* v0,
                          int64_t n0, const T* v1, int64_t D) {
  constexpr int MV = W == 16 ? 4 : 2;
  for (int64_t r0 = 0; r0 < R; r0 += 6)
    with_count<6>(std::min<int64_t>(6, R - r0), [&](auto rows) {
      constexpr int G = decltype(rows)::value;
      int64_t j = 0;
      for (; j + MV * W <= D; j += MV * W) weighted_values<G, MV>(p + r0, n + r0, v0, n0, v1, D, j, out + r0);
      for (; j < D; j += W) weighted_values<G, 1>(p + r0, n + r0, v0, n0, v1, D, j, out + r0);
    });
}

#endif

// positions whose keys the vector path converts to float at a time (a 16-bit or int8 cache): 16 KB for D = 64, in L1
constexpr int64_t POSITION_BLOCK = 64;

// Where a query's positions first .. first + n - 1 lie in its cache row of R slots: a ring holds position p at slot
// p % R (a cache as long as the context never wraps, so there slot = position). At most two runs of slots:
// n0 positions from slot s0, then the rest from slot 0.
struct Runs {
  int64_t s0, n0, n;
  template <typename T>
  const T* at(const T* base, int64_t l, int64_t D) const {
    return base + (l < n0 ? s0 + l : l - n0) * D;
  }
  // positions l .. l + count - 1 in one run
  bool within(int64_t l, int64_t count) const { return l + count <= n0 || l >= n0; }
};

inline Runs runs_of(int64_t first, int64_t n, int64_t R) {
  const int64_t s0 = first % R;
  return {s0, std::min(n, R - s0), n};
}

// per-position float16 scales of a query's runs, in position order (a pointer into the cache when one run holds them)
inline const c10::Half* run_scales(const c10::Half* base, const Runs& r, std::vector<c10::Half>& tmp) {
  if (!base || r.n0 == r.n) return base ? base + r.s0 : nullptr;
  tmp.resize(r.n);
  std::copy(base + r.s0, base + r.s0 + r.n0, tmp.begin());
  std::copy(base, base + (r.n - r.n0), tmp.begin() + r.n0);
  return tmp.data();
}

#ifdef WOQ_SIMD
// The query heads qh[r] (D floats, r < R) rounded to int16 for int8_scores, one scale a head (its largest magnitude
// over 32,767, to nearest even): q16 [R][D / 2] the int16 pairs of dims (4s, 4s + 2) at 2s and (4s + 1, 4s + 3)
// at 2s + 1 (the keys' widened pairs), qs [R] each head's scale times the scores' scale
inline void int16_queries(const float* const* qh, int64_t R, int64_t D, float scale, std::vector<int32_t>& q16,
                          std::vector<float>& qs) {
  q16.resize(R * D / 2), qs.resize(R);
  auto pair = [](float a, float b, float inv) {
    const auto lo = static_cast<int32_t>(std::nearbyint(a * inv)), hi = static_cast<int32_t>(std::nearbyint(b * inv));
    return static_cast<int32_t>((static_cast<uint32_t>(hi) << 16) | (static_cast<uint32_t>(lo) & 0xffff));
  };
  for (int64_t r = 0; r < R; ++r) {
    const float* x = qh[r];
    const float amax = max_abs(x, D);
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    int32_t* row = q16.data() + r * D / 2;
    for (int64_t st = 0; st < D / 4; ++st) {
      row[2 * st] = pair(x[4 * st], x[4 * st + 2], inv);
      row[2 * st + 1] = pair(x[4 * st + 1], x[4 * st + 3], inv);
    }
    qs[r] = amax / 32767.f * scale;
  }
}
#endif

#ifdef WOQ_VNNI
// v[j] lane i <- v[i] lane j: the 16 x 16 matrix of 32-bit elements transposed (per 128-bit lane: pairs of
// elements, then of 64 bits; then the lanes across vectors)
inline void transpose16(__m512i* v) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2)
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // v[4 i + m] lane k: element 4 k + m of rows 4 i .. 4 i + 3
  for (int m = 0; m < 4; ++m) {
    const __m512i x0 = _mm512_shuffle_i32x4(v[m], v[4 + m], 0x44), x1 = _mm512_shuffle_i32x4(v[m], v[4 + m], 0xee);
    const __m512i y0 = _mm512_shuffle_i32x4(v[8 + m], v[12 + m], 0x44),
                  y1 = _mm512_shuffle_i32x4(v[8 + m], v[12 + m], 0xee);
    t[m] = _mm512_shuffle_i32x4(x0, y0, 0x88), t[4 + m] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    t[8 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88), t[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
  for (int j = 0; j < 16; ++j) v[j] = t[j];
}

// An int8 cache's scores with AVX512-VNNI (decode_attention_impl's vector path): each query head rounded to int16
// (one scale a head: its largest magnitude over 32,767), its products with 16 positions' keys at a time exact
// integers (vpdpwssd over the keys' bytes widened in pairs: 4 of each key a vector by transpose16), then times the
// query's scale, the scores' scale and each key's: out[r][l] for the R query heads r (qh[r], n[r] positions of
// the runs `all` from slot 0 of kp). A score depends only on its query head and its key: the same alone as in any
// span.
inline void int8_scores(const float* const* qh, const int64_t* n, float* const* out, int64_t R, const int8_t* kp,
                        const Runs& all, const c10::Half* ks, int64_t most, int64_t D, float scale) {
  thread_local std::vector<int32_t> q16, kt;  // (each thread's, kept between calls)
  thread_local std::vector<float> qs;
  int16_queries(qh, R, D, scale, q16, qs);
  kt.resize(D / 2 * 16);
  for (int64_t l0 = 0; l0 < most; l0 += 16) {
    const int64_t nb = std::min<int64_t>(16, most - l0);
    const int8_t* key[16];  // the 16 positions' keys (past the span's last: its last's)
    for (int64_t i = 0; i < 16; ++i) key[i] = all.at(kp, l0 + std::min(i, nb - 1), D);
    for (int64_t c = 0; c < D; c += 64) {  // 4 bytes of each of the 16 keys a vector, widened to two of int16 pairs
      __m512i w[16];
      for (int i = 0; i < 16; ++i) w[i] = _mm512_loadu_si512(key[i] + c);
      transpose16(w);
      for (int j = 0; j < 16; ++j) {
        const int64_t st = c / 4 + j;
        _mm512_storeu_si512(kt.data() + (2 * st) * 16, _mm512_srai_epi16(_mm512_slli_epi16(w[j], 8), 8));
        _mm512_storeu_si512(kt.data() + (2 * st + 1) * 16, _mm512_srai_epi16(w[j], 8));
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << nb) - 1);
    const __m512 kscale = ks ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, ks + l0)) : _mm512_set1_ps(1.f);
    for (int64_t r0 = 0; r0 < R; r0 += 4)
      with_count<4>(std::min<int64_t>(4, R - r0), [&](auto rows) {
        constexpr int G = decltype(rows)::value;
        __m512i acc[G];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_si512();
        for (int64_t p = 0; p < D / 2; ++p) {
          const __m512i k = _mm512_loadu_si512(kt.data() + p * 16);
          for (int g = 0; g < G; ++g)
            acc[g] = _mm512_dpwssd_epi32(acc[g], k, _mm512_set1_epi32(q16[(r0 + g) * D / 2 + p]));
        }
        for (int g = 0; g < G; ++g) {
          const int64_t r = r0 + g, count = std::min<int64_t>(16, n[r] - l0);
          if (count > 0)
            _mm512_mask_storeu_ps(
                out[r] + l0, static_cast<__mmask16>((1u << count) - 1),
                _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[g]), _mm512_set1_ps(qs[r])), kscale));
        }
      });
  }
}
#elif defined(WOQ_SIMD)
// v[j] lane i <- v[i] lane j: the 8 x 8 matrix of 32-bit elements transposed
inline void transpose8(__m256i* v) {
  __m256i t[8];
  for (int i = 0; i < 8; i += 2)
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    v[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]), v[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]), v[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // v[4 i + m] lane k: element 4 k + m of rows 4 i .. 4 i + 3
  for (int m = 0; m < 4; ++m) {
    t[m] = _mm256_permute2x128_si256(v[m], v[4 + m], 0x20);
    t[4 + m] = _mm256_permute2x128_si256(v[m], v[4 + m], 0x31);
  }
  for (int j = 0; j < 8; ++j) v[j] = t[j];
}

// int8_scores with AVX2: the same integers (vpmaddwd then vpaddd for vpdpwssd) and the same floats, 8 positions'
// keys at a time (transpose8)
inline void int8_scores(const float* const* qh, const int64_t* n, float* const* out, int64_t R, const int8_t* kp,
                        const Runs& all, const c10::Half* ks, int64_t most, int64_t D, float scale) {
  thread_local std::vector<int32_t> q16, kt;  // (each thread's, kept between calls)
  thread_local std::vector<float> qs;
  int16_queries(qh, R, D, scale, q16, qs);
  kt.resize(D / 2 * 8);
  for (int64_t l0 = 0; l0 < most; l0 += 8) {
    const int64_t nb = std::min<int64_t>(8, most - l0);
    const int8_t* key[8];  // the 8 positions' keys (past the span's last: its last's)
    for (int64_t i = 0; i < 8; ++i) key[i] = all.at(kp, l0 + std::min(i, nb - 1), D);
    for (int64_t c = 0; c < D; c += 32) {  // 4 bytes of each of the 8 keys a vector, widened to two of int16 pairs
      __m256i w[8];
      for (int i = 0; i < 8; ++i) w[i] = _mm256_loadu_si256((const __m256i*)(key[i] + c));
      transpose8(w);
      for (int j = 0; j < 8; ++j) {
        const int64_t st = c / 4 + j;
        _mm256_storeu_si256((__m256i*)(kt.data() + (2 * st) * 8), _mm256_srai_epi16(_mm256_slli_epi16(w[j], 8), 8));
        _mm256_storeu_si256((__m256i*)(kt.data() + (2 * st + 1) * 8), _mm256_srai_epi16(w[j], 8));
      }
    }
    alignas(32) c10::Half kh[8];
    for (int64_t i = 0; i < 8; ++i) kh[i] = ks ? ks[l0 + std::min(i, nb - 1)] : c10::Half(1.f);
    const __m256 kscale = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)kh));
    for (int64_t r0 = 0; r0 < R; r0 += 4)
      with_count<4>(std::min<int64_t>(4, R - r0), [&](auto rows) {
        constexpr int G = decltype(rows)::value;
        __m256i acc[G];
        for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_si256();
        for (int64_t p = 0; p < D / 2; ++p) {
          const __m256i k = _mm256_loadu_si256((const __m256i*)(kt.data() + p * 8));
          for (int g = 0; g < G; ++g)
            acc[g] = _mm256_add_epi32(acc[g], _mm256_madd_epi16(k, _mm256_set1_epi32(q16[(r0 + g) * D / 2 + p])));
        }
        for (int g = 0; g < G; ++g) {
          const int64_t r = r0 + g, count = std::min<int64_t>(8, n[r] - l0);
          if (count <= 0) continue;
          const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[g]), _mm256_set1_ps(qs[r])), kscale);
          const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
          _mm256_maskstore_ps(out[r] + l0, keep, v);
        }
      });
  }
}
#endif

// queries of one row that share their first position (a prefill chunk's, outside a sliding window) taken
// together: each block of their keys converted to float once for all of them
constexpr int64_t QUERY_GROUP = 8;

// One query token per entry b against cached positions starts[b] .. lengths[b] - 1 of its cache row rows[b]
// (rows null: row b; starts null: from 0, else a sliding window's first position); each kv head's keys and
// values are read once for all the query heads that share it (grouped-query attention). A row holds S slots
// (ring > 0: a sliding-window layer's ring of that many slots, position p at slot p % ring, and the scratch slot;
// else as long as the context, slot = position). An int8 cache (T = int8_t) carries one float16 scale per row, head
// and slot in ks and vs; other caches pass null. softcap > 0: scores become tanh(score / softcap) * softcap
// (Gemma 2). A query's result depends only on its own row, positions and values: never on the other entries (the
// same numbers for a token whether it is decoded alone, among 32 rows, or prefilled in any chunk), nor on where
// a ring's runs split its positions. Consecutive entries of one row from one first position (QUERY_GROUP at most)
// share each block of keys as floats (an int8 cache's: as int16 pairs, int8_scores): every query's scores are the
// calls a query alone makes, on the same numbers.
template <typename T>
void decode_attention_impl(const float* q, const T* k, const T* v, const c10::Half* ks, const c10::Half* vs,
                           const int64_t* lengths, const int64_t* rows, const int64_t* starts, float* out, int64_t B,
                           int64_t Hq, int64_t Hk, int64_t S, int64_t D, float scale, float softcap, int64_t ring) {
  const int64_t group = Hq / Hk, R = ring > 0 ? ring : S;
  // each entry's first attended position and count, and the spans of entries that share keys
  std::vector<int64_t> firsts(B), counts(B), spans;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t end = std::max<int64_t>(1, ring > 0 ? lengths[b] : std::min(lengths[b], S));
    int64_t first = starts ? std::min(std::max<int64_t>(0, starts[b]), end - 1) : 0;
    firsts[b] = std::max(first, end - R);  // a ring holds the last R positions
    counts[b] = end - firsts[b];
    const int64_t row = rows ? rows[b] : b;
    if (spans.empty() || b - spans.back() == QUERY_GROUP || firsts[b] != firsts[b - 1] ||
        row != (rows ? rows[b - 1] : b - 1))
      spans.push_back(b);
  }
  const int64_t nspans = static_cast<int64_t>(spans.size());
  spans.push_back(B);
  // the (span, kv head) tasks with the spans dealt round the threads (parallel_for hands each thread a
  // contiguous range, and a prefill chunk's later queries read more positions than its first)
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<int64_t> order;
  order.reserve(nspans * Hk);
  for (int64_t c = 0; c < threads; ++c)
    for (int64_t s = c; s < nspans; s += threads)
      for (int64_t kh = 0; kh < Hk; ++kh) order.push_back(s * Hk + kh);
  at::parallel_for(0, nspans * Hk, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, vf;
    std::vector<c10::Half> kst, vst;
    std::vector<const float*> weights;
    std::vector<int64_t> reads, offsets;
    std::vector<float*> outs;
    std::vector<float> kf(D), acc(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = order[i], b0 = spans[t / Hk], b1 = spans[t / Hk + 1], kh = t % Hk, row = rows ? rows[b0] : b0;
      const int64_t first = firsts[b0], most = *std::max_element(counts.begin() + b0, counts.begin() + b1);
      const T* kp = k + (row * Hk + kh) * S * D;  // slot 0 of the row's head
      const T* vp = v + (row * Hk + kh) * S * D;
      // the span's positions in slot order (its longest query's: each query reads a prefix of them)
      const Runs all = runs_of(first, most, R);
      const c10::Half* ksp = run_scales(ks ? ks + (row * Hk + kh) * S : nullptr, all, kst);
      const c10::Half* vsp = run_scales(vs ? vs + (row * Hk + kh) * S : nullptr, all, vst);
      // each query's scores [group, n] one after another, query b's from offsets[b - b0]
      offsets.assign(b1 - b0 + 1, 0);
      for (int64_t b = b0; b < b1; ++b) offsets[b - b0 + 1] = offsets[b - b0] + group * counts[b];
      scores.assign(offsets.back(), 0.f);
      auto cap = [&](float* sc, int64_t n) {
        if (softcap > 0.f)
          for (int64_t i = 0; i < group * n; ++i) sc[i] = std::tanh(sc[i] / softcap) * softcap;
      };
#ifdef WOQ_SIMD
      if constexpr (vector_cache<T>) {
        if (vector_rows(D)) {
          bool whole = false;  // the scores made by int8_scores
          if constexpr (std::is_same_v<T, int8_t>) {
            whole = D % 64 == 0;  // (heads of 64, 128, 256 bytes)
            if (whole) {
              weights.clear(), reads.clear(), outs.clear();
              for (int64_t b = b0; b < b1; ++b)
                for (int64_t g = 0; g < group; ++g) {
                  weights.push_back(q + (b * Hq + kh * group + g) * D), reads.push_back(counts[b]);
                  outs.push_back(scores.data() + offsets[b - b0] + g * counts[b]);
                }
              int8_scores(weights.data(), reads.data(), outs.data(), static_cast<int64_t>(weights.size()), kp, all, ksp,
                          most, D, scale);
            }
          }
          if (!whole) {  // float scores: each block of keys converted once for the span
            vf.resize(POSITION_BLOCK * D);
            for (int64_t l0 = 0; l0 < most; l0 += POSITION_BLOCK) {
              const int64_t nb = std::min(POSITION_BLOCK, most - l0);
              const float* kf = vf.data();
              const int64_t split = all.within(l0, nb) ? nb : all.n0 - l0;  // positions before the ring's wrap
              if constexpr (std::is_same_v<T, float>) {
                if (split == nb) kf = all.at(kp, l0, D);
                else {
                  std::copy(all.at(kp, l0, D), all.at(kp, l0, D) + split * D, vf.data());
                  std::copy(kp, kp + (nb - split) * D, vf.data() + split * D);
                }
              } else {
                rows_to_float(all.at(kp, l0, D), split, D, vf.data());
                if (split < nb) rows_to_float(kp, nb - split, D, vf.data() + split * D);
              }
              for (int64_t b = b0; b < b1; ++b) {
                const int64_t n = counts[b];
                if (n <= l0) continue;
                vector_scores(q + (b * Hq + kh * group) * D, kf, ksp ? ksp + l0 : nullptr,
                              std::min(POSITION_BLOCK, n - l0), n, D, group, scale,
                              scores.data() + offsets[b - b0] + l0);
              }
            }
          }
          // every query head's weights, then the values once for the span's heads together
          weights.clear(), reads.clear(), outs.clear();
          for (int64_t b = b0; b < b1; ++b) {
            const int64_t n = counts[b];
            float* sc = scores.data() + offsets[b - b0];
            cap(sc, n);
            for (int64_t g = 0; g < group; ++g) {
              softmax_weights(sc + g * n, vsp, n);
              weights.push_back(sc + g * n), reads.push_back(n), outs.push_back(out + (b * Hq + kh * group + g) * D);
            }
          }
          vector_values(weights.data(), reads.data(), outs.data(), static_cast<int64_t>(weights.size()),
                        all.at(vp, 0, D), all.n0, vp, D);
          continue;
        }
      }
#endif
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = counts[b];
        const Runs runs = runs_of(first, n, R);
        float* sc0 = scores.data() + offsets[b - b0];
        const float* qb = q + (b * Hq + kh * group) * D;  // the group's query heads, one after another
        float* ob = out + (b * Hq + kh * group) * D;
        for (int64_t l = 0; l < n; ++l) {
          const float ksc = ksp ? static_cast<float>(ksp[l]) * scale : scale;
          const T* kl = runs.at(kp, l, D);
          for (int64_t d = 0; d < D; ++d) kf[d] = to_float(kl[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qh = qb + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * kf[d];
            sc0[g * n + l] = dot * ksc;
          }
        }
        cap(sc0, n);
        for (int64_t g = 0; g < group; ++g) {
          float* sc = sc0 + g * n;
          float mx = sc[0];
          for (int64_t l = 1; l < n; ++l) mx = std::max(mx, sc[l]);
          float sum = 0.f;
          for (int64_t l = 0; l < n; ++l) {
            sc[l] = fast_exp(sc[l] - mx);
            sum += sc[l];
          }
          const float inv = 1.f / sum;
          for (int64_t l = 0; l < n; ++l) sc[l] *= inv;
        }
        for (int64_t g = 0; g < group; ++g) {
          std::fill(acc.begin(), acc.end(), 0.f);
          const float* sc = sc0 + g * n;
          for (int64_t l = 0; l < n; ++l) {
            const float p = vsp ? sc[l] * static_cast<float>(vsp[l]) : sc[l];
            const T* vl = runs.at(vp, l, D);
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) acc[d] += p * to_float(vl[d]);
          }
          std::copy(acc.begin(), acc.end(), ob + g * D);
        }
      }
    }
  });
}

}  // namespace

// Scales of an int8 cache: float16 [rows, Hk, S] for keys and for values; none for other caches.

const c10::Half* scales_of(const Scales& s, const at::Tensor& cache) {
  if (cache.scalar_type() != at::kChar) return nullptr;
  TORCH_CHECK(s.has_value() && s->scalar_type() == at::kHalf && s->is_contiguous(),
              "an int8 cache needs float16 scales");
  TORCH_CHECK(s->dim() == 3 && s->size(0) == cache.size(0) && s->size(1) == cache.size(1) &&
              s->size(2) == cache.size(2));
  return s->data_ptr<c10::Half>();
}

// Calls f with the element type of a float32, bfloat16, float16 or int8 cache.
template <typename F>
void dispatch_cache(const at::Tensor& cache, F f) {
  switch (cache.scalar_type()) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    case at::kChar:
      f(int8_t{});
      break;
    default:
      TORCH_CHECK(false, "KV cache type must be float32, bfloat16, float16 or int8");
  }
}

// q [B, Hq, D] float; k, v [rows, Hk, S, D] float, bfloat16, float16 or int8 (with ks, vs); lengths [B];
// rows [B] each query's cache row (none: rows 0 .. B-1); starts [B] its first attended position (none: 0);
// softcap: Gemma 2's soft-capping of the scores (0: none); ring: the cache's first ring slots are a ring
// (decode_attention_impl; 0: none) -> [B, Hq, D]
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Scales& ks,
                            const Scales& vs, const at::Tensor& lengths, double scale,
                            const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& starts,
                            double softcap, int64_t ring) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.is_contiguous() && v.is_contiguous() && k.dim() == 4);
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && lengths.scalar_type() == at::kLong);
  auto qc = q.contiguous();
  auto lc = lengths.contiguous();
  const int64_t B = qc.size(0), Hq = qc.size(1), D = qc.size(2), Hk = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(3) == D && Hq % Hk == 0 && lc.size(0) == B);
  at::Tensor rc, sc;
  if (rows.has_value()) {
    rc = rows->contiguous();
    TORCH_CHECK(rc.scalar_type() == at::kLong && rc.numel() == B, "rows: one long per query");
    TORCH_CHECK(B == 0 || (rc.min().item<int64_t>() >= 0 && rc.max().item<int64_t>() < k.size(0)), "rows out of range");
  } else {
    TORCH_CHECK(k.size(0) >= B);
  }
  if (starts.has_value()) {
    sc = starts->contiguous();
    TORCH_CHECK(sc.scalar_type() == at::kLong && sc.numel() == B, "starts: one long per query");
  }
  TORCH_CHECK(ring >= 0 && ring <= S, "a ring of ", ring, " slots in a cache of ", S);
  auto out = at::empty({B, Hq, D}, qc.options());
  const c10::Half *ksp = scales_of(ks, k), *vsp = scales_of(vs, v);
  dispatch_cache(k, [&](auto zero) {
    using T = decltype(zero);
    decode_attention_impl<T>(qc.data_ptr<float>(), static_cast<const T*>(k.data_ptr()),
                             static_cast<const T*>(v.data_ptr()), ksp, vsp, lc.data_ptr<int64_t>(),
                             rows.has_value() ? rc.data_ptr<int64_t>() : nullptr,
                             starts.has_value() ? sc.data_ptr<int64_t>() : nullptr, out.data_ptr<float>(), B, Hq, Hk, S,
                             D, static_cast<float>(scale), static_cast<float>(softcap), ring);
  });
  return out;
}

namespace {

// queries of one encoder input whose scores are held at a time (64 x 2,048 keys: 512 KB)
constexpr int64_t ENCODER_QUERIES = 64;

// One head of one encoder input (encoder_attention): n queries q, keys k and values v (rows ldq, ldk, ldv apart,
// D floats each), every query over every key -> out (rows ldo apart). The keys transposed into kt [D, n rounded up
// to W], so a query's scores are W keys a vector; the values copied into vh [n, D] for vector_values.
void encoder_head(const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv, int64_t n,
                  int64_t D, float scale, float* out, int64_t ldo, std::vector<float>& kt, std::vector<float>& vh,
                  std::vector<float>& scores) {
#ifdef WOQ_SIMD
  if (vector_rows(D)) {
    const int64_t np = (n + W - 1) / W * W;
    kt.assign(D * np, 0.f);
    vh.resize(n * D);
    scores.resize(std::min(n, ENCODER_QUERIES) * np);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < D; ++d) kt[d * np + j] = k[j * ldk + d];
      std::copy(v + j * ldv, v + j * ldv + D, vh.data() + j * D);
    }
    const Vec::T sv = Vec::set1(scale);
    std::vector<const float*> weights;
    std::vector<int64_t> reads;
    std::vector<float*> outs;
    for (int64_t i0 = 0; i0 < n; i0 += ENCODER_QUERIES) {  // (scores of a block of queries at a time: bounded memory)
      const int64_t i1 = std::min(n, i0 + ENCODER_QUERIES);
      int64_t i = i0;
      auto rows = [&](auto count) {  // count queries' scores at a time, each key vector loaded once for them
        constexpr int G = decltype(count)::value;
        for (int64_t jb = 0; jb < np; jb += W) {
          Vec::T acc[G];
          for (int g = 0; g < G; ++g) acc[g] = Vec::zero();
          for (int64_t d = 0; d < D; ++d) {
            const Vec::T kv = Vec::load(kt.data() + d * np + jb);
            for (int g = 0; g < G; ++g) acc[g] = Vec::fma(Vec::set1(q[(i + g) * ldq + d]), kv, acc[g]);
          }
          for (int g = 0; g < G; ++g) Vec::store(scores.data() + (i - i0 + g) * np + jb, Vec::mul(acc[g], sv));
        }
      };
      for (; i + 4 <= i1; i += 4) rows(Int<4>{});
      for (; i < i1; ++i) rows(Int<1>{});
      weights.clear(), reads.assign(i1 - i0, n), outs.clear();
      for (int64_t r = i0; r < i1; ++r) {
        float* p = scores.data() + (r - i0) * np;
        softmax_weights(p, nullptr, n);
        weights.push_back(p), outs.push_back(out + r * ldo);
      }
      vector_values(weights.data(), reads.data(), outs.data(), i1 - i0, vh.data(), n, vh.data(), D);
    }
    return;
  }
#endif
  scores.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += q[i * ldq + d] * k[j * ldk + d];
      scores[j] = dot * scale, mx = std::max(mx, scores[j]);
    }
    for (int64_t j = 0; j < n; ++j) sum += scores[j] = fast_exp(scores[j] - mx);
    float* o = out + i * ldo;
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) o[d] += scores[j] / sum * v[j * ldv + d];
  }
}

}  // namespace

// Bidirectional attention over an encoder's inputs packed one after another (model/encoder.py): q, k and v
// [N, heads * D] (rows of any stride: views of one qkv output), input b's tokens the rows offsets[b] ..
// offsets[b + 1] - 1. Each token attends to every token of its own input and to nothing else (no padding, no
// mask), so an input's numbers never depend on what shares its batch -> [N, heads * D]
at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& offsets,
                             int64_t heads, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat);
  TORCH_CHECK(q.dim() == 2 && q.sizes() == k.sizes() && q.sizes() == v.sizes(), "q, k and v: [tokens, heads * D]");
  TORCH_CHECK(q.stride(1) == 1 && k.stride(1) == 1 && v.stride(1) == 1, "rows of contiguous heads");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() >= 1);
  const int64_t N = q.size(0), HD = q.size(1), H = heads, B = offsets.numel() - 1;
  TORCH_CHECK(H > 0 && HD % H == 0, "heads must divide the row");
  auto oc = offsets.contiguous();
  const int64_t* off = oc.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[B] == N, "offsets run from 0 to the tokens");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(off[b] <= off[b + 1], "offsets never decrease");
  const int64_t D = HD / H, ldq = q.stride(0), ldk = k.stride(0), ldv = v.stride(0);
  auto out = at::empty({N, HD}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> kt, vh, scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, o = off[b], n = off[b + 1] - o;
      if (n > 0)
        encoder_head(qp + o * ldq + h * D, ldq, kp + o * ldk + h * D, ldk, vp + o * ldv + h * D, ldv, n, D,
                     static_cast<float>(scale), op + o * HD + h * D, HD, kt, vh, scores);
    }
  });
  return out;
}

namespace {
// RMSNorm of row r (H values) into out: r / sqrt(mean(r^2) + eps) * w
inline void norm_row(const float* r, const float* w, int64_t H, float eps, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < H; ++j) ss += r[j] * r[j];
  const float inv = 1.f / std::sqrt(ss / H + eps);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) out[j] = w[j] * (r[j] * inv);
}
}  // namespace

// RMSNorm of each row of x [M, H] (float32): x / sqrt(mean(x^2) + eps) * w
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat);
  auto x2 = flat(x);
  const int64_t M = x2.size(0), H = x2.size(1);
  auto y = at::empty_like(x2);
  const float *xp = x2.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, PARALLEL_GRAIN / H), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) norm_row(xp + i * H, wp, H, static_cast<float>(eps), yp + i * H);
  });
  return y.view(x.sizes());
}

// The residual add and the next norm in one pass over the rows: h [M, H] += y, then rms_norm(h, w)
at::Tensor add_rms_norm(at::Tensor& h, const at::Tensor& y, const at::Tensor& w, double eps) {
  TORCH_CHECK(h.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat);
  TORCH_CHECK(h.is_contiguous() && h.dim() == 2 && y.sizes() == h.sizes());
  const int64_t M = h.size(0), H = h.size(1);
  auto yc = y.contiguous();
  auto out = at::empty_like(h);
  float *hp = h.data_ptr<float>(), *op = out.data_ptr<float>();
  const float *yp = yc.data_ptr<float>(), *wp = w.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, PARALLEL_GRAIN / H), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* r = hp + i * H;
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) r[j] += yp[i * H + j];
      norm_row(r, wp, H, static_cast<float>(eps), op + i * H);
    }
  });
  return out;
}

// silu(gate) * up of x [..., 2F] = [gate | up] -> [..., F] in one pass: gate * sigmoid(gate) * up, the
// sigmoid from one exponential of -|gate|
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) % 2 == 0);
  auto x2 = flat(x);
  const int64_t M = x2.size(0), F = x2.size(1) / 2;
  auto y = at::empty({M, F}, x2.options());
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, PARALLEL_GRAIN / F), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float *g = xp + i * 2 * F, *u = g + F;
      float* o = yp + i * F;
      int64_t j = 0;
#ifdef WOQ_SIMD
      for (; j + W <= F; j += W) {
        const Vec::T gv = Vec::load(g + j), one = Vec::set1(1.f);
        const Vec::T e = fast_exp(Vec::sub(Vec::zero(), Vec::abs(gv))), r = Vec::div(one, Vec::add(one, e));
        Vec::store(o + j, Vec::mul(Vec::mul(gv, Vec::select_nonnegative(gv, r, Vec::mul(e, r))), Vec::load(u + j)));
      }
#endif
      for (; j < F; ++j) o[j] = silu_mul_one(g[j], u[j]);
    }
  });
  return y.view(out_shape(x, F));
}

// GELU over the rows of x (float32) in its tanh form, as llama.cpp's ggml_gelu: x * sigmoid(2 u) for u = sqrt(2 /
// pi) (x + 0.044715 x^3), which is 0.5 x (1 + tanh(u)); the sigmoid from one exponential of -|2 u| (silu_mul's).
// Row by row, so where a row's elements take the vector or the scalar steps never follows the rows beside it.
at::Tensor gelu(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat);
  auto x2 = flat(x);
  const int64_t M = x2.size(0), F = x2.size(1);
  auto y = at::empty_like(x2);
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr float a = 2.f * 0.7978845608f, b = 0.044715f;
  at::parallel_for(0, M, std::max<int64_t>(1, PARALLEL_GRAIN / F), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* r = xp + i * F;
      float* o = yp + i * F;
      int64_t j = 0;
#ifdef WOQ_SIMD
      const Vec::T one = Vec::set1(1.f), av = Vec::set1(a), bv = Vec::set1(b);
      for (; j + W <= F; j += W) {
        const Vec::T v = Vec::load(r + j), t = Vec::mul(Vec::mul(av, v), Vec::fma(Vec::mul(bv, v), v, one));
        const Vec::T e = fast_exp(Vec::sub(Vec::zero(), Vec::abs(t))), s = Vec::div(one, Vec::add(one, e));
        Vec::store(o + j, Vec::mul(v, Vec::select_nonnegative(t, s, Vec::mul(e, s))));
      }
#endif
      for (; j < F; ++j) {
        const float v = r[j], t = a * v * (1.f + b * v * v), e = fast_exp(-std::fabs(t)), s = 1.f / (1.f + e);
        o[j] = v * (t >= 0.f ? s : e * s);
      }
    }
  });
  return y.view(x.sizes());
}

namespace {

inline void rope_row(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < h; ++j) {
    out[j] = x[j] * c[j] - x[j + h] * s[j];
    out[j + h] = x[j + h] * c[j + h] + x[j] * s[j + h];
  }
}

// One head vector into a cache position: cast, or for an int8 cache rounded to 127 steps of its own
// float16 scale (max |x| / 127), the scale stored beside it (each value's product and rounding to nearest even
// as std::nearbyint's, in vectors).
template <typename T>
inline void store_head(const float* x, int64_t D, T* dst, c10::Half* scale) {
  if constexpr (std::is_same_v<T, int8_t>) {
    const c10::Half s = static_cast<c10::Half>(max_abs(x, D) / 127.f);
    const float sf = static_cast<float>(s);
    const float inv = sf > 0.f ? 1.f / sf : 0.f;
    int64_t d = 0;
#ifdef WOQ_SIMD
    const Vec::T iv = Vec::set1(inv);
    for (; d + W <= D; d += W) Vec::store_int8(Vec::mul(Vec::load(x + d), iv), dst + d);
#endif
    for (; d < D; ++d) dst[d] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[d] * inv))));
    *scale = s;
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(x[d]);
  }
}

// Each token's rotary on its query and key heads and its key and value written into the cache. The fused decode
// step's tokens (rows null: token b is row b, each writing its own row) are split between the threads; otherwise
// the heads are (never the positions: a prefill's padding tokens all write their row's scratch position).
template <typename T>
void rope_store_impl(const float* qkv, const float* cos, const float* sin, T* kc, T* vc, c10::Half* ks, c10::Half* vs,
                     const int64_t* pos, const int64_t* rows, float* q, int64_t B, int64_t Hq, int64_t Hk, int64_t S,
                     int64_t D) {
  const int64_t width = (Hq + 2 * Hk) * D;
  auto run = [&](int64_t b0, int64_t b1, int64_t h0, int64_t h1) {
    std::vector<float> tmp(D);
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = qkv + b * width;
      const float *c = cos + b * D, *s = sin + b * D;
      for (int64_t h = h0; h < h1; ++h) {
        if (h < Hq) {
          rope_row(row + h * D, c, s, D, q + (b * Hq + h) * D);
          continue;
        }
        const int64_t kh = h - Hq, at = ((rows ? rows[b] : b) * Hk + kh) * S + pos[b];
        rope_row(row + h * D, c, s, D, tmp.data());
        store_head(tmp.data(), D, kc + at * D, ks ? ks + at : nullptr);
        store_head(row + (Hq + Hk + kh) * D, D, vc + at * D, vs ? vs + at : nullptr);
      }
    }
  };
  if (rows == nullptr)
    at::parallel_for(0, B, std::max<int64_t>(1, PARALLEL_GRAIN / width),
                     [&](int64_t b0, int64_t b1) { run(b0, b1, 0, Hq + Hk); });
  else
    at::parallel_for(0, Hq + Hk, B * width < PARALLEL_GRAIN ? Hq + Hk : 1,
                     [&](int64_t h0, int64_t h1) { run(0, B, h0, h1); });
}

}  // namespace

// Rotary embedding on the query and key heads of qkv [B, (Hq + 2 Hk) * D] (B tokens: a decode step's rows,
// or a prefill's tokens flattened), each token's key and value written into the caches [rows, Hk, S, D]
// at position pos[b] of cache row rows[b] (none: row b), an int8 cache's float16 scales into ks, vs
// [rows, Hk, S]; returns q [B, Hq, D].
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc,
                      at::Tensor& vc, const Scales& ks, const Scales& vs, const at::Tensor& pos, int64_t Hq,
                      const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && kc.is_contiguous());
  TORCH_CHECK(pos.scalar_type() == at::kLong && kc.scalar_type() == vc.scalar_type() && vc.is_contiguous());
  auto x = flat(qkv);
  auto cc = flat(cos), sc = flat(sin), pc = pos.reshape({-1}).contiguous();
  const int64_t B = x.size(0), Hk = kc.size(1), S = kc.size(2), D = kc.size(3);
  TORCH_CHECK(x.size(1) == (Hq + 2 * Hk) * D && pc.size(0) == B && cc.size(0) == B && cc.size(1) == D);
  at::Tensor rc;
  if (rows.has_value()) {
    rc = rows->reshape({-1}).contiguous();
    TORCH_CHECK(rc.scalar_type() == at::kLong && rc.size(0) == B);
    const int64_t* r = rc.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(r[b] >= 0 && r[b] < kc.size(0), "cache row out of range");
  } else {
    TORCH_CHECK(kc.size(0) >= B);
  }
  const int64_t* p = pc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(p[b] >= 0 && p[b] < S, "cache position out of range");
  auto q = at::empty({B, Hq, D}, x.options());
  auto* ksp = const_cast<c10::Half*>(scales_of(ks, kc));
  auto* vsp = const_cast<c10::Half*>(scales_of(vs, vc));
  dispatch_cache(kc, [&](auto zero) {
    using T = decltype(zero);
    rope_store_impl<T>(x.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), static_cast<T*>(kc.data_ptr()),
                       static_cast<T*>(vc.data_ptr()), ksp, vsp, p, rows.has_value() ? rc.data_ptr<int64_t>() : nullptr,
                       q.data_ptr<float>(), B, Hq, Hk, S, D);
  });
  return q;
}

namespace {

// out[0..4) = dot(x, w_k) over n values for the float16 rows w_0..w_3 (ld apart): x loaded once for the four
inline void dot4_halves(const float* x, const c10::Half* w, int64_t ld, int64_t n, float* out) {
  int64_t j = 0;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef WOQ_SIMD
  Vec::T a0 = Vec::zero(), a1 = Vec::zero(), a2 = Vec::zero(), a3 = Vec::zero();
  for (; j + W <= n; j += W) {
    const Vec::T xv = Vec::load(x + j);
    a0 = Vec::fma(xv, Vec::halves(w + j), a0);
    a1 = Vec::fma(xv, Vec::halves(w + ld + j), a1);
    a2 = Vec::fma(xv, Vec::halves(w + 2 * ld + j), a2);
    a3 = Vec::fma(xv, Vec::halves(w + 3 * ld + j), a3);
  }
  Vec::sum4(a0, a1, a2, a3, s);
#endif
  for (; j < n; ++j)
    for (int k = 0; k < 4; ++k) s[k] += x[j] * static_cast<float>(w[k * ld + j]);
  for (int k = 0; k < 4; ++k) out[k] = s[k];
}

}  // namespace

void lora_add(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& tokens,
              const at::Tensor& slots, const at::Tensor& scales, at::Tensor y) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add: x [T, K] and y [T, N]");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(1) &&
                  a.size(2) == x.size(1) && b.size(2) == y.size(1),
              "lora_add: a [S, R, K] and b [S, R, N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && scales.scalar_type() == at::kFloat &&
                  x.is_contiguous() && scales.is_contiguous() && y.stride(1) == 1,
              "lora_add: float32 x, y and scales (y's rows may be a slice of wider ones)");
  TORCH_CHECK(a.scalar_type() == at::kHalf && b.scalar_type() == at::kHalf && a.is_contiguous() && b.is_contiguous(),
              "lora_add: contiguous float16 a and b");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && tokens.is_contiguous() &&
                  slots.is_contiguous() && tokens.numel() == slots.numel() && scales.numel() == tokens.numel(),
              "lora_add: one token, slot and scale per pair");
  const int64_t K = x.size(1), N = y.size(1), S = a.size(0), Rk = a.size(1), P = tokens.numel(), T = x.size(0);
  const int64_t ldy = y.stride(0);
  const float* xp = x.data_ptr<float>();
  const c10::Half *ap = a.data_ptr<c10::Half>(), *bp = b.data_ptr<c10::Half>();
  const float* sp = scales.data_ptr<float>();
  const int64_t *tp = tokens.data_ptr<int64_t>(), *slp = slots.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(tp[p] >= 0 && tp[p] < T && slp[p] >= 0 && slp[p] < S, "lora_add: a pair out of range");
  // runs of pairs of one adapter (pairs come sorted by slot)
  std::vector<int64_t> runs;
  for (int64_t p = 0; p < P; ++p)
    if (p == 0 || slp[p] != slp[p - 1]) runs.push_back(p);
  runs.push_back(P);
  const int64_t nruns = static_cast<int64_t>(runs.size()) - 1;
  // h[p, r] = scale_p * (x[t_p] . a[s_p, r]): for each run and four rows of its a, every pair's dot products with
  // the four (x loaded once for the four)
  std::vector<float> h(P * Rk);
  const int64_t quads = (Rk + 3) / 4;
  at::parallel_for(0, nruns * quads, 1, [&](int64_t i0, int64_t i1) {
    float out[4];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t run = i / quads, r = (i % quads) * 4, n = std::min<int64_t>(4, Rk - r);
      const c10::Half* as = ap + (slp[runs[run]] * Rk + r) * K;
      for (int64_t p = runs[run]; p < runs[run + 1]; ++p) {
        const float* xt = xp + tp[p] * K;
        if (n == 4) {
          dot4_halves(xt, as, K, K, out);
        } else {
          for (int64_t k = 0; k < n; ++k) {
            out[k] = 0.f;
            for (int64_t j = 0; j < K; ++j) out[k] += xt[j] * static_cast<float>(as[k * K + j]);
          }
        }
        for (int64_t k = 0; k < n; ++k) h[p * Rk + r + k] = sp[p] * out[k];
      }
    }
  });
  // y[t_p, cols] += h[p] . b[s_p, :, cols]: each thread a range of output columns (so no two write one value); within
  // it each run by four tokens at a time, each b vector loaded once for the four
#ifdef WOQ_SIMD
  constexpr int64_t CW = W;  // columns a block
#else
  constexpr int64_t CW = 8;
#endif
  const int64_t blocks = (N + CW - 1) / CW;
  at::parallel_for(0, blocks, std::max<int64_t>(1, blocks / 8), [&](int64_t c0, int64_t c1) {
    for (int64_t run = 0; run < nruns; ++run) {
      const c10::Half* bs = bp + slp[runs[run]] * Rk * N;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t j = c * CW;
        for (int64_t p = runs[run]; p < runs[run + 1]; p += 4) {
          const int64_t m = std::min<int64_t>(4, runs[run + 1] - p);
          const float* hp = h.data() + p * Rk;
#ifdef WOQ_SIMD
          if (j + W <= N && m == 4) {  // (four named accumulators: kept in registers)
            float *y0 = yp + tp[p] * ldy + j, *y1 = yp + tp[p + 1] * ldy + j, *y2 = yp + tp[p + 2] * ldy + j,
                  *y3 = yp + tp[p + 3] * ldy + j;
            Vec::T a0 = Vec::load(y0), a1 = Vec::load(y1), a2 = Vec::load(y2), a3 = Vec::load(y3);
            for (int64_t r = 0; r < Rk; ++r) {
              const Vec::T bv = Vec::halves(bs + r * N + j);
              a0 = Vec::fma(Vec::set1(hp[r]), bv, a0);
              a1 = Vec::fma(Vec::set1(hp[Rk + r]), bv, a1);
              a2 = Vec::fma(Vec::set1(hp[2 * Rk + r]), bv, a2);
              a3 = Vec::fma(Vec::set1(hp[3 * Rk + r]), bv, a3);
            }
            Vec::store(y0, a0), Vec::store(y1, a1), Vec::store(y2, a2), Vec::store(y3, a3);
            continue;
          }
          if (j + W <= N) {
            Vec::T acc[4];
            for (int64_t i = 0; i < m; ++i) acc[i] = Vec::load(yp + tp[p + i] * ldy + j);
            for (int64_t r = 0; r < Rk; ++r) {
              const Vec::T bv = Vec::halves(bs + r * N + j);
              for (int64_t i = 0; i < m; ++i) acc[i] = Vec::fma(Vec::set1(hp[i * Rk + r]), bv, acc[i]);
            }
            for (int64_t i = 0; i < m; ++i) Vec::store(yp + tp[p + i] * ldy + j, acc[i]);
            continue;
          }
#endif
          for (int64_t i = 0; i < m; ++i)
            for (int64_t jj = j; jj < std::min(N, j + CW); ++jj) {
              float acc = yp[tp[p + i] * ldy + jj];
              for (int64_t r = 0; r < Rk; ++r) acc += hp[i * Rk + r] * static_cast<float>(bs[r * N + jj]);
              yp[tp[p + i] * ldy + jj] = acc;
            }
        }
      }
    }
  });
}

}  // namespace woq
