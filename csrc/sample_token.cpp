// One token drawn from each row of softmax(logits / temperature), some columns banned, restricted
// to the top k or to the top-p nucleus (the row step of sampling; fastnmt/ops/sample_token.py has
// the math and the reference).
//
// Each row is read once into an fp32 buffer (divided by the temperature) while finding its max;
// the banned columns' exponentials are summed and the columns set to -inf there. Top-k and top-p
// then take one vectorised pass over that buffer that sums the other exponentials (the
// normaliser) and keeps the best columns in a small sorted list: top-k draws from the list; top-p
// finds the nucleus' last column there and draws from those few columns put in column order. Its
// pass also keeps each column's probability, from which a wider nucleus narrows a band of values
// where the running probability crosses p (16 thresholds a vectorised pass), sorting that band
// alone. Drawing from
// the whole row (or a wide nucleus) writes each column's probability and each vector's sum in the
// normaliser's pass, so the inverse transform walks those sums, then the lanes of the one vector
// where the running sum passes the target: one exponential per column in every case. No
// (rows x V) tensor is written, and rows are split over threads.
#include "common.h"
#include "row_softmax.h"
#include "vec.h"

#include <array>
#include <cmath>
#include <vector>

namespace fastnmt {
namespace {

// How many best columns top-p lists in the normaliser's pass; a wider nucleus takes the band
// search below. Each row pays for the list's insertions: on a trained model's sampled rows (a
// nucleus of one column in 40%, of up to 4 in 59%, of up to 16 in 66%) the kernel ran 11% faster
// with 4 than with 16.
constexpr int64_t kNucleusList = 4;
// A wider nucleus' edge: a band of values narrowed kLevels thresholds a pass (from the kWidestBand
// nats below the best: probabilities down to 1e-14 of the best's) until it holds kBandColumns.
constexpr int kLevels = 16;
constexpr float kWidestBand = 32.0f;
constexpr int64_t kBandColumns = 64;
constexpr int kMaxPasses = 6;

struct Candidate {
  float value;
  int64_t index;
};

// Candidates best first: ties to the lower column (the list's and a stable sort's order).
bool worse(const Candidate& a, const Candidate& b) {
  return a.value < b.value || (a.value == b.value && a.index > b.index);
}

// The largest of x's padded whole vectors.
float allowed_max(const float* x, int64_t padded) {
  Vec running = splat(-kInf);
  for (int64_t j = 0; j < padded; j += kLanes) {
    const Vec v = load(x + j);
    running = v > running ? v : running;
  }
  return horizontal_max(running);
}

// The first of n candidates whose running probability sum passes u times their total, the
// probabilities exp(value - top) (written to probabilities, n of them); where rounding leaves
// u * total at the total, the last one that can be drawn (0 when none can). value(c) gives
// candidate c's value.
template <typename Value>
int64_t inverse_transform(int64_t n, Value value, float top, float u, float* probabilities) {
  double total = 0.0;
  int64_t last = 0;
  for (int64_t c = 0; c < n; ++c) {
    const float v = value(c);
    probabilities[c] = v > -kInf ? std::exp(v - top) : 0.0f;
    total += probabilities[c];
    if (probabilities[c] > 0.0f) last = c;
  }
  const double target = static_cast<double>(u) * total;
  double running = 0.0;
  for (int64_t c = 0; c < last; ++c) {
    running += probabilities[c];
    if (running > target) return c;
  }
  return last;
}

// p = exp(x - top) for x's padded whole vectors (0 where x is -inf) and each vector's sum;
// returns their total.
double write_probabilities(const float* x, int64_t padded, float top, float* p, float* sums) {
  double total = 0.0;
  for (int64_t j = 0; j < padded; j += kLanes) {
    const Vec v = load(x + j);
    const Vec q = v > -kInf ? vector_exp(v - top) : Vec{};
    store(p + j, q);
    sums[j / kLanes] = horizontal_sum(q);
    total += sums[j / kLanes];
  }
  return total;
}

// The inverse transform over probabilities p in column order (sums: each whole vector's, total
// theirs): the first column whose running sum passes u times the total, found by walking the
// vector sums and then the lanes of one vector; where rounding leaves the target past every
// running sum, the last column that can be drawn.
int64_t walk_columns(const float* p, const float* sums, int64_t padded, double total, float u) {
  const double target = static_cast<double>(u) * total;
  double running = 0.0;
  for (int64_t b = 0; b < padded / kLanes; ++b) {
    if (running + sums[b] > target) {
      double within = running;  // the lanes' own sum may round past the vector's
      for (int64_t j = b * kLanes; j < (b + 1) * kLanes; ++j) {
        within += p[j];
        if (within > target && p[j] > 0.0f) return j;
      }
    }
    running += sums[b];
  }
  for (int64_t j = padded - 1; j > 0; --j) {
    if (p[j] > 0.0f) return j;
  }
  return 0;
}

// The nucleus' columns among p (best first: above the edge's value, and those tied with it up to
// its column) keep their probabilities, the others 0; sums and the returned total are the kept
// ones'.
double keep_nucleus(const float* x, float* p, float* sums, int64_t padded, Candidate edge) {
  const float below = std::nextafter(edge.value, -kInf);
  double total = 0.0;
  for (int64_t j = 0; j < padded; j += kLanes) {
    const Vec v = load(x + j);
    Vec q = v < edge.value ? Vec{} : load(p + j);
    uint32_t tied = greater_mask(v, below) & ~greater_mask(v, edge.value);
    for (; tied; tied &= tied - 1) {
      const int l = __builtin_ctz(tied);
      if (j + l > edge.index) q[l] = 0.0f;
    }
    store(p + j, q);
    sums[j / kLanes] = horizontal_sum(q);
    total += sums[j / kLanes];
  }
  return total;
}

// The probability (p) of x's columns above each of kLevels thresholds, hi - step, hi - 2 step,
// ..., in one pass over the padded whole vectors.
std::array<double, kLevels> masses_above(const float* x, const float* p, int64_t padded, float hi,
                                         float step) {
  std::array<Vec, kLevels> sums{};
  std::array<float, kLevels> thresholds;
  for (int k = 0; k < kLevels; ++k) thresholds[k] = hi - step * static_cast<float>(k + 1);
  for (int64_t j = 0; j < padded; j += kLanes) {
    const Vec v = load(x + j), q = load(p + j);
    for (int k = 0; k < kLevels; ++k) sums[k] += v > thresholds[k] ? q : Vec{};
  }
  std::array<double, kLevels> mass;
  for (int k = 0; k < kLevels; ++k) mass[k] = horizontal_sum(sums[k]);
  return mass;
}

// How many of x's columns lie in (lo, hi].
int64_t count_between(const float* x, int64_t padded, float lo, float hi) {
  int64_t count = 0;
  for (int64_t j = 0; j < padded; j += kLanes) {
    const Vec v = load(x + j);
    count += __builtin_popcount(greater_mask(v, lo) & ~greater_mask(v, hi));
  }
  return count;
}

// The last of x's allowed columns, best first (the lowest value, the highest column among ties).
Candidate worst(const float* x, int64_t vocab) {
  Candidate found{kInf, 0};
  for (int64_t j = 0; j < vocab; ++j) {
    if (x[j] > -kInf && x[j] <= found.value) found = {x[j], j};
  }
  return found;
}

// Where the nucleus ends in the list of the best columns (best first, ties to the lower
// column): the position of the first whose running probability, with all before it, reaches
// topp of the allowed probability (exp(value - best) / allowed); the list's last when it holds
// every allowed column; -1 when the nucleus is wider than the list.
int64_t listed_edge(const TopK& listed, const float* listed_values, float best, double allowed,
                    double topp) {
  const double target = topp * allowed;
  double running = 0.0;
  for (int64_t c = 0; c < listed.size(); ++c) {
    running += std::exp(listed_values[c] - best);
    if (running >= target) return c;
  }
  return listed.size() < listed.capacity() ? listed.size() - 1 : -1;
}

// A nucleus wider than the list: its last candidate, best first (ties to the lower column), p
// the columns' probabilities exp(value - best) (any value where x is -inf). A band of values
// where the running probability crosses topp of the allowed probability is narrowed, 16
// thresholds a vectorised pass, to a few columns, which alone are sorted.
Candidate wide_nucleus_edge(const float* x, int64_t vocab, int64_t padded, float best,
                            double allowed, double topp, Candidate listed_last, const float* p,
                            std::vector<Candidate>& band) {
  const double target = topp * allowed;
  double running = 0.0;
  // Narrow a band of values (lo, hi] holding the crossing, mass above hi < target <= mass above
  // lo, kLevels thresholds a pass, until it holds a few columns (or one value: ties).
  float hi = best, width = kWidestBand;
  double mass_hi = 0.0;
  for (int pass = 0; pass < kMaxPasses; ++pass) {
    const float step = width / kLevels;
    const auto mass = masses_above(x, p, padded, hi, step);
    int k = 0;
    while (k < kLevels && mass[k] < target) ++k;
    if (k == kLevels) {  // rounding (p near 1) or a band past the widest: every allowed column
      if (pass == 0) return worst(x, vocab);
      k = kLevels - 1;
    }
    if (k > 0) mass_hi = mass[k - 1];
    hi = hi - step * static_cast<float>(k), width = step;
    if (count_between(x, padded, hi - width, hi) <= kBandColumns) break;
  }
  const float lo = hi - width;
  band.clear();
  for (int64_t j = 0; j < padded; j += kLanes) {
    const Vec v = load(x + j);
    for (uint32_t lanes = greater_mask(v, lo) & ~greater_mask(v, hi); lanes; lanes &= lanes - 1) {
      const int64_t column = j + __builtin_ctz(lanes);
      band.push_back({x[column], column});
    }
  }
  std::sort(band.begin(), band.end(), [](const Candidate& a, const Candidate& b) {
    return worse(b, a);
  });
  running = mass_hi;
  for (const Candidate& candidate : band) {
    running += p[candidate.index];
    if (running >= target) return candidate;
  }
  return band.empty() ? listed_last : band.back();
}

struct Options {
  float temperature;
  int64_t topk;  // 0: no top-k
  double topp;   // >= 1: no top-p (a nucleus of p = 1 is every allowed column)
};

// Whether a banned column holds the row's max (then the best allowed value is below it).
bool max_banned(const float* x, const int64_t* banned, int64_t banned_count, float row_max) {
  for (int64_t b = 0; b < banned_count; ++b) {
    if (x[banned[b]] == row_max) return true;
  }
  return false;
}

// Per thread: a row's fp32 copy, its probabilities and vector sums, the list of best columns.
struct Scratch {
  Scratch(int64_t padded, int64_t listed)
      : x(padded), p(padded), sums(padded / kLanes), values(std::max<int64_t>(listed, 1)),
        indices(std::max<int64_t>(listed, 1)), probabilities(std::max<int64_t>(listed, 1)),
        order(std::max<int64_t>(listed, 1)) {}
  std::vector<float> x, p, sums, values;
  std::vector<int64_t> indices;
  std::vector<float> probabilities;
  std::vector<int64_t> order;  // list positions in column order
  std::vector<Candidate> band;
};

// The nucleus' draw in column order: from its listed columns when it ends in the list, else
// from the row's probabilities with the columns past its edge zeroed.
int64_t nucleus_token(Scratch& s, const TopK& top, int64_t vocab, int64_t padded, float best,
                      double allowed, double topp, float u) {
  const int64_t edge = listed_edge(top, s.values.data(), best, allowed, topp);
  if (edge >= 0) {
    for (int64_t c = 0; c <= edge; ++c) s.order[c] = c;
    std::sort(s.order.begin(), s.order.begin() + edge + 1,
              [&](int64_t a, int64_t b) { return s.indices[a] < s.indices[b]; });
    const int64_t c = inverse_transform(
        edge + 1, [&](int64_t c) { return s.values[s.order[c]]; }, best, u,
        s.probabilities.data());
    return s.indices[s.order[c]];
  }
  const int64_t last = top.size() - 1;
  const Candidate listed_last{s.values[last], s.indices[last]};
  const Candidate found = wide_nucleus_edge(s.x.data(), vocab, padded, best, allowed, topp,
                                            listed_last, s.p.data(), s.band);
  const double kept = keep_nucleus(s.x.data(), s.p.data(), s.sums.data(), padded, found);
  return walk_columns(s.p.data(), s.sums.data(), padded, kept, u);
}

template <typename T>
void rows(const T* logits, const int64_t* banned, int64_t banned_count, const float* uniforms,
          float* log_probs, int64_t* tokens, int64_t count, int64_t vocab, Options options) {
  const int64_t padded = whole_vectors(vocab);
  const bool nucleus_wanted = options.topp < 1.0;
  const int64_t listed =
      options.topk ? options.topk : nucleus_wanted ? std::min(kNucleusList, vocab) : 0;
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    Scratch s(padded, listed);
    float* x = s.x.data();
    for (int64_t i = begin; i < end; ++i) {
      float row_max = load_row(logits + i * vocab, vocab, padded, x);
      if (options.temperature != 1.0f) {  // a division, as the reference's logits / temperature
        for (int64_t j = 0; j < vocab; ++j) x[j] /= options.temperature;
        row_max /= options.temperature;
      }
      const bool best_banned = max_banned(x, banned, banned_count, row_max);
      const float banned_total = ban(x, banned, banned_count, row_max);
      // The draw's probabilities are relative to the best allowed column: a banned column far
      // more probable (bos) must not make them underflow.
      const float best = best_banned ? allowed_max(x, padded) : row_max;
      TopK top(s.values.data(), s.indices.data(), listed);
      double allowed = 0.0;
      int64_t token = 0;
      if (best == -kInf) {
        // no column can be drawn (all banned, or every logit -inf): token 0
      } else if (!listed) {  // every column, in column order
        allowed = write_probabilities(x, padded, best, s.p.data(), s.sums.data());
        token = walk_columns(s.p.data(), s.sums.data(), padded, allowed, uniforms[i]);
      } else {
        float* exps = options.topk ? nullptr : s.p.data();  // a wide nucleus' probabilities
        allowed = exp_sum_and_top(x, vocab, padded, best, &top, exps);
        if (options.topk) {
          const int64_t c = inverse_transform(
              options.topk, [&](int64_t c) { return s.values[c]; }, best, uniforms[i],
              s.probabilities.data());
          token = s.indices[c];
        } else {
          token = nucleus_token(s, top, vocab, padded, best, allowed, options.topp, uniforms[i]);
        }
      }
      const float lse =
          row_max + std::log(static_cast<float>(allowed) * std::exp(best - row_max) + banned_total);
      tokens[i] = token;
      const float value = to_float(logits[i * vocab + token]);
      log_probs[i] = row_max == -kInf ? -kInf
                                      : (options.temperature != 1.0f ? value / options.temperature
                                                                     : value) - lse;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> sample_token(const at::Tensor& logits_in,
                                                const at::Tensor& uniforms_in,
                                                const at::Tensor& banned_in, double temperature,
                                                int64_t topk, double topp) {
  check_cpu(logits_in, "logits");
  check_cpu(uniforms_in, "uniforms");
  check_cpu(banned_in, "banned");
  TORCH_CHECK(logits_in.dim() == 2, "logits must be (rows, V), got ", logits_in.dim(), " dims");
  const auto count = logits_in.size(0), vocab = logits_in.size(1);
  TORCH_CHECK(vocab >= 1, "logits must have at least one column");
  TORCH_CHECK(uniforms_in.dim() == 1 && uniforms_in.size(0) == count,
              "uniforms must be (rows,) = (", count, ",)");
  TORCH_CHECK(topk >= 0 && topk <= vocab, "topk must be in [0, ", vocab, "], got ", topk);
  TORCH_CHECK(topp > 0.0, "topp must be positive, got ", topp);
  TORCH_CHECK(temperature > 0.0, "temperature must be positive, got ", temperature);
  TORCH_CHECK(banned_in.dim() == 1, "banned must be 1-D");
  const auto logits = logits_in.contiguous();
  const auto uniforms = uniforms_in.to(at::kFloat).contiguous();
  const auto banned = banned_in.to(at::kLong).contiguous();
  const auto* banned_ids = banned.data_ptr<int64_t>();
  for (int64_t b = 0; b < banned.numel(); ++b) {
    TORCH_CHECK(banned_ids[b] >= 0 && banned_ids[b] < vocab, "banned id ", banned_ids[b],
                " is outside [0, ", vocab, ")");
  }
  auto log_probs = at::empty({count}, logits.options().dtype(at::kFloat));
  auto tokens = at::empty({count}, logits.options().dtype(at::kLong));
  const Options options{static_cast<float>(temperature), topk, topp};
  dispatch_float(logits.scalar_type(), "sample_token", [&](auto tag) {
    using T = typename decltype(tag)::type;
    rows(logits.data_ptr<T>(), banned_ids, banned.numel(), uniforms.data_ptr<float>(),
         log_probs.data_ptr<float>(), tokens.data_ptr<int64_t>(), count, vocab, options);
  });
  return {log_probs, tokens};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastnmt, m) {
  m.def(
      "sample_token_cpp(Tensor logits, Tensor uniforms, Tensor banned, float temperature, "
      "int topk, float topp) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastnmt, CPU, m) { m.impl("sample_token_cpp", sample_token); }

}  // namespace fastnmt
