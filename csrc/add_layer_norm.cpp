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

// Affine parameters as fp32 vectors (ones/zeros when absent).
at::Tensor as_float_or(const c10::optional<at::Tensor>& t, int64_t width, float fill) {
  if (t.has_value()) return t->to(at::kFloat).contiguous();
  return at::full({width}, fill, at::kFloat);
}

template <typename x_t, typename h_t>
void forward_rows(const x_t* x, const h_t* residual, const float* weight, const float* bias,
                  x_t* y, h_t* h, float* mean_out, float* rstd_out, int64_t rows,
                  int64_t width, double eps, const DropoutStream& dropout) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const x_t* x_row = x + row * width;
      h_t* h_row = h + row * width;
      const uint32_t first = static_cast<uint32_t>(row * width);
      float sum = 0.0f;
      for (int64_t j = 0; j < width; ++j) {
        float value = to_float(x_row[j]);
        if (dropout.active) value *= dropout.factor(first + static_cast<uint32_t>(j));
        if (residual != nullptr) value += to_float(residual[row * width + j]);
        const h_t stored = static_cast<h_t>(value);  // statistics of h as stored
        h_row[j] = stored;
        sum += to_float(stored);
      }
      const float mean = sum / static_cast<float>(width);
      float squares = 0.0f;
      for (int64_t j = 0; j < width; ++j) {
        const float centered = to_float(h_row[j]) - mean;
        squares += centered * centered;
      }
      const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
      x_t* y_row = y + row * width;
      for (int64_t j = 0; j < width; ++j) {
        y_row[j] = static_cast<x_t>((to_float(h_row[j]) - mean) * rstd * weight[j] + bias[j]);
      }
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  });
}

template <typename x_t, typename h_t>
void backward_rows(const x_t* dy, const h_t* dh_out, const h_t* h, const float* weight,
                   const float* mean, const float* rstd, x_t* dx, h_t* dresidual,
                   float* weight_partials, float* bias_partials, int64_t rows, int64_t width,
                   const DropoutStream& dropout) {
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<float> g(width);
    for (int64_t block = block_begin; block < block_end; ++block) {
      float* dw = weight_partials + block * width;
      float* db = bias_partials + block * width;
      std::fill(dw, dw + width, 0.0f);
      std::fill(db, db + width, 0.0f);
      const int64_t row_end = std::min(rows, (block + 1) * kRowsPerBlock);
      for (int64_t row = block * kRowsPerBlock; row < row_end; ++row) {
        const int64_t offset = row * width;
        float mean_g = 0.0f, mean_g_xhat = 0.0f;
        for (int64_t j = 0; j < width; ++j) {
          const float dy_j = to_float(dy[offset + j]);
          const float xhat = (to_float(h[offset + j]) - mean[row]) * rstd[row];
          g[j] = dy_j * weight[j];
          mean_g += g[j];
          mean_g_xhat += g[j] * xhat;
          dw[j] += dy_j * xhat;
          db[j] += dy_j;
        }
        mean_g /= static_cast<float>(width);
        mean_g_xhat /= static_cast<float>(width);
        const uint32_t first = static_cast<uint32_t>(offset);
        for (int64_t j = 0; j < width; ++j) {
          const float xhat = (to_float(h[offset + j]) - mean[row]) * rstd[row];
          float dh = rstd[row] * (g[j] - mean_g - xhat * mean_g_xhat);
          if (dh_out != nullptr) dh += to_float(dh_out[offset + j]);
          if (dresidual != nullptr) dresidual[offset + j] = static_cast<h_t>(dh);
          if (dropout.active) dh *= dropout.factor(first + static_cast<uint32_t>(j));
          dx[offset + j] = static_cast<x_t>(dh);
        }
      }
    }
  });
}

// Sum (blocks, width) partials over blocks, in block order.
at::Tensor sum_blocks(const at::Tensor& partials) {
  const int64_t blocks = partials.size(0), width = partials.size(1);
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

// Returns (y, h, mean, rstd): y has x's dtype, h h_dtype_of(...), the statistics float32.
// The signature is that of fastnmt::add_layer_norm_triton, so both share their Python autograd.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& residual_in,
    const c10::optional<at::Tensor>& weight_in, const c10::optional<at::Tensor>& bias_in,
    double eps, double dropout_p, bool residual_in_fp32, const c10::optional<at::Tensor>& seed) {
  check_cpu(x_in, "x");
  const auto h_dtype = h_dtype_of(x_in, residual_in, residual_in_fp32);
  const int64_t width = x_in.size(-1);
  const int64_t rows = width == 0 ? 0 : x_in.numel() / width;
  const auto x = x_in.contiguous();
  c10::optional<at::Tensor> residual;
  if (residual_in.has_value()) residual = residual_in->to(h_dtype).contiguous();
  const auto weight = as_float_or(weight_in, width, 1.0f);
  const auto bias = as_float_or(bias_in, width, 0.0f);
  auto y = at::empty_like(x);
  auto h = at::empty(x.sizes(), x.options().dtype(h_dtype));
  auto mean = at::empty({rows}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const DropoutStream dropout(seed, dropout_p);
  dispatch_x_h(x.scalar_type(), h_dtype, [&](auto x_tag, auto h_tag) {
    using x_t = typename decltype(x_tag)::type;
    using h_t = typename decltype(h_tag)::type;
    forward_rows<x_t, h_t>(
        x.data_ptr<x_t>(), residual ? residual->data_ptr<h_t>() : nullptr,
        weight.data_ptr<float>(), bias.data_ptr<float>(), y.data_ptr<x_t>(), h.data_ptr<h_t>(),
        mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, width, eps, dropout);
  });
  return {y, h, mean, rstd};
}

// Returns (dx, dresidual, dweight, dbias); dweight/dbias in float32; a gradient whose input is
// absent is an empty tensor (as fastnmt::add_layer_norm_triton_backward returns it).
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
  const auto weight = as_float_or(weight_in, width, 1.0f);
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
        weight.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
        dx.data_ptr<x_t>(), has_residual ? dresidual.data_ptr<h_t>() : nullptr,
        weight_partials.data_ptr<float>(), bias_partials.data_ptr<float>(), rows, width, dropout);
  });
  const auto sum_or_empty = [&](bool wanted, const at::Tensor& partials) {
    return wanted ? sum_blocks(partials) : at::empty({0}, partials.options());  // never aliased
  };
  return {dx.view(h.sizes()), dresidual, sum_or_empty(weight_in.has_value(), weight_partials),
          sum_or_empty(has_bias, bias_partials)};
}

TORCH_LIBRARY_FRAGMENT(fastnmt, m) {
  m.def(
      "add_layer_norm_cpp(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, "
      "float dropout_p, bool residual_in_fp32, Tensor? seed) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "add_layer_norm_cpp_backward(Tensor dy, Tensor? dh_out, Tensor h, Tensor? weight, "
      "Tensor mean, Tensor rstd, Tensor? seed, float dropout_p, bool has_residual, bool has_bias) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastnmt, CPU, m) {
  m.impl("add_layer_norm_cpp", &add_layer_norm_forward);
  m.impl("add_layer_norm_cpp_backward", &add_layer_norm_backward);
}

}  // namespace fastnmt
