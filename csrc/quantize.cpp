// The activations of an int8 GEMM (fastnmt/quantize.py), quantized at every call: x (rows, K),
// fp32 or bf16, to uint8 over [min(x, 0), max(x, 0)] with one scale and zero point for the whole
// tensor (dynamic quantization, as fbgemm's and CTranslate2's int8 GEMMs do):
//
//   scale = (hi - lo) / q_max,  zero_point = round(-lo / scale),
//   q = clamp(round(x / scale) + zero_point, 0, q_max)
//
// q_max is 255, or 127 where the CPU's u8 x s8 multiply-add saturates 8-bit products (see
// quantize.py). Values round half up (after the shift, where they are >= 0). Two vectorised
// passes over x: the range, then the values; the zero point keeps 0.0 exact (padding, ReLU).
// q has `padded_rows` rows (>= rows), those past x's left unset: the GEMM's output rows for
// them are never read.
#include "common.h"
#include "vec.h"

#include <cmath>
#include <tuple>
#include <vector>

namespace fastnmt {
namespace {

constexpr int64_t kGrain = 1 << 14;  // values per parallel chunk
typedef uint8_t ByteVec __attribute__((vector_size(kLanes)));

template <typename T>
std::pair<float, float> value_range(const T* x, int64_t n) {
  const int threads = at::get_num_threads();
  std::vector<float> lows(threads, 0.0f), highs(threads, 0.0f);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    Vec low{}, high{};  // 0 is in every range
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      const Vec v = load_float(x + i);
      low = v < low ? v : low;
      high = v > high ? v : high;
    }
    float lo = -horizontal_max(-low), hi = horizontal_max(high);
    for (; i < end; ++i) {
      const float v = static_cast<float>(x[i]);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    const int t = at::get_thread_num();
    lows[t] = std::min(lows[t], lo);
    highs[t] = std::max(highs[t], hi);
  });
  return {*std::min_element(lows.begin(), lows.end()),
          *std::max_element(highs.begin(), highs.end())};
}

template <typename T>
void quantize_values(const T* x, int64_t n, float inverse_scale, float zero_point, float q_max,
                     uint8_t* q) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      Vec v = load_float(x + i) * inverse_scale + (zero_point + 0.5f);
      v = v < 0.0f ? splat(0.0f) : v;
      v = v > q_max ? splat(q_max) : v;
      // Truncation rounds (v >= 0); the narrowing to bytes is one instruction with AVX-512.
      const ByteVec bytes = __builtin_convertvector(__builtin_convertvector(v, IntVec), ByteVec);
      __builtin_memcpy(q + i, &bytes, sizeof bytes);
    }
    for (; i < end; ++i) {
      const float v = static_cast<float>(x[i]) * inverse_scale + (zero_point + 0.5f);
      q[i] = static_cast<uint8_t>(std::clamp(v, 0.0f, q_max));
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x_,
                                                                     int64_t padded_rows,
                                                                     bool reduce_range) {
  TORCH_CHECK(x_.dim() == 2, "quantize_activations: x must be (rows, K), got ", x_.dim(), " dims");
  TORCH_CHECK(x_.scalar_type() == at::kFloat || x_.scalar_type() == at::kBFloat16,
              "quantize_activations: x must be float32 or bfloat16, got ", x_.scalar_type());
  TORCH_CHECK(padded_rows >= x_.size(0), "quantize_activations: padded_rows must be >= ",
              x_.size(0), ", got ", padded_rows);
  const auto x = x_.contiguous();
  const int64_t n = x.numel();
  const float q_max = reduce_range ? 127.0f : 255.0f;
  auto q = at::empty({padded_rows, x.size(1)}, x.options().dtype(at::kByte));
  float lo = 0.0f, hi = 0.0f;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_activations", [&] {
    std::tie(lo, hi) = value_range(x.data_ptr<scalar_t>(), n);
  });
  float scale = (hi - lo) / q_max;
  if (!(scale > 0.0f) || !std::isfinite(scale)) scale = 1.0f;  // all zeros (or not finite)
  const float zero_point = std::clamp(std::nearbyint(-lo / scale), 0.0f, q_max);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_activations", [&] {
    quantize_values(x.data_ptr<scalar_t>(), n, 1.0f / scale, zero_point, q_max,
                    q.data_ptr<uint8_t>());
  });
  const auto scalars = x.options().dtype(at::kFloat);
  return {q, at::scalar_tensor(scale, scalars),
          at::scalar_tensor(static_cast<int64_t>(zero_point), scalars.dtype(at::kLong))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastnmt, m) {
  m.def(
      "quantize_activations(Tensor x, int padded_rows, bool reduce_range) -> (Tensor, Tensor, "
      "Tensor)");
}

TORCH_LIBRARY_IMPL(fastnmt, CPU, m) { m.impl("quantize_activations", quantize_activations); }

}  // namespace fastnmt
