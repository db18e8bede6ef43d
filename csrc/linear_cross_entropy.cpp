// Label-smoothed cross entropy over rows of logits, turning each row into the gradient of the
// summed loss in place (g of the row step of fastnmt/ops/linear_cross_entropy.py, whose docstring
// has the math; the caller applies a mean's 1 / tokens in fp32, after the GEMMs).
//
// The caller computes a chunk of logits with a library GEMM and hands it here while it is still
// in cache; this kernel makes three vectorised passes over each row (max/argmax, sums of
// exponentials and of logits, gradient) and never writes a log-probability tensor. Rows are
// independent, so the work is split over rows with at::parallel_for and no result depends on the
// thread count. Scoring (no gradient) may hand over an int8 GEMM's unscaled rows with their
// scales, applied here on the way (no pass of their own over the logits).
#include "common.h"
#include "vec.h"

#include <cmath>
#include <limits>
#include <type_traits>

namespace fastnmt {
namespace {

struct RowMax {
  float max;
  int64_t argmax;  // the first index of the max
};

// Independent accumulators per pass: one alone waits out each compare's or add's latency at
// every vector (the passes ran at a third of their throughput on a row of 8,000).
constexpr int kChains = 4;
constexpr int64_t kChainStep = kChains * kLanes;

template <typename T>
RowMax max_argmax(const T* x, int64_t n) {
  const int64_t whole = n / kChainStep * kChainStep;
  Vec best[kChains], best_index[kChains];
  for (int c = 0; c < kChains; ++c) best[c] = splat(-kInf), best_index[c] = splat(0.0f);
  const Vec lanes = lane_indices();
  for (int64_t j = 0; j < whole; j += kChainStep) {
    for (int c = 0; c < kChains; ++c) {
      const int64_t first = j + c * kLanes;
      const Vec v = load_float(x + first);
      const auto greater = v > best[c];  // strict: each lane keeps its first maximum
      best[c] = greater ? v : best[c];
      best_index[c] = greater ? lanes + static_cast<float>(first) : best_index[c];
    }
  }
  RowMax stats{-kInf, 0};
  for (int c = 0; c < kChains; ++c) {
    for (int l = 0; l < kLanes; ++l) {
      const auto index = static_cast<int64_t>(best_index[c][l]);
      if (best[c][l] > stats.max || (best[c][l] == stats.max && index < stats.argmax)) {
        stats.max = best[c][l];
        stats.argmax = index;
      }
    }
  }
  for (int64_t j = whole; j < n; ++j) {
    const float v = to_float(x[j]);
    if (v > stats.max) stats.max = v, stats.argmax = j;
  }
  return stats;
}

struct ShiftedSums {
  float exp;      // sum of exp(x - shift)
  float shifted;  // sum of (x - shift): no cancellation against V * lse, unlike sum of x
};

// Of the logits x * row_scale (kScaled; x itself otherwise), shifted by shift * row_scale.
template <bool kScaled, typename T>
ShiftedSums shifted_sums(const T* x, int64_t n, float shift, float row_scale) {
  const int64_t whole = n / kChainStep * kChainStep;
  const float scaled_shift = shift * row_scale;
  Vec exp_sum[kChains] = {}, shifted_sum[kChains] = {};
  for (int64_t j = 0; j < whole; j += kChainStep) {
    for (int c = 0; c < kChains; ++c) {
      // One fused multiply-add when scaled: x s - shift s.
      const Vec shifted = kScaled ? load_float(x + j + c * kLanes) * row_scale - scaled_shift
                                  : load_float(x + j + c * kLanes) - shift;
      exp_sum[c] += vector_exp(shifted);
      shifted_sum[c] += shifted;
    }
  }
  static_assert(kChains == 4, "the chains are added as a tree of four");
  const Vec exps = (exp_sum[0] + exp_sum[1]) + (exp_sum[2] + exp_sum[3]);
  const Vec shifts = (shifted_sum[0] + shifted_sum[1]) + (shifted_sum[2] + shifted_sum[3]);
  ShiftedSums sums{horizontal_sum(exps), horizontal_sum(shifts)};
  for (int64_t j = whole; j < n; ++j) {
    const float shifted =
        kScaled ? to_float(x[j]) * row_scale - scaled_shift : to_float(x[j]) - shift;
    sums.exp += std::exp(shifted);
    sums.shifted += shifted;
  }
  return sums;
}

// x <- (softmax(x) - smoothing / n) * scale, written over x (the target's -(1 - smoothing) is
// added by the caller).
template <typename T>
void write_gradient(T* x, int64_t n, float lse, float uniform, float scale) {
  const int64_t whole = n / kLanes * kLanes;
  for (int64_t j = 0; j < whole; j += kLanes) {
    store_float(x + j, (vector_exp(load_float(x + j) - lse) - uniform) * scale);
  }
  for (int64_t j = whole; j < n; ++j) {
    x[j] = static_cast<T>((std::exp(to_float(x[j]) - lse) - uniform) * scale);
  }
}

// The nll of a row in one pass (loss_only): log sum_v exp(x_v - x_gold), shifted by the gold
// logit, which is at hand, rather than by the max, which takes a pass of its own. A row whose
// gold logit lies about 87 or more below its max (its sum reaches 1e38, or overflows) is not
// served: NaN, and the caller takes the two passes.
// The exponentials are powers of two: exp(s (x - x_gold)) = 2^(a x - a x_gold), a = s log2(e).
template <bool kScaled, typename T>
float gold_shifted_nll(const T* x, int64_t vocab, int64_t gold, float row_scale) {
  const float a = (kScaled ? row_scale : 1.0f) * static_cast<float>(M_LOG2E);
  const float shift = a * to_float(x[gold]);
  const int64_t whole = vocab / kChainStep * kChainStep;
  Vec sums[kChains] = {};
  for (int64_t j = 0; j < whole; j += kChainStep) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // Two vectors of bf16 per load (load_pairs: the order of a sum's terms is free).
      for (int c = 0; c < kChains; c += 2) {
        Vec even, odd;
        load_pairs(x + j + c * kLanes, even, odd);
        sums[c] += vector_exp2_term(even * a - shift);
        sums[c + 1] += vector_exp2_term(odd * a - shift);
      }
    } else {
      for (int c = 0; c < kChains; ++c) {
        sums[c] += vector_exp2_term(load_float(x + j + c * kLanes) * a - shift);
      }
    }
  }
  float sum = horizontal_sum((sums[0] + sums[1]) + (sums[2] + sums[3]));
  for (int64_t j = whole; j < vocab; ++j) sum += std::exp2(to_float(x[j]) * a - shift);
  return sum < 1e38f ? std::log(sum) : std::numeric_limits<float>::quiet_NaN();
}

// row_scales (kScaled): each row's logits are x * row_scales[i] (an int8 GEMM's unscaled output,
// fastnmt/quantize.py; positive scales keep the max where it is). No gradient then. loss_only
// (no smoothing, no gradient): each row's loss and nll, its `correct` NaN (no argmax is taken).
template <bool kScaled, typename T>
void rows(T* logits, const int64_t* target, float* stats, int64_t count, int64_t vocab,
          float smoothing, int64_t ignore_index, bool compute_grad, float scale,
          const float* row_scales, bool loss_only) {
  const float uniform = smoothing / static_cast<float>(vocab);
  // Threads only for rows worth waking them (PyTorch's grain): a thread pool round trip costs
  // more than a few short rows.
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* x = logits + i * vocab;
      float* out = stats + i * 3;  // loss, nll, correct
      const int64_t gold = target[i];
      if (gold == ignore_index) {
        out[0] = out[1] = out[2] = 0.0f;
        if (compute_grad) std::fill(x, x + vocab, static_cast<T>(0.0f));
        continue;
      }
      const float row_scale = kScaled ? row_scales[i] : 1.0f;
      constexpr float kNoArgmax = std::numeric_limits<float>::quiet_NaN();
      if (loss_only) {
        const float nll = gold_shifted_nll<kScaled>(x, vocab, gold, row_scale);
        if (!std::isnan(nll)) {
          out[0] = out[1] = nll;
          out[2] = kNoArgmax;
          continue;
        }
      }
      const RowMax row = max_argmax(x, vocab);
      const ShiftedSums sums = shifted_sums<kScaled>(x, vocab, row.max, row_scale);
      const float log_sum = std::log(sums.exp);
      const float lse = row.max * row_scale + log_sum;
      const float gold_logit = to_float(x[gold]) * row_scale;
      const float nll = lse - gold_logit;
      // -sum_v log p_v = vocab * lse - sum_v x_v, computed relative to the max
      const float smoothed = static_cast<float>(vocab) * log_sum - sums.shifted;
      out[0] = (1.0f - smoothing) * nll + uniform * smoothed;
      out[1] = nll;
      out[2] = loss_only ? kNoArgmax : row.argmax == gold ? 1.0f : 0.0f;
      if (kScaled || !compute_grad) continue;
      write_gradient(x, vocab, lse, uniform, scale);
      const float gold_probability = std::exp(gold_logit - lse);
      x[gold] = static_cast<T>((gold_probability - uniform - (1.0f - smoothing)) * scale);
    }
  });
}

// The gradient rows come out times grad_scale (s of the math, when the caller folds it in).
at::Tensor cross_entropy_rows(at::Tensor logits, const at::Tensor& target, double label_smoothing,
                              int64_t ignore_index, bool compute_grad, double grad_scale,
                              const c10::optional<at::Tensor>& row_scales = c10::nullopt,
                              bool loss_only = false) {
  check_cpu(logits, "logits");
  check_cpu(target, "target");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous 2-D tensor");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 &&
                  target.size(0) == logits.size(0),
              "target must be int64 of shape (", logits.size(0), ",)");
  const auto count = logits.size(0), vocab = logits.size(1);
  const auto gold = target.contiguous();
  const auto* gold_ids = gold.data_ptr<int64_t>();
  // On the CPU the targets are at hand: checking them costs no device sync, and an out-of-range
  // one raises here instead of indexing outside its row.
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(gold_ids[i] == ignore_index || (gold_ids[i] >= 0 && gold_ids[i] < vocab),
                "target ", gold_ids[i], " at row ", i, " is outside [0, ", vocab,
                ") and is not ignore_index (", ignore_index, ")");
  }
  const float* scales = nullptr;
  if (row_scales.has_value()) {
    scales = row_scales_data(*row_scales, count, "cross_entropy_rows", "row_scales");
    TORCH_CHECK(!compute_grad, "row_scales (an int8 GEMM's logits) give no gradient");
  }
  TORCH_CHECK(!loss_only || (!compute_grad && label_smoothing == 0.0),
              "loss_only takes no gradient and no label smoothing");
  auto stats = at::empty({count, 3}, logits.options().dtype(at::kFloat));
  dispatch_float(logits.scalar_type(), "cross_entropy_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto run = [&](auto scaled) {
      rows<decltype(scaled)::value>(logits.data_ptr<T>(), gold_ids, stats.data_ptr<float>(),
                                    count, vocab, static_cast<float>(label_smoothing),
                                    ignore_index, compute_grad, static_cast<float>(grad_scale),
                                    scales, loss_only);
    };
    if (scales != nullptr) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
  return stats;
}

at::Tensor cross_entropy_rows_op(at::Tensor logits, const at::Tensor& target,
                                 double label_smoothing, int64_t ignore_index, bool compute_grad,
                                 const c10::optional<at::Tensor>& row_scales, bool loss_only) {
  return cross_entropy_rows(logits, target, label_smoothing, ignore_index, compute_grad, 1.0,
                            row_scales, loss_only);
}

constexpr int64_t kChunkElements = int64_t{1} << 23;  // as fastnmt/ops/triton/linear_cross_entropy.py

// s of the math: the loss's factor, 1 / counted tokens for a mean (1 when none count).
double mean_scale(bool mean, int64_t counted) {
  return mean ? 1.0 / static_cast<double>(std::max<int64_t>(counted, 1)) : 1.0;
}

bool folds_scale(at::ScalarType compute_dtype) { return compute_dtype != at::kHalf; }

// (loss, [nll, correct, tokens], dhidden, dweight, dbias): linear_cross_entropy.py's _chunked
// (its math and its chunking), here so that a CPU step does not issue its ~50 small ops from
// Python. The gradients are those of the returned loss (s folded into g), so that a backward
// with dloss = 1 has nothing left to compute; in fp16 (folds_scale false) those of the summed
// loss, as s g could underflow there: the backward applies s, in fp32. dweight and dbias stay
// fp32; each gradient is empty unless compute_grad.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy(
    const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    const at::Tensor& target, double label_smoothing, int64_t ignore_index, bool mean,
    bool compute_grad, c10::optional<at::ScalarType> dtype) {
  check_cpu(hidden, "hidden");
  const auto compute_dtype = dtype.value_or(hidden.scalar_type());
  const auto h = hidden.to(compute_dtype).contiguous();  // (N, E)
  const auto w = weight.to(compute_dtype).contiguous();  // (V, E)
  c10::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->to(compute_dtype);
  const int64_t tokens = h.size(0), vocab = w.size(0);
  const int64_t step =
      std::max<int64_t>(16, kChunkElements / std::max<int64_t>(vocab, 1) / 16 * 16);
  const bool one_chunk = tokens <= step;
  // (E, V): CPU GEMMs take a transposed view slower, chunk after chunk; one chunk takes the view.
  const auto w_t = one_chunk ? w.t() : w.t().contiguous();
  const auto targets = target.to(at::kLong).contiguous();
  const auto* ids = targets.data_ptr<int64_t>();
  int64_t counted = 0;  // on the CPU the targets are at hand: no ops to count them
  for (int64_t i = 0; i < tokens; ++i) counted += ids[i] != ignore_index;
  const double scale = mean_scale(mean, counted);
  const auto fp32 = h.options().dtype(at::kFloat);
  double sums[3] = {0.0, 0.0, 0.0};  // loss, nll, correct (rows' sums, on the host)
  at::Tensor dh, dw, db;
  if (compute_grad && !one_chunk) dh = at::empty(h.sizes(), h.options());
  for (int64_t start = 0; start < tokens; start += step) {
    const int64_t rows = std::min(step, tokens - start);
    const auto h_chunk = h.narrow(0, start, rows);
    auto z = b ? at::addmm(*b, h_chunk, w_t) : at::mm(h_chunk, w_t);  // (C, V), becomes g
    const auto row_stats = cross_entropy_rows(z, targets.narrow(0, start, rows), label_smoothing,
                                              ignore_index, compute_grad,
                                              folds_scale(compute_dtype) ? scale : 1.0);
    const auto* stat = row_stats.const_data_ptr<float>();
    for (int64_t i = 0; i < rows * 3; ++i) sums[i % 3] += stat[i];
    if (!compute_grad) continue;
    if (one_chunk) {
      dh = at::mm(z, w);
    } else {
      auto dh_chunk = dh.narrow(0, start, rows);
      at::mm_out(dh_chunk, z, w);
    }
    if (!dw.defined()) {
      dw = at::mm(z.t(), h_chunk).to(at::kFloat);
    } else if (compute_dtype == at::kFloat) {
      dw.addmm_(z.t(), h_chunk);
    } else {  // dw stays fp32: addmm_ takes one dtype
      dw += at::mm(z.t(), h_chunk);
    }
    if (b) {
      auto db_chunk = z.sum(0, /*keepdim=*/false, at::kFloat);
      db = db.defined() ? db.add_(db_chunk) : db_chunk;
    }
  }
  if (!compute_grad) {
    dh = at::empty({0}, h.options());
    dw = at::empty({0}, fp32);
  } else if (!dw.defined()) {  // no tokens
    dh = at::empty(h.sizes(), h.options());
    dw = at::zeros(w.sizes(), fp32);
  }
  if (!(compute_grad && b)) {
    db = at::empty({0}, fp32);
  } else if (!db.defined()) {
    db = at::zeros({vocab}, fp32);
  }

  // The sums are on the host: written through pointers, not as a handful of scalar ops.
  const auto loss = at::empty({}, fp32);
  *loss.mutable_data_ptr<float>() = static_cast<float>(sums[0] * scale);
  const auto statistics = at::empty({3}, h.options().dtype(at::kDouble));
  auto* statistic = statistics.mutable_data_ptr<double>();
  statistic[0] = sums[1];
  statistic[1] = sums[2];
  statistic[2] = static_cast<double>(counted);
  return {loss, statistics, dh.to(hidden.scalar_type()), dw, db};
}

// Autograd in C++ (see add_layer_norm.cpp): the backward of linear_cross_entropy.py's _define.
// A hand-made autograd node (common.h: make_node): the forward computed the gradients, the
// backward scales them by dloss.
struct LinearCrossEntropyBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable statistics, dh, dw, db;
  bool compute_grad = false;
  bool apply_mean = false;  // whether the backward must apply s (see linear_cross_entropy above)
  at::ScalarType hidden_dtype = at::kFloat, weight_dtype = at::kFloat;
  c10::optional<at::ScalarType> bias_dtype;

  std::string name() const override { return "LinearCrossEntropyBackward"; }

  void release_variables() override {
    for (auto* saved : {&statistics, &dh, &dw, &db}) saved->reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(compute_grad,
                "fastnmt::linear_cross_entropy_cpp ran with compute_grad=False: no gradient kept");
    torch::autograd::variable_list result(3);  // hidden, weight, bias
    if (!grads[0].defined()) return result;    // the loss was not used
    // dloss read as a number (the op runs on the CPU: no device sync) unless traced. It is 1
    // for a loss.backward(): the saved gradients are the answer, and the engine, which releases
    // them from this node before the gradients reach .grad, hands them over without a copy.
    const auto& dloss = grads[0];
    const auto tokens = statistics.unpack()[2];
    const bool traced = dloss.key_set().has_any(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
    // Traced: the same product as tensor ops, in fp32 (fp16 s g would underflow).
    const auto traced_factor = [&] {
      const auto factor = dloss.to(at::kFloat);
      return apply_mean ? factor / tokens.clamp_min(1).to(at::kFloat) : factor;
    };
    const double factor =
        traced ? 0.0
               : dloss.item<double>() / (apply_mean ? std::max(tokens.item<double>(), 1.0) : 1.0);
    const auto scaled = [&](const at::Tensor& grad, at::ScalarType dtype) {
      // a tensor times a number computes in fp32 at least: no fp16 rounding before the product
      const auto product = traced ? grad.to(at::kFloat) * traced_factor()
                                  : (factor == 1.0 ? grad : grad.mul(factor));
      return product.to(dtype);
    };
    result[0] = scaled(dh.unpack(), hidden_dtype);
    result[1] = scaled(dw.unpack(), weight_dtype);
    if (bias_dtype) result[2] = scaled(db.unpack(), *bias_dtype);
    return result;
  }
};

using LossAndGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

LossAndGradients linear_cross_entropy_autograd(
    const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    const at::Tensor& target, double label_smoothing, int64_t ignore_index, bool mean,
    bool compute_grad, c10::optional<at::ScalarType> dtype) {
  static const auto op =
      registered_op<decltype(linear_cross_entropy)>("fastnmt::linear_cross_entropy_cpp");
  const auto bias_ = bias.value_or(at::Tensor());
  auto out = call_below_autograd(op, hidden, weight, bias, target, label_smoothing, ignore_index,
                                 mean, compute_grad, dtype);
  if (!torch::autograd::compute_requires_grad(hidden, weight, bias_)) return out;
  auto& [loss, statistics, dh, dw, db] = out;
  auto& backward = record_node<LinearCrossEntropyBackward>({loss}, hidden, weight, bias_);
  // the other outputs are not differentiable: no grad_fn, saved as plain tensors
  backward.statistics = torch::autograd::SavedVariable(statistics, false);
  backward.dh = torch::autograd::SavedVariable(dh, false);
  backward.dw = torch::autograd::SavedVariable(dw, false);
  backward.db = torch::autograd::SavedVariable(db, false);
  backward.compute_grad = compute_grad;
  backward.apply_mean = mean && !folds_scale(dtype.value_or(hidden.scalar_type()));
  backward.hidden_dtype = hidden.scalar_type();
  backward.weight_dtype = weight.scalar_type();
  if (bias) backward.bias_dtype = bias->scalar_type();
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastnmt, m) {
  m.def(
      "cross_entropy_rows_cpp(Tensor(a!) logits, Tensor target, float label_smoothing, "
      "int ignore_index, bool compute_grad, Tensor? row_scales=None, bool loss_only=False) -> "
      "Tensor");
  m.def(
      "linear_cross_entropy_cpp(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "float label_smoothing, int ignore_index, bool mean, bool compute_grad, "
      "ScalarType? dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastnmt, CPU, m) {
  m.impl("cross_entropy_rows_cpp", cross_entropy_rows_op);
  m.impl("linear_cross_entropy_cpp", linear_cross_entropy);
}

TORCH_LIBRARY_IMPL(fastnmt, Autograd, m) {
  m.impl("linear_cross_entropy_cpp", &linear_cross_entropy_autograd);
}

}  // namespace fastnmt
