// Shared pieces of fastnmt's C++ CPU kernels: the counter-based dropout stream, float
// conversions, and argument checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace fastnmt {

// Dropout keep decisions are a pure function of (seed, element index): the backward pass
// regenerates the forward's mask exactly, whatever the thread count or loop order. The hash is
// Chris Wellons' "lowbias32" (two multiply-xorshift rounds), cheap enough to vectorise with
// 32-bit integer lanes; the seed's two halves are folded into a per-call base value.
// Word: uint32_t, or WordVec for a vector of values at once.
template <typename Word>
inline Word lowbias32(Word x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

struct DropoutStream {
  uint32_t base = 0;        // mixed seed
  uint32_t threshold = 0;   // an element is kept when its hash >= threshold, i.e. with prob 1-p
  float scale = 1.0f;       // 1 / (1 - p)
  bool active = false;

  // seed: int64 (2,) = (seed, offset) drawn from torch's generator (fastnmt/ops/triton_common.py's
  // dropout_seed), so torch.manual_seed makes runs reproducible.
  DropoutStream(const c10::optional<at::Tensor>& seed, double p) {
    active = p > 0.0;
    if (!active) return;
    TORCH_CHECK(seed.has_value() && seed->scalar_type() == at::kLong && seed->numel() == 2,
                "dropout needs a seed: an int64 tensor of 2 elements");
    const auto* values = seed->contiguous().data_ptr<int64_t>();
    uint32_t mixed = 0x9e3779b9U;
    for (int i = 0; i < 2; ++i) {
      const auto v = static_cast<uint64_t>(values[i]);
      mixed = lowbias32(mixed ^ static_cast<uint32_t>(v));
      mixed = lowbias32(mixed ^ static_cast<uint32_t>(v >> 32));
    }
    base = mixed;
    threshold = static_cast<uint32_t>(p * 4294967296.0);
    scale = static_cast<float>(1.0 / (1.0 - p));
  }

  // The factor element `index` is multiplied by: 0 (dropped) or 1 / (1 - p).
  inline float factor(uint32_t index) const {
    return lowbias32(base ^ index) >= threshold ? scale : 0.0f;
  }

  // The factors of elements first, first + 1, ..., first + 15 (indices wrap modulo 2^32).
  inline Vec factors(uint32_t first) const {
    const WordVec hash = lowbias32((word_lane_indices() + first) ^ base);
    return hash >= threshold ? splat(scale) : Vec{};
  }
};

template <typename T>
inline float to_float(T value) { return static_cast<float>(value); }

// A dtype passed to generic lambdas: body(Type<float>{}) and `using T = typename
// decltype(tag)::type;` inside (C++17, the standard torch extensions are built with).
template <typename T>
struct Type {
  using type = T;
};

// Calls body(Type<T>{}) for the floating dtypes the kernels support.
template <typename Body>
void dispatch_float(at::ScalarType type, const char* op, Body body) {
  switch (type) {
    case at::kFloat: return body(Type<float>{});
    case at::kBFloat16: return body(Type<c10::BFloat16>{});
    case at::kHalf: return body(Type<c10::Half>{});
    default: TORCH_CHECK(false, op, ": unsupported dtype ", type);
  }
}

// The registered op `name` ("fastnmt::..."), called through the dispatcher: the C++ autograd
// functions call their ops so, below autograd, which torch.compile then traces through the ops'
// fake implementations.
template <typename Signature>
c10::TypedOperatorHandle<Signature> registered_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// An optional argument from a saved or incoming gradient tensor (undefined: absent).
inline c10::optional<at::Tensor> present(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// Autograd nodes written by hand, as PyTorch's generated ones are: torch::autograd::Function
// costs about 6 us more per forward + backward on a CPU (a one-input op: 36.5 against 30.0 us),
// which is a good share of a small op's call. PyTorch 2.13 holds nodes in c10::intrusive_ptr,
// earlier versions in std::shared_ptr; these helpers build for both.
using NodePtr = decltype(torch::autograd::Edge::function);
constexpr bool kSharedNodes = std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;

template <typename T>
NodePtr make_node() {
  if constexpr (kSharedNodes) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

// A pointer to `node` itself, what unpacking a saved output of its own needs.
template <typename T>
NodePtr self_pointer(T* node) {
  if constexpr (kSharedNodes) {
    return node->shared_from_this();
  } else {
    return c10::intrusive_ptr<T>::reclaim_copy(node);  // a type of T's: built only where used
  }
}

// A registered op called below autograd (the autograd kernels record their own node).
template <typename Op, typename... Args>
auto call_below_autograd(const Op& op, const Args&... args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(args...);
}

// A new node of type T recording a call: its differentiable `outputs` come from `inputs`
// (undefined tensors: absent ones). The outputs hold the node; the caller fills in what it saves.
template <typename T, typename... Inputs>
T& record_node(std::initializer_list<at::Tensor> outputs, const Inputs&... inputs) {
  const auto node = make_node<T>();
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  for (const auto& output : outputs) torch::autograd::set_history(output, node);
  return static_cast<T&>(*node);
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
}

// The data of `scales`, one float32 per row of `rows` (an int8 GEMM's row scales,
// fastnmt/quantize.py), checked.
inline const float* row_scales_data(const at::Tensor& scales, int64_t rows, const char* op,
                                    const char* name) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
                  scales.size(0) == rows && scales.is_contiguous(),
              op, ": ", name, " must be contiguous float32 (", rows, ",)");
  return scales.data_ptr<float>();
}

// A float32 (n,) bias's data (an int8 GEMM's, added after its row scales), checked; nullptr
// for none.
inline const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t n, const char* op,
                              const char* name) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n &&
                  bias->is_contiguous(),
              op, ": ", name, " must be contiguous float32 (", n, ",)");
  return bias->data_ptr<float>();
}

}  // namespace fastnmt
