// The k most probable entries of each row of log_softmax(logits), some columns banned (the row
// step of beam search; fastnmt/ops/log_softmax_topk.py has the math and the reference).
//
// Each row is read once from the logits into an fp32 buffer while finding its max; the banned
// columns' exponentials are summed and the columns set to -inf there (out of the choice, still in
// the normaliser, as in fairseq's and transformers' search). One more vectorised pass over that
// buffer, while it is in L1/L2, sums the other exponentials and keeps the top k in a small sorted
// list that a whole vector of candidates skips when none of its lanes beats the k-th best. No
// (rows x V) log-probability tensor is written. Rows are independent, so the work is split over
// rows and no result depends on the thread count.
//
// An ensemble's logits (M, rows, V) average the members' probabilities (fairseq's rule): each
// member's row is loaded and banned as above and its log-normaliser summed in one pass; one more
// pass sums the members' probabilities per column and keeps the top k of those sums, whose logs
// (less log M) are the values. Still no (rows x V) tensor is written.
//
// row_scales (one model's logits only): the logits are logits[i] * row_scales[i], an int8 output
// layer's unscaled rows (fastnmt/quantize.py), scaled as they are loaded.
#include "common.h"
#include "row_softmax.h"
#include "vec.h"

#include <cmath>
#include <vector>

namespace fastnmt {
namespace {

template <typename T>
void rows(const T* logits, const float* row_scales, const int64_t* banned, int64_t banned_count,
          float* values, int64_t* indices, int64_t count, int64_t vocab, int64_t k) {
  const int64_t padded = whole_vectors(vocab);
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(padded);
    float* x = buffer.data();
    for (int64_t i = begin; i < end; ++i) {
      const float scale = row_scales == nullptr ? 1.0f : row_scales[i];
      const float row_max = load_row(logits + i * vocab, vocab, padded, x, scale);
      const float banned_total = ban(x, banned, banned_count, row_max);
      TopK top(values + i * k, indices + i * k, k);
      const float lse =
          row_max + std::log(exp_sum_and_top(x, vocab, padded, row_max, &top) + banned_total);
      for (int64_t c = 0; c < k; ++c) {
        float& value = values[i * k + c];
        // every logit -inf: no token is possible, every value -inf
        value = row_max == -kInf ? -kInf : value - lse;
      }
    }
  });
}

// The ensemble's rows: logits (members, count, V).
template <typename T>
void ensemble_rows(const T* logits, int64_t members, const int64_t* banned, int64_t banned_count,
                   float* values, int64_t* indices, int64_t count, int64_t vocab, int64_t k) {
  const int64_t padded = whole_vectors(vocab);
  const float log_members = std::log(static_cast<float>(members));
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer((members + 1) * padded), lse(members);
    float* sum = buffer.data() + members * padded;  // the members' probabilities, per column
    for (int64_t i = begin; i < end; ++i) {
      bool possible = false;
      for (int64_t m = 0; m < members; ++m) {
        float* x = buffer.data() + m * padded;
        const float row_max = load_row(logits + (m * count + i) * vocab, vocab, padded, x);
        const float banned_total = ban(x, banned, banned_count, row_max);
        lse[m] = row_max +
                 std::log(exp_sum_and_top(x, vocab, padded, row_max, nullptr) + banned_total);
        possible |= row_max > -kInf;
      }
      for (int64_t j = 0; j < padded; j += kLanes) {
        Vec total = splat(0.0f);
        for (int64_t m = 0; m < members; ++m) {
          const Vec v = load(buffer.data() + m * padded + j);
          total += v > -kInf ? vector_exp(v - lse[m]) : Vec{};
        }
        // Columns no member can choose stay out of the choice (banned, padding lanes).
        store(sum + j, total > 0.0f ? total : splat(-kInf));
      }
      TopK top(values + i * k, indices + i * k, k);
      const int64_t head = offered_head(padded, top);
      for (int64_t j = 0; j < std::min(head, vocab); ++j) top.offer(sum[j], j);
      for (int64_t j = head; j < padded; j += kLanes) offer_vector(sum, load(sum + j), j, top);
      for (int64_t c = 0; c < k; ++c) {
        float& value = values[i * k + c];
        value = possible && value > -kInf ? std::log(value) - log_members : -kInf;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> log_softmax_topk(
    const at::Tensor& logits_in, int64_t k, const at::Tensor& banned_in,
    const c10::optional<at::Tensor>& row_scales) {
  check_cpu(logits_in, "logits");
  check_cpu(banned_in, "banned");
  TORCH_CHECK(logits_in.dim() == 2 || logits_in.dim() == 3,
              "logits must be (rows, V) or an ensemble's (members, rows, V), got ",
              logits_in.dim(), " dims");
  const bool ensemble = logits_in.dim() == 3;
  const auto members = ensemble ? logits_in.size(0) : 1;
  const auto count = logits_in.size(-2), vocab = logits_in.size(-1);
  TORCH_CHECK(k >= 1 && k <= vocab, "k must be in [1, ", vocab, "], got ", k);
  TORCH_CHECK(banned_in.dim() == 1, "banned must be 1-D");
  const auto logits = logits_in.contiguous();
  const auto banned = banned_in.to(at::kLong).contiguous();
  const auto* banned_ids = banned.data_ptr<int64_t>();
  TORCH_CHECK(!ensemble || !row_scales.has_value(),
              "row_scales apply to one model's logits (rows, V), not an ensemble's");
  const auto contiguous_scales =
      row_scales.has_value() ? row_scales->contiguous() : at::Tensor();
  const float* scales =
      contiguous_scales.defined()
          ? row_scales_data(contiguous_scales, count, "log_softmax_topk", "row_scales")
          : nullptr;
  for (int64_t b = 0; b < banned.numel(); ++b) {
    TORCH_CHECK(banned_ids[b] >= 0 && banned_ids[b] < vocab, "banned id ", banned_ids[b],
                " is outside [0, ", vocab, ")");
  }
  auto values = at::empty({count, k}, logits.options().dtype(at::kFloat));
  auto indices = at::empty({count, k}, logits.options().dtype(at::kLong));
  dispatch_float(logits.scalar_type(), "log_softmax_topk", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (ensemble) {
      ensemble_rows(logits.data_ptr<T>(), members, banned_ids, banned.numel(),
                    values.data_ptr<float>(), indices.data_ptr<int64_t>(), count, vocab, k);
    } else {
      rows(logits.data_ptr<T>(), scales, banned_ids, banned.numel(), values.data_ptr<float>(),
           indices.data_ptr<int64_t>(), count, vocab, k);
    }
  });
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastnmt, m) {
  m.def(
      "log_softmax_topk_cpp(Tensor logits, int k, Tensor banned, Tensor? row_scales=None) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastnmt, CPU, m) { m.impl("log_softmax_topk_cpp", log_softmax_topk); }

}  // namespace fastnmt
