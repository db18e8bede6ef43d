// A row of logits in an fp32 buffer, its softmax's normaliser and its best columns: the pieces
// the row kernels of decoding share (log_softmax_topk.cpp, sample_token.cpp).
#pragma once

#include "vec.h"

#include <algorithm>
#include <cmath>

namespace fastnmt {

// The best k (value, index) pairs seen, best first; among equal values the lower index first.
class TopK {
 public:
  TopK(float* values, int64_t* indices, int64_t k) : values_(values), indices_(indices), k_(k) {}

  // The value a candidate must beat (strictly) to enter; -inf admits only while not full.
  float threshold() const { return size_ < k_ ? -kInf : values_[k_ - 1]; }

  // Offer candidates in increasing index order.
  void offer(float value, int64_t index) {
    if (size_ == k_ && !(value > values_[k_ - 1])) return;
    int64_t position = std::min(size_, k_ - 1);
    while (position > 0 && values_[position - 1] < value) {  // strict: ties keep the earlier
      values_[position] = values_[position - 1];
      indices_[position] = indices_[position - 1];
      --position;
    }
    values_[position] = value;
    indices_[position] = index;
    size_ = std::min(size_ + 1, k_);
  }

  int64_t capacity() const { return k_; }
  int64_t size() const { return size_; }

 private:
  float* values_;
  int64_t* indices_;
  int64_t k_;
  int64_t size_ = 0;
};

// Row row (V logits) times `scale` (an int8 GEMM's row scale: its output rows come unscaled;
// 1 is exact) -> x (fp32, whole vectors; the padding lanes -inf), returning its max.
template <typename T>
inline float load_row(const T* row, int64_t vocab, int64_t padded, float* x, float scale = 1.0f) {
  Vec running_max = splat(-kInf);
  for (int64_t j = 0; j < padded; j += kLanes) {
    const int64_t n = std::min(kLanes, vocab - j);
    const Vec v = (n == kLanes ? load_float(row + j) : load_float(row + j, n)) * scale;
    store(x + j, v);
    running_max = v > running_max ? v : running_max;
  }
  std::fill(x + vocab, x + padded, -kInf);  // the tail lanes were loaded as 0
  const float row_max = horizontal_max(running_max);
  // a tail 0 may have been the max
  return vocab < padded ? *std::max_element(x, x + vocab) : row_max;
}

// Sets the banned columns of x to -inf and returns the sum of their exp(x - row_max), which stays
// in the normaliser. A repeated id adds nothing the second time (its column is -inf by then).
inline float ban(float* x, const int64_t* banned, int64_t banned_count, float row_max) {
  float total = 0.0f;
  for (int64_t b = 0; b < banned_count; ++b) {
    float& value = x[banned[b]];
    if (value > -kInf) total += std::exp(value - row_max);
    value = -kInf;
  }
  return total;
}

// The whole vectors holding the first k columns: all offered, whatever they hold.
inline int64_t offered_head(int64_t padded, const TopK& top) {
  return std::min(padded, whole_vectors(top.capacity()));
}

// Offers the lanes of v (columns j...) above the k-th best (never a padding lane: -inf beats
// nothing once full): a vector none of whose lanes does is skipped with one compare.
inline void offer_vector(const float* x, Vec v, int64_t j, TopK& top) {
  for (uint32_t mask = greater_mask(v, top.threshold()); mask; mask &= mask - 1) {
    const int l = __builtin_ctz(mask);
    top.offer(x[j + l], j + l);
  }
}

// sum exp(x - row_max) over x's columns (row_max finite) and (top not null) their top k (best
// first) offered to top, in one pass; (exps not null) each column's exp written there. A -inf
// column adds vector_exp's floor, 1.2e-38: nothing next to the row max's 1, so no select keeps
// it out.
inline float exp_sum_and_top(const float* x, int64_t vocab, int64_t padded, float row_max,
                             TopK* top, float* exps = nullptr) {
  const int64_t head = top ? offered_head(padded, *top) : 0;
  for (int64_t j = 0; j < std::min(head, vocab); ++j) top->offer(x[j], j);
  Vec total = splat(0.0f);
  for (int64_t j = 0; j < padded; j += kLanes) {
    const Vec v = load(x + j);
    const Vec e = vector_exp(v - row_max);
    total += e;
    if (exps) store(exps + j, e);
    if (top && j >= head) offer_vector(x, v, j, *top);
  }
  return horizontal_sum(total);
}

}  // namespace fastnmt
