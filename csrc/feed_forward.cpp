// Position-wise feed-forward block around library GEMMs (see fastnmt/ops/feed_forward.py for
// the math): y = act(x W1^T + b1) * keep / (1 - p) W2^T + b2.
//
// The GEMMs (with their bias) are at::addmm (oneDNN / MKL). What is fused is everything between
// them: activation and dropout in one pass over the hidden activations forward, and their
// derivative in one pass backward. The dropout mask is never stored: it is regenerated from the
// seed. Saved for backward: ReLU saves only z = relu(a) * keep * scale (needed for dW2 anyway;
// z > 0 exactly where the gradient flows); GELU and SiLU also save the pre-activation a, which
// their derivatives need and z does not determine.
#include "common.h"

#include <cmath>

namespace fastnmt {
namespace {

enum Activation : int64_t { kRelu = 0, kGelu = 1, kSilu = 2 };

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

inline float gelu(float a) { return 0.5f * a * (1.0f + std::erf(a * kInvSqrt2)); }

inline float gelu_derivative(float a) {
  const float cdf = 0.5f * (1.0f + std::erf(a * kInvSqrt2));
  return cdf + a * kInvSqrt2Pi * std::exp(-0.5f * a * a);
}

// GELU and its derivative lane by lane (std::erf has no vector form here).
inline Vec gelu(Vec a) {
  for (int l = 0; l < kLanes; ++l) a[l] = gelu(a[l]);
  return a;
}

inline Vec gelu_derivative(Vec a) {
  for (int l = 0; l < kLanes; ++l) a[l] = gelu_derivative(a[l]);
  return a;
}

// SiLU a s(a), s = sigmoid, and its derivative s (1 + a (1 - s)): whole vectors, as vec.h has an
// exp. vector_exp clamps its argument, so s stops at ~6e-39 for a < -88 instead of reaching 0:
// below anything a feed-forward layer's output can resolve.
inline Vec sigmoid(Vec a) { return 1.0f / (1.0f + vector_exp(-a)); }

inline Vec silu(Vec a) { return a * sigmoid(a); }

inline Vec silu_derivative(Vec a) {
  const Vec s = sigmoid(a);
  return s * (1.0f + a * (1.0f - s));
}

inline Vec activation(Vec a, Activation act) {
  if (act == kRelu) return a < 0.0f ? Vec{} : a;
  return act == kGelu ? gelu(a) : silu(a);
}

// act'(a) of the activations whose backward reads a (ReLU's reads z instead).
inline Vec activation_derivative(Vec a, Activation act) {
  return act == kGelu ? gelu_derivative(a) : silu_derivative(a);
}

// z = act(a) * dropout factor, a vector at a time (in place when z aliases a).
template <typename T>
void activation_dropout(const T* a, T* z, int64_t n, Activation act, const DropoutStream& drop) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; e += kLanes) {
      const int64_t lanes = std::min(kLanes, end - e);
      const Vec value = load_float(a + e, lanes);
      Vec out = activation(value, act);
      if (drop.active) out *= drop.factors(static_cast<uint32_t>(e));
      store_float(z + e, out, lanes);
    }
  });
}

// da = dz * dropout factor * act'(a), from what the forward saved (ReLU: z; GELU, SiLU: a).
template <typename T>
void activation_dropout_backward(const T* dz, const T* saved, T* da, int64_t n, Activation act,
                                 const DropoutStream& drop) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; e += kLanes) {
      const int64_t lanes = std::min(kLanes, end - e);
      const Vec grad = load_float(dz + e, lanes);
      const Vec saved_value = load_float(saved + e, lanes);
      Vec out;
      if (act == kRelu) {
        out = saved_value > 0.0f ? grad * drop.scale : Vec{};  // z > 0: kept and a > 0
      } else {
        out = grad * activation_derivative(saved_value, act);
        if (drop.active) out *= drop.factors(static_cast<uint32_t>(e));
      }
      store_float(da + e, out, lanes);
    }
  });
}

at::Tensor affine(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  return b.has_value() ? at::addmm(*b, x, w.t()) : at::mm(x, w.t());
}

}  // namespace

Activation parse_activation(c10::string_view name) {
  if (name == "relu") return kRelu;
  if (name == "gelu") return kGelu;
  TORCH_CHECK(name == "silu", "feed_forward: activation must be relu, gelu or silu, got ", name);
  return kSilu;
}

// Returns (y (..., N), z (M, F), a (M, F) for GELU and SiLU, else empty): the signature of
// fastnmt::feed_forward_triton without its GEMM-path flag, so both share their fakes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> feed_forward_forward(
    const at::Tensor& x_in, const at::Tensor& w1, const c10::optional<at::Tensor>& b1,
    const at::Tensor& w2, const c10::optional<at::Tensor>& b2, c10::string_view activation,
    double dropout_p, const c10::optional<at::Tensor>& seed) {
  check_cpu(x_in, "x");
  const auto act = parse_activation(activation);
  const DropoutStream drop(seed, dropout_p);
  const auto x = x_in.reshape({-1, x_in.size(-1)});
  auto a = affine(x, w1, b1);  // (M, F)
  auto z = act == kRelu ? a : at::empty_like(a);  // ReLU: in place, a is not kept
  dispatch_float(a.scalar_type(), "feed_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    activation_dropout<T>(a.data_ptr<T>(), z.data_ptr<T>(), a.numel(), act, drop);
  });
  auto sizes = x_in.sizes().vec();
  sizes.back() = w2.size(0);
  auto y = affine(z, w2, b2).view(sizes);  // (..., N)
  return {y, z, act == kRelu ? a.new_empty({0}) : a};
}

// Returns (dx, dw1, db1, dw2, db2).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> feed_forward_backward(
    const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& z, const at::Tensor& a, const c10::optional<at::Tensor>& seed,
    c10::string_view activation, double dropout_p) {
  check_cpu(dy_in, "dy");
  const auto act = parse_activation(activation);
  const DropoutStream drop(seed, dropout_p);
  const auto dy = dy_in.reshape({-1, dy_in.size(-1)});
  const auto x = x_in.reshape({-1, x_in.size(-1)});
  auto dw2 = at::mm(dy.t(), z);  // (N, F)
  auto db2 = dy.sum(0);
  auto da = at::mm(dy, w2);  // dz (M, F), turned into da in place
  const auto& saved = act == kRelu ? z : a;  // ReLU: z > 0 exactly where the gradient flows
  dispatch_float(da.scalar_type(), "feed_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    activation_dropout_backward<T>(da.data_ptr<T>(), saved.data_ptr<T>(), da.data_ptr<T>(),
                                   da.numel(), act, drop);
  });
  auto dw1 = at::mm(da.t(), x);  // (F, K)
  auto db1 = da.sum(0);
  auto dx = at::mm(da, w1).view(x_in.sizes());  // (..., K)
  return {dx, dw1, db1, dw2, db2};
}

namespace {

// Autograd in C++ (see add_layer_norm.cpp): the gradients of feed_forward.py's _make_backward.
// A hand-made autograd node (common.h: make_node); z and a are outputs autograd does not see.
struct FeedForwardBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable x, w1, w2, z, a, seed;
  std::string activation;
  double dropout_p = 0.0;
  bool has_b1 = false, has_b2 = false;

  std::string name() const override { return "FeedForwardBackward"; }

  void release_variables() override {
    for (auto* saved : {&x, &w1, &w2, &z, &a, &seed}) saved->reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return torch::autograd::variable_list(5);  // y was not used
    static const auto op =
        registered_op<decltype(feed_forward_backward)>("fastnmt::feed_forward_cpp_backward");
    auto [dx, dw1, db1, dw2, db2] =
        op.call(grads[0], x.unpack(), w1.unpack(), w2.unpack(), z.unpack(), a.unpack(),
                present(seed.unpack()), activation, dropout_p);
    return {dx, dw1, has_b1 ? db1 : at::Tensor(), dw2, has_b2 ? db2 : at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> feed_forward_autograd(
    const at::Tensor& x, const at::Tensor& w1, const c10::optional<at::Tensor>& b1,
    const at::Tensor& w2, const c10::optional<at::Tensor>& b2, c10::string_view activation,
    double dropout_p, const c10::optional<at::Tensor>& seed) {
  static const auto op =
      registered_op<decltype(feed_forward_forward)>("fastnmt::feed_forward_cpp");
  const auto b1_ = b1.value_or(at::Tensor()), b2_ = b2.value_or(at::Tensor());
  auto out = call_below_autograd(op, x, w1, b1, w2, b2, activation, dropout_p, seed);
  if (!torch::autograd::compute_requires_grad(x, w1, b1_, w2, b2_)) return out;
  auto& [y, z, a] = out;
  auto& backward = record_node<FeedForwardBackward>({y}, x, w1, b1_, w2, b2_);
  backward.x = torch::autograd::SavedVariable(x, false);
  backward.w1 = torch::autograd::SavedVariable(w1, false);
  backward.w2 = torch::autograd::SavedVariable(w2, false);
  backward.z = torch::autograd::SavedVariable(z, false);  // not differentiable: no grad_fn
  backward.a = torch::autograd::SavedVariable(a, false);
  backward.seed = torch::autograd::SavedVariable(seed.value_or(at::Tensor()), false);
  backward.activation = std::string(activation);
  backward.dropout_p = dropout_p;
  backward.has_b1 = b1.has_value();
  backward.has_b2 = b2.has_value();
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastnmt, m) {
  m.def(
      "feed_forward_cpp(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, "
      "float dropout_p, Tensor? seed) -> (Tensor, Tensor, Tensor)");
  m.def(
      "feed_forward_cpp_backward(Tensor dy, Tensor x, Tensor w1, Tensor w2, Tensor z, Tensor a, "
      "Tensor? seed, str activation, float dropout_p) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastnmt, CPU, m) {
  m.impl("feed_forward_cpp", &feed_forward_forward);
  m.impl("feed_forward_cpp_backward", &feed_forward_backward);
}

TORCH_LIBRARY_IMPL(fastnmt, Autograd, m) { m.impl("feed_forward_cpp", &feed_forward_autograd); }

}  // namespace fastnmt
