// Fused masked scaled-dot-product attention for CPU tensors, forward and backward (the math and
// the masking contract are in fastnmt/ops/attention.py's docstring).
//
// Translation batches are many short sequences (B * H in the hundreds, L <= a few hundred), so a
// unit of work is one (b, h) and one block of up to kBlockM queries, against all the keys that
// block sees: keys past key_length[b] (or past the last unpadded key) are never read, and causal
// blocks stop at their last query. A block's scores fit in a per-thread buffer (kBlockM x Lk), so
// the softmax is exact in two passes over that buffer (no online rescaling), and the full
// (B, H, Lq, Lk) tensor is never formed. Inputs of any dtype are converted once per (b, h) into
// fp32 panels (K transposed, V row-major; zero-padded to whole vectors), and every product is a
// register-blocked micro-kernel: kTileRows rows x kTileVectors vectors of fp32
// accumulators, one broadcast scalar of A and one vector row of B per step of the reduction. For
// bf16 inputs on CPUs with AVX512-BF16 the operands are packed to bf16 pairs per product and
// each step multiplies two of the reduction (vdpbf16ps).
//
// Backward (FlashAttention-2): one thread owns one (b, h) and walks its query blocks, recomputing
// P = exp(S - lse) and the dropout mask, and accumulating dK and dV in fp32 panels; dQ of a block
// is complete once the block is done. No atomics, and no result depends on which thread ran what.
// Threads pull work units from a shared counter, which balances uneven sentence lengths without
// changing any result.
#include "common.h"
#include "vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace fastnmt {
namespace {

constexpr int64_t kBlockM = 64;  // query rows per work unit
constexpr int64_t kFewQueries = 8;  // up to this many queries, forward_few_queries
constexpr int64_t kShortBlock = 64 * 64;  // up to Lq x Lk scores, a unit takes a few microseconds
constexpr int kTileRows = 4;  // accumulator rows of the micro-kernel
// Accumulator vectors per row: 64 columns with AVX-512's 32 registers, 16 with AVX2's 16.
constexpr int kTileVectors = kLanes == 16 ? 4 : 2;

// C(R x kLanes NV) (+)= sum_k A(r, k) B(k, :) with A(r, k) = a[r * a_row + k * a_col] and B
// row-major: each step of k loads NV vectors of B and broadcasts R scalars of A.
template <int R, int NV>
struct FloatTile {
  static void run(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
                  int64_t depth, float* c, int64_t ldc, bool accumulate) {
    Vec acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? load(c + r * ldc + v * kLanes) : Vec{};
    for (int64_t k = 0; k < depth; ++k) {
      Vec row[NV];
      for (int v = 0; v < NV; ++v) row[v] = load(b + k * ldb + v * kLanes);
      for (int r = 0; r < R; ++r) {
        const Vec scalar = splat(a[r * a_row + k * a_col]);
        for (int v = 0; v < NV; ++v) acc[r][v] += scalar * row[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) store(c + r * ldc + v * kLanes, acc[r][v]);
  }
};

template <template <int, int> class Tile, int R, int... NV>
constexpr auto tiles_of_rows(std::integer_sequence<int, NV...>) {
  return std::array{&Tile<R, NV + 1>::run...};
}

template <template <int, int> class Tile, int... R>
constexpr auto tile_table(std::integer_sequence<int, R...>) {
  return std::array{tiles_of_rows<Tile, R + 1>(std::make_integer_sequence<int, kTileVectors>{})...};
}

// Tile<R, NV>::run for R = 1..kTileRows, NV = 1..kTileVectors: the edges of a product.
template <template <int, int> class Tile>
constexpr auto kTiles = tile_table<Tile>(std::make_integer_sequence<int, kTileRows>{});

// C (rows x cols, cols whole vectors) (+)= A (rows x depth) B (depth x cols), the operands
// as a Tile takes them (A(r, k) at a[r * a_row + k * a_col], B row-major). Column blocks
// outermost, so a block of B stays in L1 across the rows.
template <template <int, int> class Tile, typename A, typename B>
void tiled_product(const A* a, int64_t a_row, int64_t a_col, const B* b, int64_t ldb,
                   int64_t depth, float* c, int64_t ldc, int64_t rows, int64_t cols,
                   bool accumulate) {
  for (int64_t c0 = 0; c0 < cols; c0 += kTileVectors * kLanes) {
    const int64_t vectors = std::min<int64_t>(kTileVectors, (cols - c0) / kLanes);
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int64_t tile_rows = std::min<int64_t>(kTileRows, rows - r0);
      kTiles<Tile>[tile_rows - 1][vectors - 1](a + r0 * a_row, a_row, a_col, b + c0, ldb, depth,
                                               c + r0 * ldc + c0, ldc, accumulate);
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 inputs multiply in bf16 (AVX512-BF16: vdpbf16ps adds two bf16 products to each fp32
// lane, twice the multiply-adds of an fp32 FMA), as the reference path's matmuls and
// FlashAttention do: the operands are rounded to bf16 (inputs exactly; P and dS to nearest
// even), products accumulate in fp32. Operands are packed as 32-bit words holding elements
// k = 2p and 2p + 1 of the reduction.

// C(R x 16 NV) (+)= sum_p A(r, p) . B(p, :) over word pairs, A(r, p) = a[r * a_row + p * a_pair].
template <int R, int NV>
struct Bf16Tile {
  static void run(const uint32_t* a, int64_t a_row, int64_t a_pair, const uint32_t* b,
                  int64_t ldb, int64_t pairs, float* c, int64_t ldc, bool accumulate) {
    __m512 acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v)
        acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * ldc + v * kLanes) : _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh row[NV];
      for (int v = 0; v < NV; ++v)
        row[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * ldb + v * kLanes));
      for (int r = 0; r < R; ++r) {
        const auto pair = reinterpret_cast<__m512bh>(
            _mm512_set1_epi32(static_cast<int>(a[r * a_row + p * a_pair])));
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, row[v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + v * kLanes, acc[r][v]);
  }
};

// The bf16 bits (round to nearest even, as store_float) of 16 floats, in the low halves.
inline WordVec bf16_bits(Vec v) {
  WordVec bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  return (bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16;
}

// Words w[p * ldw + i] = bf16(M(2p, i)) | bf16(M(2p + 1, i)) << 16 for p < (depth + 1) / 2 and
// i < n (a multiple of 16), M(k, i) = m[k * k_stride + i], M(depth, i) = 0.
void pack_interleaved(const float* m, int64_t k_stride, int64_t depth, int64_t n, uint32_t* w,
                      int64_t ldw) {
  for (int64_t p = 0; 2 * p < depth; ++p) {
    const float* even = m + 2 * p * k_stride;
    const bool odd = 2 * p + 1 < depth;
    for (int64_t i = 0; i < n; i += kLanes) {
      const WordVec low = bf16_bits(load(even + i));
      const WordVec high = odd ? bf16_bits(load(even + k_stride + i)) : WordVec{};
      const WordVec words = low | high << 16;
      __builtin_memcpy(w + p * ldw + i, &words, sizeof words);
    }
  }
}

// Rows i < n of M (m[i * ld + k], k < depth) in bf16, zero-padded to whole vectors: the words
// of row i, pairs of consecutive k, start at w + i * whole_vectors(depth) / 2.
void pack_rows(const float* m, int64_t ld, int64_t depth, int64_t n, uint32_t* w) {
  const int64_t padded = whole_vectors(depth);
  for (int64_t i = 0; i < n; ++i) {
    auto* out = reinterpret_cast<c10::BFloat16*>(w) + i * padded;
    for (int64_t k = 0; k < padded; k += kLanes)
      store_float(out + k, load_float(m + i * ld + k, std::clamp<int64_t>(depth - k, 0, kLanes)));
  }
}

// C (rows x cols, cols whole vectors) (+)= A (rows x depth, strides a_row, a_col) B (depth x
// cols, row-major) in bf16 products. A is row-major (a_col == 1) or column-major (a_row == 1).
void bf16_gemm(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
               int64_t depth, float* c, int64_t ldc, int64_t rows, int64_t cols, bool accumulate) {
  thread_local std::vector<uint32_t> a_words, b_words;
  const int64_t pairs = (depth + 1) / 2;
  b_words.resize(pairs * cols);
  pack_interleaved(b, ldb, depth, cols, b_words.data(), cols);
  if (a_col == 1) {
    const int64_t ld = whole_vectors(depth) / 2;
    a_words.resize(rows * ld);
    pack_rows(a, a_row, depth, rows, a_words.data());
    tiled_product<Bf16Tile>(a_words.data(), ld, int64_t{1}, b_words.data(), cols, pairs, c, ldc,
                            rows, cols, accumulate);
  } else {
    const int64_t ld = whole_vectors(rows);
    a_words.resize(pairs * ld);
    pack_interleaved(a, a_col, depth, ld, a_words.data(), ld);
    tiled_product<Bf16Tile>(a_words.data(), int64_t{1}, ld, b_words.data(), cols, pairs, c, ldc,
                            rows, cols, accumulate);
  }
}

// r[i] (16 words each) <- column i of the 16 x 16 words r: 32-bit interleaves, then 64-bit, then
// two shuffles of 128-bit lanes.
inline void transpose_words(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c], 128-bit lane L: column 4L + c of rows i..i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// bf16 keys and values straight into bf16 word pairs (no fp32 round trip: the products see the
// same operands, so the same results). K^T for QK^T: w[p * ld + j] is key j's word holding
// elements 2p and 2p + 1 (d even), zero for j in [n, whole_vectors(n)); 16 keys by 16 words at a
// time, each key's row read where it lies (a decoding cache's rows need not be evenly spaced),
// transposed in registers (a gather per word was most of a short sentence's attention).
template <typename KeyRows>
void load_key_pairs(const KeyRows& k, int64_t b, int64_t h, int64_t n, int64_t d, uint32_t* w,
                    int64_t ld) {
  const int64_t pairs = d / 2;
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int64_t keys = std::min(kLanes, n - j0);
    for (int64_t p0 = 0; p0 < pairs; p0 += kLanes) {
      const int64_t words = std::min(kLanes, pairs - p0);
      const auto mask = static_cast<__mmask16>(lane_mask(words));
      __m512i r[16];
      for (int64_t l = 0; l < kLanes; ++l) {
        const auto* row = reinterpret_cast<const uint32_t*>(k.at(b, h, j0 + std::min(l, keys - 1)));
        r[l] = l < keys ? _mm512_maskz_loadu_epi32(mask, row + p0) : _mm512_setzero_si512();
      }
      transpose_words(r);
      for (int64_t p = 0; p < words; ++p) _mm512_storeu_si512(w + (p0 + p) * ld + j0, r[p]);
    }
  }
}

// V for PV, pairs of consecutive keys: w[p * ld + i] = bf16 bits of V(2p, i) | V(2p + 1, i) << 16
// for i < ld (whole vectors; zero past dv), V(n, :) = 0. Each 32 columns of two rows interleave in
// two permutes.
template <typename ValueRows>
void load_value_pairs(const ValueRows& v, int64_t b, int64_t h, int64_t n, int64_t dv,
                      uint32_t* w, int64_t ld) {
  alignas(64) static constexpr uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t p = 0; 2 * p < n; ++p) {
    const auto* even = v.at(b, h, 2 * p);
    const auto* odd = 2 * p + 1 < n ? v.at(b, h, 2 * p + 1) : nullptr;
    for (int64_t i = 0; i < ld; i += 2 * kLanes) {
      const int64_t columns = std::clamp<int64_t>(dv - i, 0, 2 * kLanes);
      const auto mask = static_cast<__mmask32>(columns == 32 ? ~0U : (1U << columns) - 1U);
      const __m512i e = _mm512_maskz_loadu_epi16(mask, even + i);
      const __m512i o = odd ? _mm512_maskz_loadu_epi16(mask, odd + i) : _mm512_setzero_si512();
      _mm512_storeu_si512(w + p * ld + i, _mm512_permutex2var_epi16(e, low, o));
      if (i + kLanes < ld) {
        _mm512_storeu_si512(w + p * ld + i + kLanes, _mm512_permutex2var_epi16(e, high, o));
      }
    }
  }
}
#endif

// C (rows x cols, cols whole vectors) (+)= A (rows x depth, strides a_row, a_col) B (depth x
// cols, row-major), in fp32 or, for bf16 inputs (T) where the CPU has AVX512-BF16, in bf16.
template <typename T>
void gemm(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
          int64_t depth, float* c, int64_t ldc, int64_t rows, int64_t cols, bool accumulate) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_gemm(a, a_row, a_col, b, ldb, depth, c, ldc, rows, cols, accumulate);
  }
#endif
  tiled_product<FloatTile>(a, a_row, a_col, b, ldb, depth, c, ldc, rows, cols, accumulate);
}

// A (B, H, L, width) tensor with a contiguous last dim, read by (b, h, row). The keys and values
// of a decoding cache can be read through cache rows (B, L), int64 with a contiguous last dim:
// row j of entry b is then row j of entry cache_rows[b, j] (a beam search's cache is never
// reordered). Packed sequences (varlen): a (total, H, width) tensor whose sequence b is rows
// starts[b], starts[b] + 1, ... (cu_seqlens).
template <typename T>
struct Rows {
  const T* data;
  int64_t stride_b, stride_h, stride_row;
  const int64_t* entries = nullptr;  // the cache rows, or nullptr: row j of b is b's own
  int64_t entries_stride = 0;
  const int64_t* starts = nullptr;  // packed: each sequence's first row, or nullptr

  explicit Rows(const at::Tensor& t)
      : data(t.data_ptr<T>()), stride_b(t.stride(0)), stride_h(t.stride(1)),
        stride_row(t.stride(2)) {}

  Rows(const at::Tensor& t, const at::Tensor& cache_rows) : Rows(t) {
    if (cache_rows.defined()) {
      entries = cache_rows.data_ptr<int64_t>();
      entries_stride = cache_rows.stride(0);
    }
  }

  Rows(const at::Tensor& packed, const int64_t* starts_)
      : data(packed.data_ptr<T>()), stride_b(0), stride_h(packed.stride(1)),
        stride_row(packed.stride(0)), starts(starts_) {}

  const T* at(int64_t b, int64_t h, int64_t row) const {
    if (starts != nullptr) return data + h * stride_h + (starts[b] + row) * stride_row;
    const int64_t entry = entries == nullptr ? b : entries[b * entries_stride + row];
    return data + entry * stride_b + h * stride_h + row * stride_row;
  }
};

// Asks the caches for rows [0, n) of a (b, h) (width elements each) ahead of their use: a short
// sequence's unit otherwise waits on the first touch of every one of its rows.
template <typename T>
void prefetch_rows(const Rows<T>& src, int64_t b, int64_t h, int64_t n, int64_t width) {
  constexpr int64_t kLine = 64;
  const int64_t bytes = width * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(src.at(b, h, j));
    for (int64_t offset = 0; offset < bytes; offset += kLine) __builtin_prefetch(row + offset);
  }
}

// Rows [first, first + n) of a (b, h) as fp32, row-major with `ld` >= whole_vectors(width)
// columns, zero-padded.
template <typename T>
void load_rows(const Rows<T>& src, int64_t b, int64_t h, int64_t first, int64_t n, int64_t width,
               float* dst, int64_t ld) {
  for (int64_t r = 0; r < n; ++r) {
    const T* row = src.at(b, h, first + r);
    float* out = dst + r * ld;
    for (int64_t d = 0; d < width; d += kLanes)
      store(out + d, load_float(row + d, std::min(kLanes, width - d)));  // zeros past width
    std::fill(out + whole_vectors(width), out + ld, 0.0f);
  }
}

// Rows [0, n) of a (b, h) transposed to fp32 (width x ld), columns n..ld zero.
template <typename T>
void load_transposed(const Rows<T>& src, int64_t b, int64_t h, int64_t n, int64_t width,
                     float* dst, int64_t ld) {
  std::fill(dst, dst + width * ld, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const T* row = src.at(b, h, j);
    for (int64_t d = 0; d < width; ++d) dst[d * ld + j] = to_float(row[d]);
  }
}

// Which keys each batch entry shows: the keys past key_end[b] are padding for every query; the
// bool mask can also hide keys before it. Built once per call from key_lengths / the mask.
struct KeyMask {
  std::vector<int64_t> key_end;  // (B,) 1 + the last visible key
  const bool* padding = nullptr;  // (B, Lk) True = padding, or nullptr
  int64_t stride_b = 0, stride_j = 0;
  bool causal = false;

  KeyMask(const c10::optional<at::Tensor>& key_lengths,
          const c10::optional<at::Tensor>& key_padding_mask, int64_t batch, int64_t lk,
          bool causal_)
      : key_end(batch, lk), causal(causal_) {
    if (key_lengths.has_value()) {
      const auto lengths = key_lengths->to(at::kLong).contiguous();
      const int64_t* values = lengths.data_ptr<int64_t>();
      for (int64_t b = 0; b < batch; ++b) key_end[b] = std::clamp<int64_t>(values[b], 0, lk);
    }
    if (key_padding_mask.has_value()) {
      padding = key_padding_mask->data_ptr<bool>();
      stride_b = key_padding_mask->stride(0);
      stride_j = key_padding_mask->stride(1);
      for (int64_t b = 0; b < batch; ++b) {
        while (key_end[b] > 0 && padding[b * stride_b + (key_end[b] - 1) * stride_j]) --key_end[b];
      }
    }
  }

  // Keys a block of queries ending before `query_end` may see.
  int64_t keys_of_block(int64_t b, int64_t query_end) const {
    return causal ? std::min(key_end[b], query_end) : key_end[b];
  }

  // bias[j] = 0 for a key b shows, -inf otherwise, for j < width (whole vectors).
  void bias(int64_t b, float* out, int64_t width) const {
    for (int64_t j = 0; j < width; ++j) {
      const bool shown = j < key_end[b] && (padding == nullptr || !padding[b * stride_b + j * stride_j]);
      out[j] = shown ? 0.0f : -kInf;
    }
  }
};

// The scores of query row i over `width` keys: scale * S + bias, -inf past i when causal.
inline Vec masked_scores(const float* s, const float* bias, int64_t v, int64_t i, float scale,
                         bool causal) {
  Vec x = load(s + v) * scale + load(bias + v);
  if (causal) x = lane_indices() + static_cast<float>(v) > static_cast<float>(i) ? splat(-kInf) : x;
  return x;
}

// Dropout factors keep_ij / (1 - p) of row i (global element index first + j) for j < width.
inline void dropout_row(const DropoutStream& drop, uint32_t first, float* out, int64_t width) {
  for (int64_t j = 0; j < width; ++j) out[j] = drop.factor(first + static_cast<uint32_t>(j));
}

inline uint32_t element_index(int64_t bh, int64_t i, int64_t lq, int64_t lk) {
  return static_cast<uint32_t>((bh * lq + i) * lk);  // + j; wraps modulo 2^32
}

// Rows r < rows of a block's scores s (leading dim ld, `width` lanes; query i0 + r) -> their
// attention probabilities in place, times the dropout factors keep_ij / (1 - p) (element index
// first + r lk + j) when dropout is on: x = scale * S + bias (-inf past the query when causal),
// P = exp(x - lse); a row that sees no key gets P = 0 and lse = -inf. Pass by pass over the
// rows, whose reductions then overlap (short rows wait on them), in powers of two (the scale
// times log2(e): one multiply-add a score), the rows' logs and reciprocals a vector at a time.
// `stats`: scratch of kSoftmaxStats floats; the rows' log-sum-exps are left in its last
// kBlockM.
constexpr int64_t kSoftmaxStats = 3 * kBlockM;

inline float* softmax_lse(float* stats) { return stats + 2 * kBlockM; }

inline void softmax_rows(float* s, int64_t ld, int64_t rows, int64_t i0, const float* bias,
                         int64_t width, float scale, bool causal, const DropoutStream& drop,
                         uint32_t first, int64_t lk, float* factors, float* stats) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945f;
  float* maxima = stats;          // of the scores times log2(e), a row's
  float* sums = stats + kBlockM;  // of its powers of two, then their reciprocals
  float* lse = softmax_lse(stats);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    Vec running_max = splat(-kInf);
    for (int64_t c = 0; c < width; c += kLanes) {
      const Vec x = masked_scores(row, bias, c, i0 + r, scale * kLog2e, causal);
      store(row + c, x);
      running_max = x > running_max ? x : running_max;
    }
    maxima[r] = horizontal_max(running_max);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    const float row_max = maxima[r] == -kInf ? 0.0f : maxima[r];  // a row that sees no key: 0s
    Vec total = Vec{};
    for (int64_t c = 0; c < width; c += kLanes) {
      const Vec x = load(row + c);
      const Vec e = x > -kInf ? vector_exp2(x - row_max) : Vec{};
      store(row + c, e);
      total += e;
    }
    sums[r] = horizontal_sum(total);
  }
  for (int64_t r = 0; r < rows; r += kLanes) {  // whole vectors of the scratch: kBlockM of each
    const Vec row_max = load(maxima + r), sum = load(sums + r);
    const Vec seen = row_max > -kInf ? sum : splat(1.0f);
    store(lse + r, row_max > -kInf ? row_max * kLn2 + vector_log(seen) : splat(-kInf));
    store(sums + r, row_max > -kInf ? 1.0f / seen : Vec{});
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    const float inverse_sum = sums[r];
    if (drop.active) {
      dropout_row(drop, first + static_cast<uint32_t>(r * lk), factors, width);
      for (int64_t c = 0; c < width; c += kLanes)
        store(row + c, load(row + c) * load(factors + c) * inverse_sum);
    } else {
      for (int64_t c = 0; c < width; c += kLanes) store(row + c, load(row + c) * inverse_sum);
    }
  }
}

// Calls worker(next) once on each intra-op thread; next() hands out work units 0, 1, 2, ...
// (a unit number past the last means none is left), so fast threads take more units. A thread
// claims `grain` consecutive units at a time from the shared counter (see short_units_grain).
template <typename Worker>
void run_workers(const Worker& worker, int64_t grain = 1) {
  std::atomic<int64_t> counter{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    int64_t unit = 0, claimed_end = 0;
    const auto next = [&] {
      if (unit == claimed_end) {
        unit = counter.fetch_add(grain);
        claimed_end = unit + grain;
      }
      return unit++;
    };
    worker(next);
  });
}

// The grain of units that take a microsecond or so (a (b, h) of a decoding step, a block of a
// short sentence): claimed one at a time, the shared counter's cache line would pass between the
// cores at every one (1.3-1.6x slower at beam-search shapes, 1.05x at scoring's). A thread
// claims an eighth of its share at a time.
inline int64_t short_units_grain(int64_t units) {
  return std::max<int64_t>(1, units / (8 * at::get_num_threads()));
}

// lq and lk: the longest sequences' (the padded lengths; packed, max_seqlen_q and _k).
struct Shape {
  int64_t batch, heads, lq, lk, d, dv;

  explicit Shape(const at::Tensor& q, const at::Tensor& v)
      : batch(q.size(0)), heads(q.size(1)), lq(q.size(2)), lk(v.size(2)), d(q.size(3)),
        dv(v.size(3)) {}

  Shape(int64_t batch_, int64_t heads_, int64_t lq_, int64_t lk_, int64_t d_, int64_t dv_)
      : batch(batch_), heads(heads_), lq(lq_), lk(lk_), d(d_), dv(dv_) {}
};

at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// The cache rows as int64 with a contiguous last dim (undefined when not given; a decoding
// cache passes a column slice of its table, read in place), each checked to name one of the
// `entries` batch entries of k and v: the kernels read through them unchecked.
at::Tensor checked_cache_rows(const c10::optional<at::Tensor>& cache_rows, int64_t entries) {
  if (!cache_rows.has_value()) return {};
  const auto rows = last_dim_contiguous(cache_rows->to(at::kLong));
  const int64_t* values = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows.size(0); ++b) {
    for (int64_t j = 0; j < rows.size(1); ++j) {
      const int64_t value = values[b * rows.stride(0) + j];
      TORCH_CHECK(value >= 0 && value < entries, "cache_rows must lie in [0, ", entries,
                  ") (k's batch entries), got ", value);
    }
  }
  return rows;
}

// A (B, H, L, width) output with a contiguous last dim, written by (b, h, row) through its
// strides: the attention output lies (B, L, H, Dv) in memory, so that joining its heads is a
// view; each gradient lies as its input (see attention_cpp_backward).
// Packed (varlen): a (total, H, width) output, sequence b from row starts[b] (as Rows).
template <typename T>
struct OutRows {
  T* data;
  int64_t stride_b, stride_h, stride_row;
  const int64_t* starts = nullptr;

  explicit OutRows(at::Tensor& t)
      : data(t.data_ptr<T>()), stride_b(t.stride(0)), stride_h(t.stride(1)),
        stride_row(t.stride(2)) {}

  OutRows(at::Tensor& packed, const int64_t* starts_)
      : data(packed.data_ptr<T>()), stride_b(0), stride_h(packed.stride(1)),
        stride_row(packed.stride(0)), starts(starts_) {}

  T* at(int64_t b, int64_t h, int64_t row) const {
    if (starts != nullptr) return data + h * stride_h + (starts[b] + row) * stride_row;
    return data + b * stride_b + h * stride_h + row * stride_row;
  }
};

// Writes a (rows x width) fp32 panel (leading dim ld) to rows [first, first + rows) of (b, h),
// and zeros to rows [first + rows, last).
template <typename T>
void store_rows(const float* src, int64_t ld, const OutRows<T>& dst, int64_t b, int64_t h,
                int64_t first, int64_t rows, int64_t last, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    T* row = dst.at(b, h, first + r);
    for (int64_t d = 0; d < width; d += kLanes)
      store_float(row + d, load(src + r * ld + d), std::min(kLanes, width - d));
  }
  for (int64_t r = first + rows; r < last; ++r) {
    T* row = dst.at(b, h, r);
    std::fill(row, row + width, static_cast<T>(0.0f));
  }
}

// Whether q and k are bf16 rows of whole 32-bit words (an even head dim, even strides) on a CPU
// with AVX512-BF16: the products then read them as bf16 pairs in place, with no fp32 panels.
template <typename T>
bool reads_words(const at::Tensor& q, const at::Tensor& k) {
#if defined(__AVX512BF16__)
  const auto words = [](const at::Tensor& t) {
    bool even = reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0;
    for (int64_t i = 0; i + 1 < t.dim(); ++i) even = even && t.stride(i) % 2 == 0;
    return even;
  };
  return std::is_same_v<T, c10::BFloat16> && q.size(-1) % 2 == 0 && words(q) && words(k);
#else
  return false;
#endif
}

// The per-thread panels of forward_kernel: fp32 K^T and V (kt, vb), with a Q block (qb); or,
// reading words, K^T and V as bf16 pairs (kw, vw) and a P block's (pw).
struct Panels {
  std::vector<float> floats;
  std::vector<uint32_t> words;
  float *kt = nullptr, *vb = nullptr, *qb = nullptr;
  uint32_t *kw = nullptr, *vw = nullptr, *pw = nullptr;
  bool read_words;
  int64_t lk_vectors, d_vectors, dv_vectors;

  Panels(const Shape& n, bool read_words_)
      : read_words(read_words_), lk_vectors(whole_vectors(n.lk)), d_vectors(whole_vectors(n.d)),
        dv_vectors(whole_vectors(n.dv)) {
    if (read_words) {
      words.resize(n.d / 2 * lk_vectors + (n.lk + 1) / 2 * dv_vectors + kBlockM * lk_vectors / 2);
      kw = words.data();
      vw = kw + n.d / 2 * lk_vectors;
      pw = vw + (n.lk + 1) / 2 * dv_vectors;
    } else {
      floats.resize(n.d * lk_vectors + n.lk * dv_vectors + kBlockM * d_vectors);
      kt = floats.data();
      vb = kt + n.d * lk_vectors;
      qb = vb + n.lk * dv_vectors;
    }
  }

  // K^T and V of (b, h)'s first `keys` rows, for all its blocks.
  template <typename T>
  void load(const Rows<T>& k, const Rows<T>& v, int64_t b, int64_t h, int64_t keys,
            const Shape& n) {
#if defined(__AVX512BF16__)
    if (read_words) {
      load_key_pairs(k, b, h, keys, n.d, kw, lk_vectors);
      load_value_pairs(v, b, h, keys, n.dv, vw, dv_vectors);
      return;
    }
#endif
    load_transposed(k, b, h, keys, n.d, kt, lk_vectors);
    load_rows(v, b, h, 0, keys, n.dv, vb, dv_vectors);
  }

  // s (rows x width, leading dim lk_vectors) = Q K^T for queries [i0, i0 + rows) of (b, h).
  template <typename T>
  void scores(const Rows<T>& q, int64_t b, int64_t h, int64_t i0, int64_t rows, const Shape& n,
              float* s, int64_t width) {
#if defined(__AVX512BF16__)
    if (read_words) {
      const auto* a = reinterpret_cast<const uint32_t*>(q.at(b, h, i0));
      tiled_product<Bf16Tile>(a, q.stride_row / 2, int64_t{1}, kw, lk_vectors, n.d / 2, s,
                              lk_vectors, rows, width, false);
      return;
    }
#endif
    load_rows(q, b, h, i0, rows, n.d, qb, d_vectors);
    gemm<T>(qb, d_vectors, 1, kt, lk_vectors, n.d, s, lk_vectors, rows, width, false);
  }

  // o (rows x dv_vectors) = P V over the first `keys` keys (keys > 0), P = s's rows.
  template <typename T>
  void values(const float* s, int64_t rows, int64_t keys, float* o) {
#if defined(__AVX512BF16__)
    if (read_words) {
      pack_rows(s, lk_vectors, keys, rows, pw);
      tiled_product<Bf16Tile>(pw, whole_vectors(keys) / 2, int64_t{1}, vw, dv_vectors,
                              (keys + 1) / 2, o, dv_vectors, rows, dv_vectors, false);
      return;
    }
#endif
    gemm<T>(s, lk_vectors, 1, vb, dv_vectors, keys, o, dv_vectors, rows, dv_vectors, false);
  }
};

// Up to this many vectors of q/k and of v per row (head dims of 256 with AVX-512, 128 with AVX2)
// take forward_few_queries; wider heads, forward_kernel.
constexpr int64_t kFewQueriesVectors = 16;

// One query of a (b, h) against its keys (decoding), widths of at most NV vectors: q and the
// output row stay in registers (NV a compile-time count, the loops unrolled); the scores go to
// s and the output row to o (dv_vectors wide). Returns lse, as softmax_rows (whose `stats`
// scratch it takes). EXACT: both widths are NV whole vectors (no bounds to check); else each
// vector is checked against the width.
template <int NV, bool EXACT, typename T, typename KeyAt, typename ValueAt>
float few_queries_row(const T* q_row, const KeyAt& key_at, const ValueAt& value_at,
                      const Shape& n, int64_t keys, const float* bias, int64_t i, float scale,
                      bool causal, const DropoutStream& drop, uint32_t first, float* s,
                      float* factors, float* stats, float* o) {
  // Vector x of a row of `width` values (zeros past it); `inside`: whether it holds any.
  const auto part = [](const auto* row, int x, int64_t width) {
    if constexpr (EXACT) return load_float(row + x * kLanes);
    const int64_t start = x * kLanes;
    return start < width ? load_float(row + start, std::min(kLanes, width - start)) : Vec{};
  };
  const auto inside = [](int x, int64_t width) { return EXACT || x * kLanes < width; };
  Vec qv[NV];
  for (int x = 0; x < NV; ++x) qv[x] = part(q_row, x, n.d);
  for (int64_t j = 0; j < keys; ++j) {
    const auto* key = key_at(j);
    Vec dot = Vec{};
    for (int x = 0; x < NV && inside(x, n.d); ++x) dot += qv[x] * part(key, x, n.d);
    s[j] = horizontal_sum(dot);
  }
  const int64_t width = whole_vectors(keys);
  std::fill(s + keys, s + width, 0.0f);
  softmax_rows(s, width, 1, i, bias, width, scale, causal, drop, first, n.lk, factors, stats);
  Vec acc[NV] = {};
  for (int64_t j = 0; j < keys; ++j) {
    if (s[j] == 0.0f) continue;  // hidden (or dropped) key
    const auto* value = value_at(j);
    const Vec p = splat(s[j]);
    for (int x = 0; x < NV && inside(x, n.dv); ++x) acc[x] += p * part(value, x, n.dv);
  }
  for (int x = 0; x < NV && inside(x, n.dv); ++x) store(o + x * kLanes, acc[x]);
  return softmax_lse(stats)[0];
}

// Where a call's rows lie: padded (B, H, L, D) tensors with LSE rows (B, H, Lq), or packed
// sequences (varlen: (total, H, D) tensors, sequence b's queries from row query_starts[b] and its
// keys from row key_starts[b]) with LSE rows (H, total_q).
struct Layout {
  Shape n;
  const int64_t* query_starts = nullptr;  // packed: cu_seqlens_q (B + 1,), else nullptr
  const int64_t* key_starts = nullptr;  // packed: cu_seqlens_k
  int64_t total_queries = 0;

  explicit Layout(const Shape& n_) : n(n_) {}
  Layout(const Shape& n_, const at::Tensor& query_starts_, const at::Tensor& key_starts_,
         int64_t total_queries_)
      : n(n_), query_starts(query_starts_.data_ptr<int64_t>()),
        key_starts(key_starts_.data_ptr<int64_t>()), total_queries(total_queries_) {}

  // Batch entry b's query count: the padded length, or its sequence's.
  int64_t queries(int64_t b) const {
    return query_starts == nullptr ? n.lq : query_starts[b + 1] - query_starts[b];
  }

  // The index of row i of (b, h) in an LSE (or its gradient).
  int64_t lse_index(int64_t b, int64_t h, int64_t i) const {
    if (query_starts != nullptr) return h * total_queries + query_starts[b] + i;
    return (b * n.heads + h) * n.lq + i;
  }

  // The rows a (b, h)'s keys' gradients are written to: its keys then, padded, zeros to Lk.
  int64_t key_rows_end(int64_t key_end) const { return key_starts == nullptr ? n.lk : key_end; }

  template <typename T>
  Rows<T> queries_of(const at::Tensor& t) const {
    return query_starts == nullptr ? Rows<T>(t) : Rows<T>(t, query_starts);
  }
  template <typename T>
  Rows<T> keys_of(const at::Tensor& t) const {
    return key_starts == nullptr ? Rows<T>(t) : Rows<T>(t, key_starts);
  }
  template <typename T>
  OutRows<T> query_outputs(at::Tensor& t) const {
    return query_starts == nullptr ? OutRows<T>(t) : OutRows<T>(t, query_starts);
  }
  template <typename T>
  OutRows<T> key_outputs(at::Tensor& t) const {
    return key_starts == nullptr ? OutRows<T>(t) : OutRows<T>(t, key_starts);
  }
};

// One forward call's operands, as both kernels read them.
template <typename T>
struct Forward {
  Layout layout;
  const Shape& n;
  Rows<T> q, k, v;
  OutRows<T> out;
  float* lse;
  const KeyMask& mask;
  float scale;
  const DropoutStream& drop;

  // Padded; k and v read through the decoding cache's rows when given.
  Forward(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
          const at::Tensor& cache_rows, const KeyMask& mask_, float scale_,
          const DropoutStream& drop_, at::Tensor& out_, at::Tensor& lse_)
      : layout(Shape(q_, v_)), n(layout.n), q(q_), k(k_, cache_rows), v(v_, cache_rows),
        out(out_), lse(lse_.data_ptr<float>()), mask(mask_), scale(scale_), drop(drop_) {}

  Forward(const Layout& layout_, const at::Tensor& q_, const at::Tensor& k_,
          const at::Tensor& v_, const KeyMask& mask_, float scale_, const DropoutStream& drop_,
          at::Tensor& out_, at::Tensor& lse_)
      : layout(layout_), n(layout.n), q(layout.queries_of<T>(q_)), k(layout.keys_of<T>(k_)),
        v(layout.keys_of<T>(v_)), out(layout.query_outputs<T>(out_)),
        lse(lse_.data_ptr<float>()), mask(mask_), scale(scale_), drop(drop_) {}

  Forward(const Forward&) = delete;  // n refers into layout

  int64_t queries(int64_t b) const { return layout.queries(b); }
  float& lse_at(int64_t b, int64_t h, int64_t i) const { return lse[layout.lse_index(b, h, i)]; }
};

// Whether forward_few_queries' rows can take the head dims of n.
inline bool few_queries_fit(const Shape& n) {
  return std::max(n.d, n.dv) <= kFewQueriesVectors * kLanes;
}

// Queries [i0, i1) of (b, h) = bh, each by few_queries_row, written to out and lse. Workspace: s,
// bias and factors of whole_vectors(n.lk) floats, stats of kSoftmaxStats, o of
// whole_vectors(n.dv).
template <typename T>
void few_queries_rows(const Forward<T>& f, int64_t bh, int64_t i0, int64_t i1, float* s,
                      float* bias, float* factors, float* stats, float* o) {
  const int64_t b = bh / f.n.heads, h = bh % f.n.heads;
  const int64_t widest = whole_vectors(std::max(f.n.d, f.n.dv)) / kLanes;
  // The common head dims (the same for q, k and v, whole vectors) without bounds checks.
  const int64_t exact = f.n.d == f.n.dv && f.n.d % kLanes == 0 ? f.n.d / kLanes : 0;
  f.mask.bias(b, bias, whole_vectors(f.mask.key_end[b]));
  const auto key_at = [&](int64_t j) { return f.k.at(b, h, j); };
  const auto value_at = [&](int64_t j) { return f.v.at(b, h, j); };
  for (int64_t i = i0; i < i1; ++i) {
    const auto row = [&](auto vectors, auto exact) {
      return few_queries_row<decltype(vectors)::value, decltype(exact)::value>(
          f.q.at(b, h, i), key_at, value_at, f.n, f.mask.keys_of_block(b, i + 1), bias, i,
          f.scale, f.mask.causal, f.drop, element_index(bh, i, f.n.lq, f.n.lk), s, factors,
          stats, o);
    };
    using Exact = std::true_type;
    using Checked = std::false_type;
    f.lse_at(b, h, i) =
        exact == 1   ? row(std::integral_constant<int, 1>{}, Exact{})
        : exact == 2 ? row(std::integral_constant<int, 2>{}, Exact{})
        : exact == 4 ? row(std::integral_constant<int, 4>{}, Exact{})
        : exact == 8 ? row(std::integral_constant<int, 8>{}, Exact{})
        : widest <= 4 ? row(std::integral_constant<int, 4>{}, Checked{})
        : widest <= 8 ? row(std::integral_constant<int, 8>{}, Checked{})
                      : row(std::integral_constant<int, kFewQueriesVectors>{}, Checked{});
    store_rows(o, whole_vectors(f.n.dv), f.out, b, h, i, 1, i + 1, f.n.dv);
  }
}

// Few queries per (b, h) (decoding: the new token of each hypothesis against its cache, or the
// K beams of a sentence against its source): transposing K and V into panels would cost more
// than the products, so each score is a dot product of q_i with a key row read in place, and O_i
// the P-weighted sum of value rows, in fp32. bf16 rows too are read in place by every query
// (one fp32 copy shared by a sentence's beams was 1.05-1.3x slower once bf16 loads widened in
// one instruction).
template <typename T>
void forward_few_queries(const Forward<T>& f) {
  const int64_t lk_vectors = whole_vectors(f.n.lk);
  const int64_t grain = short_units_grain(f.n.batch * f.n.heads);
  run_workers([&](const auto& next) {
    // Workspace: one query's scores, bias, dropout factors, softmax statistics and output row.
    std::vector<float> work(3 * lk_vectors + kSoftmaxStats + whole_vectors(f.n.dv));
    float* s = work.data();
    float* bias = s + lk_vectors;
    float* factors = bias + lk_vectors;
    float* stats = factors + lk_vectors;
    float* o = stats + kSoftmaxStats;
    for (int64_t bh = next(); bh < f.n.batch * f.n.heads; bh = next()) {
      few_queries_rows(f, bh, 0, f.queries(bh / f.n.heads), s, bias, factors, stats, o);
    }
  }, grain);
}

// The queries, keys and values of (b, h) = bh, asked of the caches (prefetch_rows).
template <typename T>
void prefetch_unit(const Forward<T>& f, int64_t bh) {
  const int64_t b = bh / f.n.heads, h = bh % f.n.heads, keys = f.mask.key_end[b];
  prefetch_rows(f.q, b, h, f.queries(b), f.n.d);
  prefetch_rows(f.k, b, h, keys, f.n.d);
  prefetch_rows(f.v, b, h, keys, f.n.dv);
}

// read_words: reads_words<T>(q, k).
template <typename T>
void forward_kernel(const Forward<T>& f, bool read_words) {
  const int64_t blocks = (f.n.lq + kBlockM - 1) / kBlockM;
  const int64_t lk_vectors = whole_vectors(f.n.lk), dv_vectors = whole_vectors(f.n.dv);
  const int64_t units = f.n.batch * f.n.heads * blocks;
  const bool few_keys = few_queries_fit(f.n);
  run_workers([&](const auto& next) {
    Panels panels(f.n, read_words);
    // Workspace: scores, bias, factors, the rows' softmax statistics, O.
    std::vector<float> work(kBlockM * lk_vectors + 2 * lk_vectors + kSoftmaxStats +
                            kBlockM * dv_vectors);
    float* s = work.data();
    float* bias = s + kBlockM * lk_vectors;
    float* factors = bias + lk_vectors;
    float* stats = factors + lk_vectors;
    float* o = stats + kSoftmaxStats;
    int64_t loaded_bh = -1;
    for (int64_t t = next(); t < units; t = next()) {
      const int64_t bh = t / blocks, b = bh / f.n.heads, h = bh % f.n.heads;
      const int64_t i0 = (t % blocks) * kBlockM, rows = std::min(kBlockM, f.queries(b) - i0);
      if (rows <= 0) continue;  // past a packed sequence's queries
      if (few_keys && f.mask.key_end[b] <= kFewQueries) {  // see run_forward
        few_queries_rows(f, bh, i0, i0 + rows, s, bias, factors, stats, o);
        continue;
      }
      const int64_t keys = f.mask.keys_of_block(b, i0 + rows), width = whole_vectors(keys);
      if (bh != loaded_bh) {  // the blocks of one (b, h) share its panels
        panels.load(f.k, f.v, b, h, f.mask.key_end[b], f.n);
        loaded_bh = bh;
        // The next (b, h): most often this thread's next unit.
        if (bh + 1 < f.n.batch * f.n.heads) prefetch_unit(f, bh + 1);
      }
      f.mask.bias(b, bias, width);
      panels.scores(f.q, b, h, i0, rows, f.n, s, width);
      softmax_rows(s, lk_vectors, rows, i0, bias, width, f.scale, f.mask.causal, f.drop,
                   element_index(bh, i0, f.n.lq, f.n.lk), f.n.lk, factors, stats);
      for (int64_t r = 0; r < rows; ++r) f.lse_at(b, h, i0 + r) = softmax_lse(stats)[r];
      if (keys > 0) {
        panels.values<T>(s, rows, keys, o);
      } else {
        std::fill(o, o + rows * dv_vectors, 0.0f);
      }
      store_rows(o, dv_vectors, f.out, b, h, i0, rows, i0 + rows, f.n.dv);
    }
  }, f.n.lq * f.n.lk <= kShortBlock ? short_units_grain(units) : 1);
}

template <typename T>
void backward_kernel(const Layout& layout, const at::Tensor& grad_out_, const float* grad_lse,
                     const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                     const at::Tensor& lse_, const KeyMask& mask, float scale,
                     const DropoutStream& drop, at::Tensor& dq_, at::Tensor& dk_,
                     at::Tensor& dv_) {
  const Shape& n = layout.n;
  const Rows<T> q = layout.queries_of<T>(q_), k = layout.keys_of<T>(k_),
                v = layout.keys_of<T>(v_), grad_out = layout.queries_of<T>(grad_out_);
  const float* lse = lse_.data_ptr<float>();
  const OutRows<T> dq = layout.query_outputs<T>(dq_), dk = layout.key_outputs<T>(dk_),
                   dv = layout.key_outputs<T>(dv_);
  const int64_t lkv = whole_vectors(n.lk), dvec = whole_vectors(n.d), dvvec = whole_vectors(n.dv);
  const int64_t units = n.batch * n.heads;
  run_workers([&](const auto& next) {
    // Workspace: K^T, K, V^T panels; Q and dO blocks; P and dP/dS blocks; bias, factors; dK
    // and dV accumulators; the dQ block.
    std::vector<float> work(n.d * lkv + n.lk * dvec + n.dv * lkv + kBlockM * (dvec + dvvec) +
                            2 * kBlockM * lkv + 2 * lkv + n.lk * (dvec + dvvec) +
                            kBlockM * dvec);
    float* kt = work.data();
    float* kb = kt + n.d * lkv;
    float* vt = kb + n.lk * dvec;
    float* qb = vt + n.dv * lkv;
    float* dob = qb + kBlockM * dvec;
    float* p = dob + kBlockM * dvvec;
    float* ds = p + kBlockM * lkv;
    float* bias = ds + kBlockM * lkv;
    float* factors = bias + lkv;
    float* dk_acc = factors + lkv;
    float* dv_acc = dk_acc + n.lk * dvec;
    float* dq_block = dv_acc + n.lk * dvvec;
    for (int64_t bh = next(); bh < units; bh = next()) {
      const int64_t b = bh / n.heads, h = bh % n.heads, key_end = mask.key_end[b];
      load_transposed(k, b, h, key_end, n.d, kt, lkv);
      load_rows(k, b, h, 0, key_end, n.d, kb, dvec);
      load_transposed(v, b, h, key_end, n.dv, vt, lkv);
      std::fill(dk_acc, dk_acc + key_end * dvec, 0.0f);
      std::fill(dv_acc, dv_acc + key_end * dvvec, 0.0f);
      mask.bias(b, bias, whole_vectors(key_end));
      const int64_t queries = layout.queries(b);
      for (int64_t i0 = 0; i0 < queries; i0 += kBlockM) {
        const int64_t rows = std::min(kBlockM, queries - i0);
        const int64_t keys = mask.keys_of_block(b, i0 + rows), width = whole_vectors(keys);
        if (keys == 0) {  // no query of the block sees a key: dQ = 0
          store_rows(dq_block, dvec, dq, b, h, i0, 0, i0 + rows, n.d);
          continue;
        }
        load_rows(q, b, h, i0, rows, n.d, qb, dvec);
        load_rows(grad_out, b, h, i0, rows, n.dv, dob, dvvec);
        gemm<T>(qb, dvec, 1, kt, lkv, n.d, p, lkv, rows, width, false);     // S
        gemm<T>(dob, dvvec, 1, vt, lkv, n.dv, ds, lkv, rows, width, false);  // dPd = dO V^T
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          float* p_row = p + r * lkv;
          float* ds_row = ds + r * lkv;
          const float lse_i = lse[layout.lse_index(b, h, i)];
          if (lse_i == -kInf) {  // sees no key: P = 0, dS = 0
            std::fill(p_row, p_row + width, 0.0f);
            std::fill(ds_row, ds_row + width, 0.0f);
            continue;
          }
          if (drop.active) dropout_row(drop, element_index(bh, i, n.lq, n.lk), factors, width);
          // P and dP = dPd * keep / (1 - p); delta_i = sum_j P_ij dP_ij, which equals dO_i . O_i
          // but is exact here in fp32 (O is rounded to the output dtype).
          Vec delta_sum = Vec{};
          for (int64_t c = 0; c < width; c += kLanes) {
            const Vec x = masked_scores(p_row, bias, c, i, scale, mask.causal);
            const Vec prob = x > -kInf ? vector_exp(x - lse_i) : Vec{};
            Vec dprob = load(ds_row + c);
            if (drop.active) dprob = dprob * load(factors + c);
            store(p_row + c, prob);
            store(ds_row + c, dprob);
            delta_sum += prob * dprob;
          }
          const float delta = horizontal_sum(delta_sum) -
                              (grad_lse == nullptr ? 0.0f : grad_lse[layout.lse_index(b, h, i)]);
          for (int64_t c = 0; c < width; c += kLanes) {
            const Vec prob = load(p_row + c);
            store(ds_row + c, prob * (load(ds_row + c) - delta) * scale);  // scale * dS
            if (drop.active) store(p_row + c, prob * load(factors + c));     // Pd
          }
        }
        gemm<T>(p, 1, lkv, dob, dvvec, rows, dv_acc, dvvec, keys, dvvec, true);  // dV += Pd^T dO
        gemm<T>(ds, 1, lkv, qb, dvec, rows, dk_acc, dvec, keys, dvec, true);     // dK += dS^T Q
        gemm<T>(ds, lkv, 1, kb, dvec, keys, dq_block, dvec, rows, dvec, false);  // dQ = dS K
        store_rows(dq_block, dvec, dq, b, h, i0, rows, i0 + rows, n.d);
      }
      const int64_t last = layout.key_rows_end(key_end);
      store_rows(dk_acc, dvec, dk, b, h, 0, key_end, last, n.d);
      store_rows(dv_acc, dvvec, dv, b, h, 0, key_end, last, n.dv);
    }
  });
}

// A sentence of up to kFewQueries tokens is attended by forward_few_queries' rows whatever the
// batch's longest (its keys, not the padded query count, decide): padded among longer sentences,
// or packed, it gets the same bits as alone (the two kernels sum in other orders).
template <typename T>
void run_forward(const Forward<T>& f, const at::Tensor& q, const at::Tensor& k) {
  if (f.n.lq <= kFewQueries && few_queries_fit(f.n)) {
    forward_few_queries(f);
  } else {
    forward_kernel(f, reads_words<T>(q, k));
  }
}

// cu_seqlens (B + 1,) as int64, checked to run from 0 to `rows` without decreasing, no sequence
// longer than `longest`: the kernels read through it unchecked.
at::Tensor checked_starts(const at::Tensor& cu_seqlens, int64_t rows, int64_t longest,
                          const char* name, const char* max_name) {
  check_cpu(cu_seqlens, name);
  const auto starts = cu_seqlens.to(at::kLong).contiguous();
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) >= 1, name, " must be 1-D (B + 1,)");
  const int64_t* values = starts.data_ptr<int64_t>();
  const int64_t batch = starts.size(0) - 1;
  TORCH_CHECK(values[0] == 0 && values[batch] == rows, name, " must run from 0 to ", rows,
              " (the packed rows), got ", values[0], " to ", values[batch]);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = values[b + 1] - values[b];
    TORCH_CHECK(length >= 0 && length <= longest, name, " must give lengths in [0, ", max_name,
                " = ", longest, "], got ", length, " for sequence ", b);
  }
  return starts;
}

}  // namespace

// The arguments of the Triton ops fastnmt::attention_forward / attention_backward, in their
// order, so that one autograd registration serves both backends.
std::tuple<at::Tensor, at::Tensor> attention_cpp(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const c10::optional<at::Tensor>& key_lengths,
    const c10::optional<at::Tensor>& key_padding_mask, const c10::optional<at::Tensor>& seed,
    bool causal, double dropout_p, double scale, const c10::optional<at::Tensor>& cache_rows) {
  check_cpu(q_in, "q");
  const auto q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
             v = last_dim_contiguous(v_in);
  const Shape n(q, v);
  // (B, H, Lq, Dv) lying (B, Lq, H, Dv) in memory, as FlashAttention's.
  auto out = at::empty({n.batch, n.lq, n.heads, n.dv}, q.options()).transpose(1, 2);
  auto lse = at::empty({n.batch, n.heads, n.lq}, q.options().dtype(at::kFloat));
  const KeyMask mask(key_lengths, key_padding_mask, n.batch, n.lk, causal);
  const DropoutStream drop(seed, dropout_p);
  const auto rows = checked_cache_rows(cache_rows, k.size(0));
  dispatch_float(q.scalar_type(), "attention_cpp", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_forward(Forward<T>(q, k, v, rows, mask, static_cast<float>(scale), drop, out, lse), q, k);
  });
  return {out, lse};
}

// A varlen call's packed layout: cu_seqlens checked (the kernels read through them unchecked),
// kept alive with the layout that points into them, and each sequence's key count.
struct PackedCall {
  at::Tensor query_starts, key_starts, key_lengths;  // initialised before the layout
  Layout layout;

  PackedCall(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
             int64_t max_seqlen_q, int64_t max_seqlen_k)
      : query_starts(checked_starts(cu_seqlens_q, q.size(0), max_seqlen_q, "cu_seqlens_q",
                                    "max_seqlen_q")),
        key_starts(checked_starts(cu_seqlens_k, k.size(0), max_seqlen_k, "cu_seqlens_k",
                                  "max_seqlen_k")),
        layout(Shape(query_starts.size(0) - 1, q.size(1), max_seqlen_q, max_seqlen_k, q.size(2),
                     v.size(2)),
               query_starts, key_starts, q.size(0)) {
    TORCH_CHECK(query_starts.size(0) == key_starts.size(0),
                "cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), got ",
                query_starts.size(0), " and ", key_starts.size(0));
    const int64_t batch = layout.n.batch;
    key_lengths = key_starts.narrow(0, 1, batch) - key_starts.narrow(0, 0, batch);
  }
};

// Packed sequences (FlashAttention's varlen layout): q (total_q, H, D), k (total_k, H, D), v
// (total_k, H, Dv); sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q,
// its keys those of cu_seqlens_k in k and v. Returns out (total_q, H, Dv) and the LSE (H,
// total_q). Dropout's element index of (b, h, i, j) is the padded op's with Lq and Lk the
// longest sequences' (attention_cpp_dropout_mask(seed, B, H, max_seqlen_q, max_seqlen_k, p)).
std::tuple<at::Tensor, at::Tensor> attention_varlen_cpp(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const c10::optional<at::Tensor>& seed, bool causal, double dropout_p,
    double scale) {
  check_cpu(q_in, "q");
  const auto q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
             v = last_dim_contiguous(v_in);
  const PackedCall call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const Shape& n = call.layout.n;
  auto out = at::empty({q.size(0), n.heads, n.dv}, q.options());
  auto lse = at::empty({n.heads, q.size(0)}, q.options().dtype(at::kFloat));
  const KeyMask mask(call.key_lengths, c10::nullopt, n.batch, n.lk, causal);
  const DropoutStream drop(seed, dropout_p);
  dispatch_float(q.scalar_type(), "attention_varlen_cpp", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto scale_ = static_cast<float>(scale);
    run_forward(Forward<T>(call.layout, q, k, v, mask, scale_, drop, out, lse), q, k);
  });
  return {out, lse};
}

// Gradients of attention_varlen_cpp's (out, lse), each laid out as its input (packed); `out` is
// not read, as in attention_cpp_backward (the arguments of the Triton op's, in their order).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_cpp_backward(
    const at::Tensor& grad_out_in, const c10::optional<at::Tensor>& grad_lse,
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& /*out*/, const at::Tensor& lse_in, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    const c10::optional<at::Tensor>& seed, bool causal, double dropout_p, double scale) {
  check_cpu(grad_out_in, "grad_out");
  const auto q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
             v = last_dim_contiguous(v_in),
             grad_out = last_dim_contiguous(grad_out_in.to(q_in.scalar_type()));
  const PackedCall call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const auto lse = lse_in.to(at::kFloat).contiguous();
  at::Tensor grad_lse_values;
  if (grad_lse.has_value()) grad_lse_values = grad_lse->to(at::kFloat).contiguous();
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const KeyMask mask(call.key_lengths, c10::nullopt, call.layout.n.batch, call.layout.n.lk,
                     causal);
  const DropoutStream drop(seed, dropout_p);
  dispatch_float(q.scalar_type(), "attention_varlen_cpp_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_kernel<T>(call.layout, grad_out,
                       grad_lse.has_value() ? grad_lse_values.data_ptr<float>() : nullptr, q, k,
                       v, lse, mask, static_cast<float>(scale), drop, dq, dk, dv);
  });
  return {dq, dk, dv};
}

// `out` is not read: delta_i = sum_j P_ij dP_ij is computed from P, exactly in fp32, rather than
// as dO_i . O_i from the output rounded to its dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_cpp_backward(
    const at::Tensor& grad_out_in, const c10::optional<at::Tensor>& grad_lse,
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& /*out*/, const at::Tensor& lse_in,
    const c10::optional<at::Tensor>& key_lengths,
    const c10::optional<at::Tensor>& key_padding_mask, const c10::optional<at::Tensor>& seed,
    bool causal, double dropout_p, double scale) {
  check_cpu(grad_out_in, "grad_out");
  const auto q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
             v = last_dim_contiguous(v_in),
             grad_out = last_dim_contiguous(grad_out_in.to(q_in.scalar_type()));
  const auto lse = lse_in.to(at::kFloat).contiguous();
  at::Tensor grad_lse_values;
  if (grad_lse.has_value()) grad_lse_values = grad_lse->to(at::kFloat).contiguous();
  const Shape n(q, v);
  // Dense in each input's dimension order (at::empty_like, as SDPA's): the gradient of
  // proj(h).view(B, L, H, D).transpose(1, 2) then reaches proj's output without a copy.
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const KeyMask mask(key_lengths, key_padding_mask, n.batch, n.lk, causal);
  const DropoutStream drop(seed, dropout_p);
  dispatch_float(q.scalar_type(), "attention_cpp_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_kernel<T>(Layout(n), grad_out,
                       grad_lse.has_value() ? grad_lse_values.data_ptr<float>() : nullptr, q, k,
                       v, lse, mask, static_cast<float>(scale), drop, dq, dk, dv);
  });
  return {dq, dk, dv};
}

// keep_ij (bool (B, H, Lq, Lk)) that the kernels draw for `seed`: for tests and debugging.
at::Tensor attention_cpp_dropout_mask(const at::Tensor& seed, int64_t batch, int64_t heads,
                                      int64_t lq, int64_t lk, double dropout_p) {
  const DropoutStream drop(seed, dropout_p);
  auto keep = at::ones({batch, heads, lq, lk}, at::kBool);
  if (!drop.active) return keep;
  bool* data = keep.data_ptr<bool>();
  for (int64_t bh = 0; bh < batch * heads; ++bh)
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j)
        data[(bh * lq + i) * lk + j] =
            drop.factor(element_index(bh, i, lq, lk) + static_cast<uint32_t>(j)) != 0.0f;
  return keep;
}

namespace {

// Autograd in C++ (see add_layer_norm.cpp): the gradients of attention.py's _make_backward.
// A hand-made autograd node (common.h: make_node); out and lse are both differentiable (a
// caller may use the LSE), saved as outputs of this node.
struct AttentionBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable q, k, v, out, lse, key_lengths, key_padding_mask, seed;
  bool causal = false;
  double dropout_p = 0.0, scale = 1.0;

  std::string name() const override { return "AttentionBackward"; }

  void release_variables() override {
    for (auto* saved : {&q, &k, &v, &out, &lse, &key_lengths, &key_padding_mask, &seed}) {
      saved->reset_data();
    }
  }

  // grads: those of (out, lse); undefined where nothing flowed back (an unused LSE).
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    static const auto op =
        registered_op<decltype(attention_cpp_backward)>("fastnmt::attention_cpp_backward");
    const auto self = self_pointer(this);
    const auto out_ = out.unpack(self);
    const auto grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out_);  // LSE only
    auto [dq, dk, dv] = op.call(grad_out, present(grads[1]), q.unpack(), k.unpack(), v.unpack(),
                                out_, lse.unpack(self), present(key_lengths.unpack()),
                                present(key_padding_mask.unpack()), present(seed.unpack()),
                                causal, dropout_p, scale);
    return {dq, dk, dv};
  }
};

std::tuple<at::Tensor, at::Tensor> attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& key_lengths,
    const c10::optional<at::Tensor>& key_padding_mask, const c10::optional<at::Tensor>& seed,
    bool causal, double dropout_p, double scale, const c10::optional<at::Tensor>& cache_rows) {
  static const auto op = registered_op<decltype(attention_cpp)>("fastnmt::attention_cpp");
  auto result = call_below_autograd(op, q, k, v, key_lengths, key_padding_mask, seed, causal,
                                    dropout_p, scale, cache_rows);
  if (!torch::autograd::compute_requires_grad(q, k, v)) return result;  // decoding
  auto& [out, lse] = result;
  auto& backward = record_node<AttentionBackward>({out, lse}, q, k, v);
  backward.q = torch::autograd::SavedVariable(q, false);
  backward.k = torch::autograd::SavedVariable(k, false);
  backward.v = torch::autograd::SavedVariable(v, false);
  backward.out = torch::autograd::SavedVariable(out, true);
  backward.lse = torch::autograd::SavedVariable(lse, true);
  backward.key_lengths = torch::autograd::SavedVariable(key_lengths.value_or(at::Tensor()), false);
  backward.key_padding_mask =
      torch::autograd::SavedVariable(key_padding_mask.value_or(at::Tensor()), false);
  backward.seed = torch::autograd::SavedVariable(seed.value_or(at::Tensor()), false);
  backward.causal = causal;
  backward.dropout_p = dropout_p;
  backward.scale = scale;
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastnmt, m) {
  m.def(
      "attention_cpp(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, "
      "Tensor? key_padding_mask, Tensor? seed, bool causal, float dropout_p, float scale, "
      "Tensor? cache_rows) -> (Tensor, Tensor)");
  m.def(
      "attention_cpp_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, Tensor? key_lengths, Tensor? key_padding_mask, Tensor? seed, "
      "bool causal, float dropout_p, float scale) -> (Tensor, Tensor, Tensor)");
  m.def(
      "attention_varlen_cpp(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, Tensor? seed, bool causal, "
      "float dropout_p, float scale) -> (Tensor, Tensor)");
  m.def(
      "attention_varlen_cpp_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, "
      "Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, Tensor? seed, bool causal, float dropout_p, "
      "float scale) -> (Tensor, Tensor, Tensor)");
  m.def(
      "attention_cpp_dropout_mask(Tensor seed, int batch, int heads, int lq, int lk, "
      "float dropout_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastnmt, CPU, m) {
  m.impl("attention_cpp", &attention_cpp);
  m.impl("attention_cpp_backward", &attention_cpp_backward);
  m.impl("attention_cpp_dropout_mask", &attention_cpp_dropout_mask);
  m.impl("attention_varlen_cpp", &attention_varlen_cpp);
  m.impl("attention_varlen_cpp_backward", &attention_varlen_cpp_backward);
}

TORCH_LIBRARY_IMPL(fastnmt, Autograd, m) { m.impl("attention_cpp", &attention_autograd); }

}  // namespace fastnmt
