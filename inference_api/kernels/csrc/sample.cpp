// The sampler's draw (engine/sampling.py, on the CPU): each row's token from its logits, temperature, top-k,
// top-p, min-p and one uniform number, every row in one call and each row on its own (its token depends on its
// own numbers alone). The same rules as sampling.py's torch path, without its sorts and float64 copies of the
// vocabulary: 1.6 ms a row for a draw over 151,936 logits there, 42 ms for 32 rows.
//
// A row: e[i] = exp(logits[i] / temperature - the largest), summed (Z, in double). No truncation: the first token
// whose running sum in token order reaches u * Z, found by blocks of BLOCK tokens. top-k, top-p or min-p: the
// tokens sorted by e, largest first, as far as the truncation can reach: all tokens with e at or above a threshold
// lowered 16-fold a pass until they hold top_k tokens, or top_p of Z, or the threshold reaches min_p (e of the
// most likely is 1); top-k keeps the first top_k, top-p then the first whose mass before them is below top_p of
// what top-k kept, min-p those with e at least min_p times the first's; the draw the first of them whose running
// sum reaches u times theirs.
#include "common.h"
#include "kernels.h"

namespace woq {

namespace {

constexpr int64_t BLOCK = 256;     // tokens a block sum covers (the draw over the whole vocabulary)
constexpr double MARGIN = 1e-4;    // the mass a threshold's tokens must pass top_p by (float sums' rounding)
constexpr float TINIEST = 1e-38f;  // below any e but 0 (fast_exp's least is exp(-87))

float row_max(const float* x, int64_t V) {
  int64_t i = 0;
  float mx = x[0];
#ifdef WOQ_SIMD
  if (V >= W) {
    Vec::T m = Vec::load(x);
    for (i = W; i + W <= V; i += W) m = Vec::max(m, Vec::load(x + i));
    float lanes[W];
    Vec::store(lanes, m);
    for (int l = 0; l < W; ++l) mx = std::max(mx, lanes[l]);
  }
#endif
  for (; i < V; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// the first index of the largest logit (torch's argmax)
int64_t first_of(const float* x, int64_t V, float mx) {
  for (int64_t i = 0; i < V; ++i)
    if (x[i] == mx) return i;
  return 0;
}

// e[i] = exp(x[i] / t - top) (0 where that is below exp's range: masked tokens), block sums into sums; returns Z
double exponentials(const float* x, int64_t V, float t, float top, float* e, double* sums) {
  double z = 0.0;
  for (int64_t b0 = 0; b0 < V; b0 += BLOCK) {
    const int64_t b1 = std::min(V, b0 + BLOCK);
    int64_t i = b0;
    float s = 0.f;
#ifdef WOQ_SIMD
    const Vec::T tv = Vec::set1(t), topv = Vec::set1(top), range = Vec::set1(-ExpConstants::lowest);
    Vec::T sv = Vec::zero();
    for (; i + W <= b1; i += W) {
      const Vec::T d = Vec::sub(Vec::div(Vec::load(x + i), tv), topv);
      const Vec::T v = Vec::select_nonnegative(Vec::add(d, range), fast_exp(d), Vec::zero());
      Vec::store(e + i, v);
      sv = Vec::add(sv, v);
    }
    s = Vec::sum(sv);
#endif
    for (; i < b1; ++i) {
      const float d = x[i] / t - top;
      s += e[i] = d >= ExpConstants::lowest ? fast_exp(d) : 0.f;
    }
    sums[b0 / BLOCK] = s;
    z += s;
  }
  return z;
}

// how many e are at or above th, and their sum
std::pair<int64_t, double> at_or_above(const float* e, int64_t V, float th) {
  int64_t count = 0;
  double mass = 0.0;
  for (int64_t b0 = 0; b0 < V; b0 += BLOCK) {
    const int64_t b1 = std::min(V, b0 + BLOCK);
    int64_t i = b0;
    float s = 0.f;
#ifdef WOQ_SIMD
    const Vec::T thv = Vec::set1(th), one = Vec::set1(1.f);
    Vec::T sv = Vec::zero(), cv = Vec::zero();
    for (; i + W <= b1; i += W) {
      const Vec::T v = Vec::load(e + i), above = Vec::sub(v, thv);
      sv = Vec::add(sv, Vec::select_nonnegative(above, v, Vec::zero()));
      cv = Vec::add(cv, Vec::select_nonnegative(above, one, Vec::zero()));
    }
    s = Vec::sum(sv);
    count += static_cast<int64_t>(Vec::sum(cv));
#endif
    for (; i < b1; ++i)
      if (e[i] >= th) s += e[i], ++count;
    mass += s;
  }
  return {count, mass};
}

// the draw over the whole vocabulary: the first token whose running sum reaches target (the last with e > 0 where
// rounding leaves the target past them all)
int64_t whole(const float* e, const double* sums, int64_t V, double target) {
  double run = 0.0;
  int64_t b0 = 0;
  for (; b0 + BLOCK < V; b0 += BLOCK) {  // the block the target falls in (the last at the latest)
    if (run + sums[b0 / BLOCK] >= target) break;
    run += sums[b0 / BLOCK];
  }
  for (int64_t i = b0; i < V; ++i) {
    if (e[i] <= 0.f) continue;
    run += e[i];
    if (run >= target) return i;
  }
  for (int64_t i = V - 1; i >= 0; --i)
    if (e[i] > 0.f) return i;
  return 0;
}

struct Buffers {
  std::vector<float> e;
  std::vector<double> sums;
  std::vector<std::pair<float, int64_t>> cand;
};

int64_t sample_row(const float* x, int64_t V, float t, int64_t top_k, float top_p, float min_p, double u,
                   Buffers& buf) {
  const float mx = row_max(x, V);
  if (t <= 0.f || !(mx > -INFINITY)) return first_of(x, V, mx);
  buf.e.resize(V);
  buf.sums.resize((V + BLOCK - 1) / BLOCK);
  float* e = buf.e.data();
  const double z = exponentials(x, V, t, mx / t, e, buf.sums.data());
  const bool top_k_on = top_k < V, min_p_on = min_p > 0.f;
  if (!top_k_on && top_p >= 1.f && !min_p_on) return whole(e, buf.sums.data(), V, u * z);
  // the threshold: lowered until its tokens hold every token the truncation keeps
  float threshold = 1.f;
  // the lowest it need go: min_p (whose tokens are all kept then; unless top-p needs the whole top-k's mass), else
  // every token
  const float lowest = min_p_on && !(top_k_on && top_p < 1.f) ? std::max(min_p, TINIEST) : TINIEST;
  for (float th = std::max(1.f / 16, lowest);; th = std::max(th / 16, lowest)) {
    const auto [count, mass] = at_or_above(e, V, th);
    if (th == lowest || (top_k_on ? count >= top_k : top_p < 1.f && mass >= top_p * z * (1.0 + MARGIN))) {
      threshold = th;
      break;
    }
  }
  auto& cand = buf.cand;
  cand.clear();
  for (int64_t i = 0; i < V; ++i)
    if (e[i] >= threshold) cand.emplace_back(e[i], i);
  if (cand.empty()) return first_of(x, V, mx);  // (a min_p past 1 keeps nothing: the API refuses one)
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  const int64_t n = static_cast<int64_t>(cand.size()), k = top_k_on ? std::min(top_k, n) : n;
  double total = z;
  if (top_k_on) {
    total = 0.0;
    for (int64_t r = 0; r < k; ++r) total += cand[r].first;
  }
  // the kept ranks: 0 .. kept (the first always)
  const double nucleus = static_cast<double>(top_p) * total;
  const float least = min_p * cand[0].first;
  double before = cand[0].first;
  int64_t kept = 1;
  for (; kept < k; ++kept) {
    if ((top_p < 1.f && before >= nucleus) || (min_p_on && cand[kept].first < least)) break;
    before += cand[kept].first;
  }
  const double target = u * before;
  double run = 0.0;
  for (int64_t r = 0; r < kept; ++r) {
    run += cand[r].first;
    if (run >= target) return cand[r].second;
  }
  return cand[kept - 1].second;
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits: float32 [rows, vocabulary]");
  const auto lg = logits.contiguous();
  const int64_t B = lg.size(0), V = lg.size(1);
  TORCH_CHECK(V > 0, "an empty vocabulary");
  const auto t = temperature.to(at::kFloat).contiguous(), p = top_p.to(at::kFloat).contiguous(),
             m = min_p.to(at::kFloat).contiguous(), u = uniforms.to(at::kDouble).contiguous();
  const auto k = top_k.to(at::kLong).contiguous();
  for (const auto* each : {&t, &p, &m, &u, &k}) TORCH_CHECK(each->numel() == B, "one parameter a row");
  auto out = at::empty({B}, at::kLong);
  const float *xp = lg.data_ptr<float>(), *tp = t.data_ptr<float>(), *pp = p.data_ptr<float>(),
              *mp = m.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    thread_local Buffers buf;  // reused by the pool's threads
    for (int64_t b = b0; b < b1; ++b) op[b] = sample_row(xp + b * V, V, tp[b], kp[b], pp[b], mp[b], up[b], buf);
  });
  return out;
}

}  // namespace woq
