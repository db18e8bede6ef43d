// Residual add + LayerNorm with fused dropout, forward and backward (see
// fastnmt/ops/layer_norm.py for the math). One pass over each row's inputs: rows are short
// (d_model <= a few thousand), so a row stays in L1 between the statistics and the output.
//
// Parallel over rows. dweight/dbias are reduced deterministically: fixed blocks of rows each
// write fp32 partial sums, which are then added in block order, so the result does not depend on
// the number of threads.
#include "common.h"

namespace fastnmt {
namespace {

constexpr int64_t kRowsPerBlock = 32;  // rows per partial sum of dweight / dbias

// An affine parameter as contiguous fp32: the tensor itself when it already is one (no copy per
// call: at translation shapes, an op's fixed cost is most of its time), undefined when absent.
at::Tensor as_float(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->to(at::kFloat).contiguous() : at::Tensor();
}

// Whether the forward reads the affine parameters as they are: each absent or of x's dtype (a
// bf16 model's LayerNorm when translating; converting them cost two copies per call).
bool affine_in_dtype(const c10::optional<at::Tensor>& weight,
                     const c10::optional<at::Tensor>& bias, at::ScalarType x_type) {
  const auto in_dtype = [&](const c10::optional<at::Tensor>& t) {
    return !t.has_value() || (t->scalar_type() == x_type && t->is_contiguous());
  };
  return in_dtype(weight) && in_dtype(bias);
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

const float* float_data(const at::Tensor& t) { return data_or_null<float>(t); }

// Lanes [j, j + n) of an affine parameter (n <= kLanes), or `fill` where it is absent.
template <typename w_t>
inline Vec affine(const w_t* parameter, int64_t j, int64_t n, float fill) {
  return parameter != nullptr ? load_float(parameter + j, n) : splat(fill);
}

// Lanes [0, n) of v, the others 0.
inline Vec first_lanes(Vec v, int64_t n) {
  return n >= kLanes ? v : (lane_indices() < static_cast<float>(n) ? v : Vec{});
}

// The affine parameters of a call as fp32 vectors, whole_vectors(width) each (1 and 0 where
// absent, and past the width), and the bias x is finished with (Terms; 0 where absent):
// converted once per thread, not at every row.
struct Affine {
  std::vector<float> values;
  const float* weight;
  const float* bias;
  const float* x_bias;

  template <typename w_t>
  Affine(const w_t* weight_in, const w_t* bias_in, const float* x_bias_in, int64_t width)
      : values(3 * whole_vectors(width), 0.0f) {
    float* w = values.data();
    float* b = w + whole_vectors(width);
    float* xb = b + whole_vectors(width);
    for (int64_t j = 0; j < width; ++j) {
      w[j] = weight_in != nullptr ? static_cast<float>(weight_in[j]) : 1.0f;
      b[j] = bias_in != nullptr ? static_cast<float>(bias_in[j]) : 0.0f;
      xb[j] = x_bias_in != nullptr ? x_bias_in[j] : 0.0f;
    }
    weight = w;
    bias = b;
    x_bias = xb;
  }
};

// A row of x as the first term of h: x itself, or (kFinish) an int8 GEMM's unscaled output
// finished on the way in, x scale + x_bias (its scale_rows_, fused: fastnmt/quantize.py).
template <typename x_t, bool kFinish>
struct Terms {
  const x_t* x;
  float scale;
  const float* bias;  // whole vectors, 0 past the width

  // Lanes [j, j + n), 0 past n (x's lanes load as 0 there, and the bias is 0 past the width).
  inline Vec at(int64_t j, int64_t n) const {
    const Vec v = load_float(x + j, n);
    if constexpr (kFinish) return v * scale + load(bias + j);
    return v;
  }

  inline float first() const {
    return kFinish ? to_float(x[0]) * scale + bias[0] : to_float(x[0]);
  }
};

// h = residual + dropout(x) over lanes [j, j + n) (element indices first + j), stored to h, and
// returned as stored (its statistics are those of h as stored).
template <typename Row, typename h_t>
inline Vec residual_sum(const Row& x, const h_t* residual, h_t* h, int64_t j, int64_t n,
                        const DropoutStream& dropout, uint32_t first) {
  Vec value = x.at(j, n);
  if (dropout.active) value *= dropout.factors(first + static_cast<uint32_t>(j));
  if (residual != nullptr) value += load_float(residual + j, n);
  store_float(h + j, value, n);
  return as_stored<h_t>(value);
}

// One row: h = residual + dropout(x) (element indices first + j), its statistics, y. `hf` is
// scratch of whole_vectors(width) floats: h as stored, converted once for both passes. The
// statistics take one pass, as sums of h - c and its squares with c about h[0] (shifted data: no
// cancellation unless the row's spread is tiny against its distance from c), so a row's
// chain of dependent steps (sums, then mean and rstd, then y) is short; whole vectors run on two
// chains of sums, the tail masked.
template <typename Row, typename x_t, typename h_t>
void forward_row(const Row& x, const h_t* residual, const Affine& affine, x_t* y, h_t* h,
                 float* hf, int64_t width, float eps, const DropoutStream& dropout,
                 uint32_t first, float* mean_out, float* rstd_out) {
  const int64_t whole = width / kLanes * kLanes;
  // Near the mean, as h[0] is (dropout aside, which only moves it).
  const float c = x.first() + (residual != nullptr ? to_float(residual[0]) : 0.0f);
  Vec sum0 = Vec{}, sum1 = Vec{}, squares0 = Vec{}, squares1 = Vec{};
  int64_t j = 0;
  for (; j + 2 * kLanes <= whole; j += 2 * kLanes) {
    const Vec a = residual_sum(x, residual, h, j, kLanes, dropout, first);
    const Vec b = residual_sum(x, residual, h, j + kLanes, kLanes, dropout, first);
    store(hf + j, a);
    store(hf + j + kLanes, b);
    const Vec da = a - c, db = b - c;
    sum0 += da;
    sum1 += db;
    squares0 += da * da;
    squares1 += db * db;
  }
  for (; j < width; j += kLanes) {  // an odd whole vector, then the tail
    const int64_t n = std::min(kLanes, width - j);
    const Vec a = residual_sum(x, residual, h, j, n, dropout, first);
    store(hf + j, a);
    const Vec d = first_lanes(a - c, n);
    sum0 += d;
    squares0 += d * d;
  }
  const float inverse_width = 1.0f / static_cast<float>(width);
  const float shift = horizontal_sum(sum0 + sum1) * inverse_width;  // mean - c
  const float variance =
      std::max(horizontal_sum(squares0 + squares1) * inverse_width - shift * shift, 0.0f);
  const float mean = c + shift;
  const float rstd = 1.0f / std::sqrt(variance + eps);
  for (j = 0; j < width; j += kLanes) {
    const Vec xhat = (load(hf + j) - mean) * rstd;
    const Vec out = xhat * load(affine.weight + j) + load(affine.bias + j);
    if (j < whole) {
      store_float(y + j, out);
    } else {
      store_float(y + j, out, width - whole);
    }
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

// x_scales: x is an int8 GEMM's unscaled output, row i times x_scales[i] plus x_bias (Terms);
// nullptr: x itself.
template <typename x_t, typename h_t, typename w_t>
void forward_rows(const x_t* x, const float* x_scales, const float* x_bias, const h_t* residual,
                  const w_t* weight, const w_t* bias, x_t* y, h_t* h, float* mean, float* rstd,
                  int64_t rows, int64_t width, double eps, const DropoutStream& dropout) {
  const auto run = [&](auto finish) {
    constexpr bool kFinish = decltype(finish)::value;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      const Affine affine(weight, bias, x_bias, width);
      std::vector<float> hf(whole_vectors(width));
      for (int64_t row = begin; row < end; ++row) {
        const int64_t offset = row * width;
        const Terms<x_t, kFinish> terms{x + offset, kFinish ? x_scales[row] : 1.0f, affine.x_bias};
        forward_row(terms, residual == nullptr ? nullptr : residual + offset, affine, y + offset,
                    h + offset, hf.data(), width, static_cast<float>(eps), dropout,
                    static_cast<uint32_t>(offset), mean + row, rstd + row);
      }
    });
  };
  x_scales != nullptr ? run(std::true_type{}) : run(std::false_type{});
}

// One row of dx and dresidual (see the math at the top of fastnmt/ops/layer_norm.py), adding
// its dy * xhat and dy to dw and db; g and xhat are scratch of whole_vectors(width) floats.
template <typename x_t, typename h_t>
void backward_row(const x_t* dy, const h_t* dh_out, const h_t* h, const float* weight,
                  float mean, float rstd, x_t* dx, h_t* dresidual, float* dw, float* db,
                  float* g, float* xhat, int64_t width, const DropoutStream& dropout,
                  uint32_t first) {
  Vec sum_g = Vec{}, sum_g_xhat = Vec{};
  for (int64_t j = 0; j < width; j += kLanes) {
    const int64_t n = std::min(kLanes, width - j);
    const Vec dy_j = load_float(dy + j, n);  // 0 past the row: no contribution below
    const Vec xhat_j = (load_float(h + j, n) - mean) * rstd;
    const Vec g_j = dy_j * affine(weight, j, n, 1.0f);
    store(g + j, g_j);
    store(xhat + j, xhat_j);
    sum_g += g_j;
    sum_g_xhat += g_j * xhat_j;
    store(dw + j, load(dw + j) + dy_j * xhat_j);
    store(db + j, load(db + j) + dy_j);
  }
  const float mean_g = horizontal_sum(sum_g) / static_cast<float>(width);
  const float mean_g_xhat = horizontal_sum(sum_g_xhat) / static_cast<float>(width);
  for (int64_t j = 0; j < width; j += kLanes) {
    const int64_t n = std::min(kLanes, width - j);
    Vec dh = (load(g + j) - mean_g - load(xhat + j) * mean_g_xhat) * rstd;
    if (dh_out != nullptr) dh += load_float(dh_out + j, n);
    if (dresidual != nullptr) store_float(dresidual + j, dh, n);
    if (dropout.active) dh *= dropout.factors(first + static_cast<uint32_t>(j));
    store_float(dx + j, dh, n);
  }
}

template <typename x_t, typename h_t>
void backward_rows(const x_t* dy, const h_t* dh_out, const h_t* h, const float* weight,
                   const float* mean, const float* rstd, x_t* dx, h_t* dresidual,
                   float* weight_partials, float* bias_partials, int64_t rows, int64_t width,
                   const DropoutStream& dropout) {
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t padded = whole_vectors(width);
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<float> scratch(4 * padded);  // g, xhat, and the block's dweight / dbias sums
    float* g = scratch.data();
    float* xhat = g + padded;
    float* dw = xhat + padded;
    float* db = dw + padded;
    for (int64_t block = block_begin; block < block_end; ++block) {
      std::fill(dw, dw + 2 * padded, 0.0f);
      const int64_t row_end = std::min(rows, (block + 1) * kRowsPerBlock);
      for (int64_t row = block * kRowsPerBlock; row < row_end; ++row) {
        const int64_t offset = row * width;
        backward_row(dy + offset, dh_out == nullptr ? nullptr : dh_out + offset, h + offset,
                     weight, mean[row], rstd[row], dx + offset,
                     dresidual == nullptr ? nullptr : dresidual + offset, dw, db, g, xhat,
                     width, dropout, static_cast<uint32_t>(offset));
      }
      std::copy(dw, dw + width, weight_partials + block * width);
      std::copy(db, db + width, bias_partials + block * width);
    }
  });
}

// Sum (blocks, width) partials over blocks, in block order.
at::Tensor sum_blocks(const at::Tensor& partials) {
  const int64_t blocks = partials.size(0), width = partials.size(1);
  if (blocks == 1) return partials.view({width});
  auto total = at::zeros({width}, partials.options());
  const float* in = partials.data_ptr<float>();
  float* out = total.data_ptr<float>();
  at::parallel_for(0, width, 256, [&](int64_t begin, int64_t end) {
    for (int64_t block = 0; block < blocks; ++block) {
      for (int64_t j = begin; j < end; ++j) out[j] += in[block * width + j];
    }
  });
  return total;
}

// Calls body(Type<x_t>{}, Type<h_t>{}) for x's dtype and h's (x's own, or float32).
template <typename Body>
void dispatch_x_h(at::ScalarType x_type, at::ScalarType h_type, Body body) {
  TORCH_CHECK(h_type == x_type || h_type == at::kFloat,
              "add_layer_norm: h must have x's dtype or float32, got ", h_type);
  dispatch_float(x_type, "add_layer_norm", [&](auto x_tag) {
    using x_t = typename decltype(x_tag)::type;
    if (h_type == at::kFloat) return body(x_tag, Type<float>{});
    return body(x_tag, Type<x_t>{});
  });
}

}  // namespace

// The dtype of h = residual + dropout(x): fp32 when asked, else the promotion of the two.
at::ScalarType h_dtype_of(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                          bool residual_in_fp32) {
  if (residual_in_fp32) return at::kFloat;
  return residual.has_value() ? at::promote_types(x.scalar_type(), residual->scalar_type())
                              : x.scalar_type();
}

namespace {

// add_layer_norm_forward's, x finished by x_scales and x_bias first when x_scales is given.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& x_in, const float* x_scales, const float* x_bias,
    const c10::optional<at::Tensor>& residual_in, const c10::optional<at::Tensor>& weight_in,
    const c10::optional<at::Tensor>& bias_in, double eps, double dropout_p,
    bool residual_in_fp32, const c10::optional<at::Tensor>& seed) {
  const auto h_dtype = h_dtype_of(x_in, residual_in, residual_in_fp32);
  const int64_t width = x_in.size(-1);
  const int64_t rows = width == 0 ? 0 : x_in.numel() / width;
  const auto x = x_in.contiguous();
  c10::optional<at::Tensor> residual;
  if (residual_in.has_value()) residual = residual_in->to(h_dtype).contiguous();
  const bool affine_as_is = affine_in_dtype(weight_in, bias_in, x.scalar_type());
  const auto weight = affine_as_is ? weight_in.value_or(at::Tensor()) : as_float(weight_in);
  const auto bias = affine_as_is ? bias_in.value_or(at::Tensor()) : as_float(bias_in);
  auto y = at::empty_like(x);
  auto h = at::empty(x.sizes(), x.options().dtype(h_dtype));
  auto mean = at::empty({rows}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const DropoutStream dropout(seed, dropout_p);
  dispatch_x_h(x.scalar_type(), h_dtype, [&](auto x_tag, auto h_tag) {
    using x_t = typename decltype(x_tag)::type;
    using h_t = typename decltype(h_tag)::type;
    const auto run = [&](auto w_tag) {
      using w_t = typename decltype(w_tag)::type;
      forward_rows<x_t, h_t, w_t>(
          x.data_ptr<x_t>(), x_scales, x_bias, residual ? residual->data_ptr<h_t>() : nullptr,
          data_or_null<w_t>(weight), data_or_null<w_t>(bias), y.data_ptr<x_t>(),
          h.data_ptr<h_t>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, width, eps,
          dropout);
    };
    affine_as_is ? run(Type<x_t>{}) : run(Type<float>{});
  });
  return {y, h, mean, rstd};
}

}  // namespace

// Returns (y, h, mean, rstd): y has x's dtype, h h_dtype_of(...), the statistics float32.
// The signature is that of fastnmt::add_layer_norm_triton, so both share their fakes.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps,
    double dropout_p, bool residual_in_fp32, const c10::optional<at::Tensor>& seed) {
  check_cpu(x, "x");
  return forward(x, nullptr, nullptr, residual, weight, bias, eps, dropout_p, residual_in_fp32,
                 seed);
}

// Inference (no autograd): (y, h) of x * x_scales[:, None] + x_bias with the residual, x an int8
// GEMM's unscaled rows (rows, N) and x_scales their scales (fastnmt/quantize.py), so that the
// GEMM's output is finished in the LayerNorm's pass over it (no scale_rows_ of its own).
std::tuple<at::Tensor, at::Tensor> add_layer_norm_unscaled(
    const at::Tensor& x, const at::Tensor& x_scales, const c10::optional<at::Tensor>& x_bias,
    const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(),
              "add_layer_norm_unscaled: x must be contiguous (rows, N)");
  TORCH_CHECK(!residual.has_value() || residual->numel() == x.numel(),
              "add_layer_norm_unscaled: residual must have x's ", x.numel(), " elements");
  const char* op = "add_layer_norm_unscaled";
  const float* scales = row_scales_data(x_scales, x.size(0), op, "x_scales");
  const float* shift = bias_data(x_bias, x.size(1), op, "x_bias");
  auto [y, h, mean, rstd] = forward(x, scales, shift, residual, weight, bias, eps, 0.0, false,
                                    c10::nullopt);
  return {y, h};
}

// Returns (dx, dresidual, dweight, dbias); dweight/dbias summed in float32 and returned in the
// weight's dtype (float32 without a weight); a gradient whose input is absent is an empty tensor
// (as fastnmt::add_layer_norm_triton_backward returns it).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& dy_in, const c10::optional<at::Tensor>& dh_out_in, const at::Tensor& h,
    const c10::optional<at::Tensor>& weight_in, const at::Tensor& mean, const at::Tensor& rstd,
    const c10::optional<at::Tensor>& seed, double dropout_p, bool has_residual, bool has_bias) {
  check_cpu(dy_in, "dy");
  const int64_t width = h.size(-1);
  const int64_t rows = width == 0 ? 0 : h.numel() / width;
  const auto dy = dy_in.contiguous();
  const auto h_c = h.contiguous();
  c10::optional<at::Tensor> dh_out;
  if (dh_out_in.has_value()) dh_out = dh_out_in->to(h.scalar_type()).contiguous();
  const auto weight = as_float(weight_in);
  auto dx = at::empty_like(dy);
  auto dresidual = has_residual ? at::empty_like(h_c) : h.new_empty({0});
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  auto weight_partials = at::empty({blocks, width}, dy.options().dtype(at::kFloat));
  auto bias_partials = at::empty({blocks, width}, dy.options().dtype(at::kFloat));
  const DropoutStream dropout(seed, dropout_p);
  dispatch_x_h(dy.scalar_type(), h.scalar_type(), [&](auto x_tag, auto h_tag) {
    using x_t = typename decltype(x_tag)::type;
    using h_t = typename decltype(h_tag)::type;
    backward_rows<x_t, h_t>(
        dy.data_ptr<x_t>(), dh_out ? dh_out->data_ptr<h_t>() : nullptr, h_c.data_ptr<h_t>(),
        float_data(weight), mean.data_ptr<float>(), rstd.data_ptr<float>(),
        dx.data_ptr<x_t>(), has_residual ? dresidual.data_ptr<h_t>() : nullptr,
        weight_partials.data_ptr<float>(), bias_partials.data_ptr<float>(), rows, width, dropout);
  });
  const auto sums_dtype = weight_in ? weight_in->scalar_type() : at::kFloat;
  const auto sum_or_empty = [&](bool wanted, const at::Tensor& partials) {
    return wanted ? sum_blocks(partials).to(sums_dtype)
                  : at::empty({0}, partials.options().dtype(sums_dtype));  // never aliased
  };
  return {dx.view(h.sizes()), dresidual, sum_or_empty(weight_in.has_value(), weight_partials),
          sum_or_empty(has_bias, bias_partials)};
}

namespace {

// Autograd in C++, so that the CPU path of a training step never enters Python: forward and
// backward call the registered ops below autograd (under torch.compile they are traced through
// their fake implementations, fastnmt/ops/layer_norm.py). The gradients are those of the Python
// autograd of the Triton ops (layer_norm.py's _make_backward). A hand-made node, as PyTorch's
// generated ones (common.h: make_node); its saved tensors are SavedVariables, so saved-tensor
// hooks (offloading, memory accounting) see them.
struct AddLayerNormBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable h, weight, mean, rstd, seed;
  double dropout_p = 0.0;
  at::ScalarType x_dtype = at::kFloat;
  bool has_residual = false;
  c10::optional<at::ScalarType> bias_dtype;  // the bias is not saved: its dtype is

  std::string name() const override { return "AddLayerNormBackward"; }

  void release_variables() override {
    for (auto* saved : {&h, &weight, &mean, &rstd, &seed}) saved->reset_data();
  }

  // grads: those of (y, h); undefined where nothing flowed back (post-norm stacks drop h).
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    static const auto op =
        registered_op<decltype(add_layer_norm_backward)>("fastnmt::add_layer_norm_cpp_backward");
    const auto h_ = h.unpack(self_pointer(this)), weight_ = weight.unpack();
    const auto mean_ = mean.unpack(), rstd_ = rstd.unpack(), seed_ = seed.unpack();
    auto dy = grads[0];
    if (!dy.defined()) dy = at::zeros_like(h_, h_.options().dtype(x_dtype));
    auto [dx, dh, dweight, dbias] =
        op.call(dy, present(grads[1]), h_, present(weight_), mean_, rstd_, present(seed_),
                dropout_p, has_residual, bias_dtype.has_value());
    return {dx, has_residual ? dh : at::Tensor(),
            weight_.defined() ? dweight : at::Tensor(),  // in the weight's dtype already
            bias_dtype ? dbias.to(*bias_dtype) : at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_autograd(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps,
    double dropout_p, bool residual_in_fp32, const c10::optional<at::Tensor>& seed) {
  static const auto op =
      registered_op<decltype(add_layer_norm_forward)>("fastnmt::add_layer_norm_cpp");
  const auto residual_ = residual.value_or(at::Tensor()), weight_ = weight.value_or(at::Tensor());
  const auto bias_ = bias.value_or(at::Tensor());
  auto out = call_below_autograd(op, x, residual, weight, bias, eps, dropout_p,
                                 residual_in_fp32, seed);
  if (!torch::autograd::compute_requires_grad(x, residual_, weight_, bias_)) return out;
  auto& [y, h, mean, rstd] = out;
  auto& backward = record_node<AddLayerNormBackward>({y, h}, x, residual_, weight_, bias_);
  backward.h = torch::autograd::SavedVariable(h, true);
  backward.weight = torch::autograd::SavedVariable(weight_, false);
  backward.mean = torch::autograd::SavedVariable(mean, false);  // not differentiable
  backward.rstd = torch::autograd::SavedVariable(rstd, false);
  backward.seed = torch::autograd::SavedVariable(seed.value_or(at::Tensor()), false);
  backward.dropout_p = dropout_p;
  backward.x_dtype = x.scalar_type();
  backward.has_residual = residual.has_value();
  if (bias) backward.bias_dtype = bias->scalar_type();
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastnmt, m) {
  m.def(
      "add_layer_norm_cpp(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, "
      "float dropout_p, bool residual_in_fp32, Tensor? seed) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "add_layer_norm_unscaled_cpp(Tensor x, Tensor x_scales, Tensor? x_bias, Tensor? residual, "
      "Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor)");
  m.def(
      "add_layer_norm_cpp_backward(Tensor dy, Tensor? dh_out, Tensor h, Tensor? weight, "
      "Tensor mean, Tensor rstd, Tensor? seed, float dropout_p, bool has_residual, bool has_bias) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastnmt, CPU, m) {
  m.impl("add_layer_norm_cpp", &add_layer_norm_forward);
  m.impl("add_layer_norm_unscaled_cpp", &add_layer_norm_unscaled);
  m.impl("add_layer_norm_cpp_backward", &add_layer_norm_backward);
}

TORCH_LIBRARY_IMPL(fastnmt, Autograd, m) {
  m.impl("add_layer_norm_cpp", &add_layer_norm_autograd);
}

}  // namespace fastnmt
