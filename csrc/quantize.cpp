// The activations of an int8 GEMM (fastnmt/quantize.py), quantized at every call, each row on its
// own (symmetric, per row: CTranslate2's scheme), so that a row's result never depends on the
// other rows of its batch. x (rows, K), fp32 or bf16, to uint8 around a fixed zero point z:
//
//   scale[m] = max_k |x[m, k]| / h,   q[m, k] = round(x[m, k] / scale[m]) + z,
//
// with (h, z) = (127, 128), or (63, 64) where the CPU's u8 x s8 multiply-add saturates 8-bit
// products (see quantize.py). The GEMM, given scale 1 and zero point z, computes
// s_w[n] sum_k (q[m, k] - z) Q_w[n, k]; `scale_rows_` then multiplies each output row by its
// scale[m] and adds the bias (and applies ReLU) in place, or the next GEMM's `quantize_rows`
// does so on the fly (x_scales, x_bias, relu: the feed-forward block's hidden layer is never
// written finished).
//
// One pass over each row's values for its maximum, one to quantize them (the row is in L1 by
// then). Values round half up (after the shift, where they are >= 0); 0.0 is exactly z. q has
// `padded_rows` rows (>= rows), those past x's left unset: the GEMM's output rows for them are
// never read. With `as_float`, q holds q - z in float32 instead (integers in [-h, h]): the input
// of a GEMM that quantizes float activations itself (fbgemm's, given scale 1 and zero point z,
// which then reproduces these bytes exactly).
#include "common.h"
#include "vec.h"

#include <cmath>
#include <tuple>
#include <type_traits>

namespace fastnmt {
namespace {

constexpr int64_t kGrain = 1 << 14;  // values per parallel chunk
typedef uint8_t ByteVec __attribute__((vector_size(kLanes)));

// Rows per parallel chunk for rows of `width` values.
int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1));
}

// A row of a GEMM's input as its values: x itself (kUnscaled false), or a previous int8 GEMM's
// unscaled output turned into that GEMM's result on the fly, act(x[k] scale + bias[k]) (its
// `scale_rows_`, fused). The choices are template arguments: branches in the vector loop cost
// the fused quantizer a third of its time.
template <typename T, bool kUnscaled, bool kBias, bool kRelu>
struct InputRow {
  const T* x;
  float scale;
  const float* bias;

  inline Vec values(int64_t k, int64_t lanes) const {
    Vec v = load_float(x + k, lanes);
    if constexpr (kUnscaled) v *= scale;
    if constexpr (kBias) v += load_float(bias + k, lanes);
    if constexpr (kRelu) v = v < 0.0f ? Vec{} : v;
    return v;
  }
};

// body(m, row) for each row m in [begin, end) of x (width values each), as an InputRow of the
// transform the arguments ask for.
template <typename T, typename Body>
void for_input_rows(const T* x, int64_t width, const float* scale, const float* bias, bool relu,
                    int64_t begin, int64_t end, Body body) {
  auto each = [&](auto unscaled, auto biased, auto rectified) {
    using Row = InputRow<T, decltype(unscaled)::value, decltype(biased)::value,
                         decltype(rectified)::value>;
    for (int64_t m = begin; m < end; ++m) {
      body(m, Row{x + m * width, scale == nullptr ? 1.0f : scale[m], bias});
    }
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (scale == nullptr) return each(No{}, No{}, No{});
  if (bias == nullptr) return relu ? each(Yes{}, No{}, Yes{}) : each(Yes{}, No{}, No{});
  return relu ? each(Yes{}, Yes{}, Yes{}) : each(Yes{}, Yes{}, No{});
}

// Independent maxima in the first pass: one alone waits out each max's latency at every vector.
constexpr int kChains = 4;

// The maxima of |x| of a bf16 row as it is, into `high`, over its whole blocks of kChains / 2
// loads (load_pairs: a maximum's order is free; no widening shuffle per vector as load_float's,
// the shuffle port having bound the quantizer's first pass). Returns the elements done.
inline int64_t bf16_pair_maxima(const c10::BFloat16* x, int64_t width, Vec* high) {
  constexpr int64_t kBlock = kChains * kLanes;  // elements per block: kChains / 2 loads
  int64_t k = 0;
  for (; k + kBlock <= width; k += kBlock) {
    for (int c = 0; c < kChains; c += 2) {
      Vec even, odd;
      load_pairs(x + k + c * kLanes, even, odd);
      even = even < 0.0f ? -even : even;
      odd = odd < 0.0f ? -odd : odd;
      high[c] = even > high[c] ? even : high[c];
      high[c + 1] = odd > high[c + 1] ? odd : high[c + 1];
    }
  }
  return k;
}

template <typename Row>
float row_abs_max(const Row& row, int64_t width) {
  Vec high[kChains] = {};
  int64_t k = 0;
  if constexpr (std::is_same_v<Row, InputRow<c10::BFloat16, false, false, false>>) {
    k = bf16_pair_maxima(row.x, width, high);
  }
  for (; k + kChains * kLanes <= width; k += kChains * kLanes) {
    for (int c = 0; c < kChains; ++c) {
      const Vec v = row.values(k + c * kLanes, kLanes);
      const Vec a = v < 0.0f ? -v : v;
      high[c] = a > high[c] ? a : high[c];
    }
  }
  for (; k < width; k += kLanes) {
    const Vec v = row.values(k, std::min(kLanes, width - k));  // lanes past the row are 0
    const Vec a = v < 0.0f ? -v : v;
    high[0] = a > high[0] ? a : high[0];
  }
  static_assert(kChains == 4, "the chains are combined as a tree of four");
  const Vec a = high[0] > high[1] ? high[0] : high[1], b = high[2] > high[3] ? high[2] : high[3];
  return horizontal_max(a > b ? a : b);
}

// q = round(v / scale) + z with |v| <= max |v| = h scale: within [1, 2h + 1], no clamping; as
// bytes (Out uint8_t), or q - z as floats (Out float).
template <typename Out, typename Row>
void quantize_row(const Row& row, int64_t width, float inverse_scale, float zero_point, Out* q);

// quantize_row of a bf16 row as it is into bytes, two vectors of values per load (load_pairs):
// the even elements' bytes and the odd ones' joined in 16-bit lanes, narrowed in one instruction
// (one shuffle per 32 values, where widening and narrowing each vector took four); the tail as
// quantize_row does it.
inline void quantize_bf16_row(const c10::BFloat16* x, int64_t width, float inverse_scale,
                              float zero_point, uint8_t* q) {
  constexpr int64_t kStep = 2 * kLanes;  // elements per load
  const float offset = zero_point + 0.5f;
  int64_t k = 0;
  for (; k + kStep <= width; k += kStep) {
    Vec even, odd;
    load_pairs(x + k, even, odd);
    const IntVec even_q = __builtin_convertvector(even * inverse_scale + offset, IntVec);
    const IntVec odd_q = __builtin_convertvector(odd * inverse_scale + offset, IntVec);
    const HalfWordVec pairs = __builtin_convertvector(even_q | odd_q << 8, HalfWordVec);
    __builtin_memcpy(q + k, &pairs, sizeof pairs);
  }
  if (k < width) {
    const InputRow<c10::BFloat16, false, false, false> tail{x + k, 1.0f, nullptr};
    quantize_row(tail, width - k, inverse_scale, zero_point, q + k);
  }
}

template <typename Out, typename Row>
void quantize_row(const Row& row, int64_t width, float inverse_scale, float zero_point, Out* q) {
  if constexpr (std::is_same_v<Row, InputRow<c10::BFloat16, false, false, false>> &&
                std::is_same_v<Out, uint8_t>) {
    if (width >= 2 * kLanes) return quantize_bf16_row(row.x, width, inverse_scale, zero_point, q);
  }
  for (int64_t k = 0; k < width; k += kLanes) {
    const int64_t lanes = std::min(kLanes, width - k);
    const Vec v = row.values(k, lanes) * inverse_scale + (zero_point + 0.5f);
    const IntVec rounded = __builtin_convertvector(v, IntVec);  // truncation rounds: v >= 0
    if constexpr (std::is_same_v<Out, float>) {
      store_float(q + k, __builtin_convertvector(rounded, Vec) - zero_point, lanes);
    } else {  // the narrowing to bytes is one instruction with AVX-512
      const ByteVec bytes = __builtin_convertvector(rounded, ByteVec);
      if (lanes == kLanes) {
        __builtin_memcpy(q + k, &bytes, sizeof bytes);
      } else {
        for (int64_t l = 0; l < lanes; ++l) q[k + l] = bytes[l];
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_, int64_t padded_rows,
                                                 bool reduce_range,
                                                 const c10::optional<at::Tensor>& x_scales,
                                                 const c10::optional<at::Tensor>& x_bias,
                                                 bool relu, bool as_float) {
  TORCH_CHECK(x_.dim() == 2, "quantize_rows: x must be (rows, K), got ", x_.dim(), " dims");
  TORCH_CHECK(x_.scalar_type() == at::kFloat || x_.scalar_type() == at::kBFloat16,
              "quantize_rows: x must be float32 or bfloat16, got ", x_.scalar_type());
  TORCH_CHECK(padded_rows >= x_.size(0), "quantize_rows: padded_rows must be >= ", x_.size(0),
              ", got ", padded_rows);
  TORCH_CHECK(x_scales.has_value() || (!x_bias.has_value() && !relu),
              "quantize_rows: x_bias and relu apply to a GEMM's unscaled output: pass x_scales");
  const auto x = x_.contiguous();
  const int64_t rows = x.size(0), width = x.size(1);
  const float* in_shift = bias_data(x_bias, width, "quantize_rows", "x_bias");
  const float* in_scale = x_scales.has_value()
                              ? row_scales_data(*x_scales, rows, "quantize_rows", "x_scales")
                              : nullptr;
  const float half = reduce_range ? 63.0f : 127.0f, zero_point = half + 1.0f;
  auto q = at::empty({padded_rows, width}, x.options().dtype(as_float ? at::kFloat : at::kByte));
  auto scales = at::empty({rows}, x.options().dtype(at::kFloat));
  float* scale = scales.data_ptr<float>();
  auto quantize = [&](auto* out, auto zero) {  // zero: z as out holds it
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_rows", [&] {
      const scalar_t* in = x.data_ptr<scalar_t>();
      at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
        for_input_rows(in, width, in_scale, in_shift, relu, begin, end, [&](int64_t m, auto row) {
          const float high = row_abs_max(row, width);
          if (high > 0.0f && std::isfinite(high)) {
            scale[m] = high / half;
            quantize_row(row, width, half / high, zero_point, out + m * width);
          } else {  // all zeros (or an infinity): every value z, the GEMM's output row 0
            scale[m] = 1.0f;
            std::fill(out + m * width, out + (m + 1) * width, zero);
          }
        });
      });
    });
  };
  if (as_float) {
    quantize(q.data_ptr<float>(), 0.0f);
  } else {
    quantize(q.data_ptr<uint8_t>(), static_cast<uint8_t>(zero_point));
  }
  return {q, scales};
}

at::Tensor& scale_rows_(at::Tensor& y, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& bias, bool relu) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "scale_rows_: y must be contiguous (rows, N)");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16,
              "scale_rows_: y must be float32 or bfloat16, got ", y.scalar_type());
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) <= y.size(0),
              "scale_rows_: scales must have at most y's ", y.size(0), " rows");
  const int64_t rows = scales.size(0), width = y.size(1);
  const float* scale = row_scales_data(scales, rows, "scale_rows_", "scales");
  const float* shift = bias_data(bias, width, "scale_rows_", "bias");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "scale_rows_", [&] {
    scalar_t* out = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
      // y[m, n] = act(y[m, n] scale[m] + bias[n]) in place, for the rows m < scales.numel()
      for_input_rows(out, width, scale, shift, relu, begin, end, [&](int64_t m, auto row) {
        for (int64_t k = 0; k < width; k += kLanes) {
          const int64_t lanes = std::min(kLanes, width - k);
          store_float(out + m * width + k, row.values(k, lanes), lanes);
        }
      });
    });
  });
  return y;
}

// The int8 GEMM of a few rows (fastnmt/quantize.py, OnednnInt8Linear): q (rows, K) as
// quantize_rows gives it (bytes around zero point z), weight (K, N) int8 (the per-channel
// quantized (N, K) weight, transposed). Returns s_w[n] sum_k (q[m, k] - z) weight[k, n] in
// out_dtype, what oneDNN's qlinear_pointwise gives at scale 1: the exact int32 sums times the
// weight's scales in fp32, rounded once. The sums come from at::_int_mm, whose fixed cost per
// call is about a third of qlinear_pointwise's (which builds oneDNN's primitive descriptor at
// every call: 21 against 8 us for 16 x 256 x 768 on a Zen 5 core), most of a decoding step's
// GEMM time at such shapes.
at::Tensor int8_mm(const at::Tensor& q, const at::Tensor& weight, const at::Tensor& weight_scales,
                   int64_t zero_point, at::ScalarType out_dtype) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(),
              "int8_mm: q must be contiguous uint8 (rows, K)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.size(0) == q.size(1),
              "int8_mm: weight must be int8 (K, N) with K = ", q.size(1));
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "int8_mm: out_dtype must be float32 or bfloat16, got ", out_dtype);
  TORCH_CHECK(zero_point > 0 && zero_point < 256, "int8_mm: zero_point must be in (0, 256)");
  const int64_t rows = q.size(0), n = weight.size(1);
  const float* scale = bias_data(weight_scales, n, "int8_mm", "weight_scales");
  auto centered = at::empty(q.sizes(), q.options().dtype(at::kChar));  // q - z, |q - z| <= 127
  const uint8_t* in = q.data_ptr<uint8_t>();
  int8_t* out = centered.data_ptr<int8_t>();
  const auto z = static_cast<uint8_t>(zero_point);
  const int64_t bytes = q.numel();
  for (int64_t i = 0; i < bytes; ++i) out[i] = static_cast<int8_t>(in[i] - z);
  const auto sums = at::_int_mm(centered, weight);
  auto y = at::empty({rows, n}, q.options().dtype(out_dtype));
  const int32_t* sum = sums.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out_dtype, "int8_mm", [&] {
    scalar_t* result = y.data_ptr<scalar_t>();
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t j = 0; j < n; j += kLanes) {
        const int64_t lanes = std::min(kLanes, n - j);
        const Vec v = load_float(sum + m * n + j, lanes) * load_float(scale + j, lanes);
        store_float(result + m * n + j, v, lanes);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastnmt, m) {
  m.def(
      "quantize_rows(Tensor x, int padded_rows, bool reduce_range, Tensor? x_scales=None, "
      "Tensor? x_bias=None, bool relu=False, bool as_float=False) -> (Tensor, Tensor)");
  m.def("scale_rows_(Tensor(a!) y, Tensor scales, Tensor? bias, bool relu) -> Tensor(a!)");
  m.def(
      "int8_mm(Tensor q, Tensor weight, Tensor weight_scales, int zero_point, ScalarType out_dtype) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(fastnmt, CPU, m) {
  m.impl("quantize_rows", quantize_rows);
  m.impl("scale_rows_", scale_rows_);
  m.impl("int8_mm", int8_mm);
}

}  // namespace fastnmt
