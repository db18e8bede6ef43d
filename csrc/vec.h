// fp32 vectors (GCC/Clang vector extensions) and the few vector functions the kernels share:
// loads/stores, horizontal reductions and a polynomial exp. The extension is compiled for the CPU
// that runs it (setup.py), so one Vec is one register: 16 lanes with AVX-512, else 8 (AVX2; a
// 16-lane vector split in two there spilled to the stack and ran the kernels 2-5x slower).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace fastnmt {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif

typedef float Vec __attribute__((vector_size(4 * kLanes)));
typedef int32_t IntVec __attribute__((vector_size(4 * kLanes)));
constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t whole_vectors(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof v); }

// 16 values of any kernel dtype as fp32 lanes, and back (bf16 rounds to nearest even, as
// c10::BFloat16 does; NaN payloads are not preserved). The bf16 paths are integer shifts the
// compiler keeps in vector registers; fp16 goes through c10::Half lane by lane (F16C).
template <typename T>
inline Vec load_float(const T* p) {
  Vec v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}

template <>
inline Vec load_float(const float* p) { return load(p); }

template <>
inline Vec load_float(const int32_t* p) {
  IntVec v;
  __builtin_memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, Vec);
}

typedef uint16_t HalfWordVec __attribute__((vector_size(2 * kLanes)));
typedef uint32_t WordVec __attribute__((vector_size(4 * kLanes)));

template <>
inline Vec load_float(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  // One widening load each: GCC compiles the vector-extension form below into several (six on
  // AVX-512: it splits the vector into halves).
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<Vec>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(__AVX2__)
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  HalfWordVec bits;
  __builtin_memcpy(&bits, p, sizeof bits);
  const WordVec widened = __builtin_convertvector(bits, WordVec) << 16;
  Vec v;
  __builtin_memcpy(&v, &widened, sizeof v);
  return v;
#endif
}

template <typename T>
inline void store_float(T* p, Vec v) {
  for (int l = 0; l < kLanes; ++l) p[l] = static_cast<T>(v[l]);
}

template <>
inline void store_float(float* p, Vec v) { store(p, v); }

inline HalfWordVec bf16_rounded(Vec v) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // One instruction (the integer form below is six): the same bits, except that it quiets NaNs
  // and flushes fp32 denormals (below 1.2e-38) to zero.
  return reinterpret_cast<HalfWordVec>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v)));
#else
  WordVec bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  bits += 0x7fffU + ((bits >> 16) & 1U);
  return __builtin_convertvector(bits >> 16, HalfWordVec);
#endif
}

template <>
inline void store_float(c10::BFloat16* p, Vec v) {
  const HalfWordVec rounded = bf16_rounded(v);
  __builtin_memcpy(p, &rounded, sizeof rounded);
}

// v as a T holds it (rounded to T's precision), with no round trip through memory.
template <typename T>
inline Vec as_stored(Vec v) {
  T lanes[kLanes];
  store_float(lanes, v);
  return load_float(lanes);
}

template <>
inline Vec as_stored<float>(Vec v) { return v; }

template <>
inline Vec as_stored<c10::BFloat16>(Vec v) {
#if defined(__AVX512F__)
  // One widening instruction (GCC splits the vector-extension form below into halves).
  const auto bits = reinterpret_cast<__m256i>(bf16_rounded(v));
  return reinterpret_cast<Vec>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
  const WordVec widened = __builtin_convertvector(bf16_rounded(v), WordVec) << 16;
  Vec out;
  __builtin_memcpy(&out, &widened, sizeof out);
  return out;
#endif
}

// 2 kLanes bf16 values in one load, as the values of the even elements and of the odd ones: word l
// holds elements 2l and 2l + 1 as the high halves of two fp32 lanes, so shifts and masks split
// them, where load_float widens each vector with a shuffle. For kernels whose order of elements
// is free (sums, maxima) or restored at once (quantize_rows' bytes).
inline void load_pairs(const c10::BFloat16* p, Vec& even, Vec& odd) {
  WordVec bits;
  __builtin_memcpy(&bits, p, sizeof bits);
  const WordVec low = bits << 16, high = bits & 0xffff0000U;
  __builtin_memcpy(&even, &low, sizeof even);
  __builtin_memcpy(&odd, &high, sizeof odd);
}

// The first n (< kLanes: the tail of a row) values of p, the other lanes 0; and the first n lanes
// of v stored to p.
template <typename T>
inline Vec load_float(const T* p, int64_t n) {
  if (n == kLanes) return load_float(p);
  T lanes[kLanes] = {};
  std::copy(p, p + n, lanes);
  return load_float(lanes);
}

template <typename T>
inline void store_float(T* p, Vec v, int64_t n) {
  if (n == kLanes) return store_float(p, v);
  T lanes[kLanes];
  store_float(lanes, v);
  std::copy(lanes, lanes + n, p);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// fp32 and bf16 tails in one masked instruction each (lanes past n are neither read nor written,
// so a tail at the end of an allocation is safe); a copy through the stack costs a row's worth
// on short rows (attention over 20 keys). Whole vectors stay plain loads and stores: a masked
// store does not forward to the load after it (add_layer_norm's rows ran 1.7x slower).
inline __mmask16 lane_mask(int64_t n) { return static_cast<__mmask16>((1U << n) - 1U); }

template <>
inline Vec load_float(const float* p, int64_t n) {
  if (n == kLanes) return load(p);
  return reinterpret_cast<Vec>(_mm512_maskz_loadu_ps(lane_mask(n), p));
}

template <>
inline Vec load_float(const c10::BFloat16* p, int64_t n) {
  if (n == kLanes) return load_float(p);
  const __m256i bits = _mm256_maskz_loadu_epi16(lane_mask(n), p);
  return reinterpret_cast<Vec>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <>
inline void store_float(float* p, Vec v, int64_t n) {
  if (n == kLanes) return store(p, v);
  _mm512_mask_storeu_ps(p, lane_mask(n), reinterpret_cast<__m512>(v));
}

template <>
inline void store_float(c10::BFloat16* p, Vec v, int64_t n) {
  if (n == kLanes) return store_float(p, v);
  _mm256_mask_storeu_epi16(p, lane_mask(n), reinterpret_cast<__m256i>(bf16_rounded(v)));
}
#endif

inline Vec splat(float x) { return Vec{} + x; }

inline WordVec word_lane_indices() {
  WordVec v;
  for (int l = 0; l < kLanes; ++l) v[l] = l;  // folded to a constant
  return v;
}

inline Vec lane_indices() { return __builtin_convertvector(word_lane_indices(), Vec); }

// The two halves of a vector, for reductions as trees (a chain of scalar operations costs one
// latency per lane; a decoding step reduces once per key).
template <typename Half, typename Whole>
inline void halves(Whole v, Half& low, Half& high) {
  __builtin_memcpy(&low, &v, sizeof low);
  __builtin_memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
}

// The lanes of a vector of 4 or more, reduced with op as a tree.
template <typename V, typename Op>
inline float reduce_tree(V v, Op op) {
  if constexpr (sizeof(V) == 4 * sizeof(float)) {
    return op(op(v[0], v[2]), op(v[1], v[3]));
  } else {
    typedef float Half __attribute__((vector_size(sizeof(V) / 2)));
    Half low, high;
    halves(v, low, high);
    return reduce_tree(op(low, high), op);
  }
}

inline float horizontal_max(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  return reduce_tree(v, [](auto a, auto b) { return a > b ? a : b; });
#endif
}

// Bit l set where lane l of v is greater than x (one mask compare on AVX-512).
inline uint32_t greater_mask(Vec v, float x) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(v), _mm512_set1_ps(x), _CMP_GT_OQ);
#elif defined(__AVX2__)
  const __m256 greater = _mm256_cmp_ps(reinterpret_cast<__m256>(v), _mm256_set1_ps(x), _CMP_GT_OQ);
  return static_cast<uint32_t>(_mm256_movemask_ps(greater));
#else
  uint32_t mask = 0;
  for (int l = 0; l < kLanes; ++l) mask |= static_cast<uint32_t>(v[l] > x) << l;
  return mask;
#endif
}

inline float horizontal_sum(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));  // a tree of shuffles
#else
  return reduce_tree(v, [](auto a, auto b) { return a + b; });
#endif
}

// c0 x^k + c1 x^(k-1) + ... + ck by Horner's rule, one multiply-add a coefficient.
template <typename... Coefficients>
inline Vec horner(Vec x, float c0, Coefficients... rest) {
  Vec p = splat(c0);
  ((p = p * x + rest), ...);
  return p;
}

// p * 2^n for integral n: on AVX-512 in one instruction, for any n (2^n overflows to inf and
// underflows to 0 as p * 2^n does); elsewhere n must lie within the normal exponents.
inline Vec times_power_of_two(Vec p, Vec n) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(
      _mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#else
  const IntVec exponent = (__builtin_convertvector(n, IntVec) + 127) << 23;  // 2^n
  Vec two_n;
  __builtin_memcpy(&two_n, &exponent, sizeof two_n);
  return p * two_n;
#endif
}

// exp(x) (Cephes' expf polynomial after x = n ln2 + r, |r| <= ln2 / 2; ~2 ulp). x is clamped to
// [-87.3, 88]: exp(-inf) gives ~1e-38, so callers select 0 for hidden keys themselves.
inline Vec vector_exp(Vec x) {
  x = x < -87.3f ? splat(-87.3f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const Vec round = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds
  const Vec n = (x * 1.44269504088896341f + round) - round;
  const Vec r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  Vec p = horner(r, 1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                 1.6666665459e-1f, 5.0000001201e-1f);
  p = p * r * r + r + 1.0f;
  return times_power_of_two(p, n);
}

// log(x) for normal x > 0 (Cephes' logf polynomial after x = 2^e m, m in [sqrt(1/2), sqrt(2));
// ~2 ulp).
inline Vec vector_log(Vec x) {
#if defined(__AVX512F__)
  const __m512 v = reinterpret_cast<__m512>(x);
  Vec e = reinterpret_cast<Vec>(_mm512_getexp_ps(v));  // floor(log2(x))
  Vec m = reinterpret_cast<Vec>(_mm512_getmant_ps(v, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src));
#else
  WordVec bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  Vec e = __builtin_convertvector(reinterpret_cast<IntVec>(bits >> 23) - 127, Vec);
  const WordVec mantissa = (bits & 0x7fffffU) | 0x3f800000U;  // m in [1, 2)
  Vec m;
  __builtin_memcpy(&m, &mantissa, sizeof m);
#endif
  const auto above = m > 1.41421356f;  // m / 2 and e + 1 there: m in [sqrt(1/2), sqrt(2))
  m = above ? m * 0.5f : m;
  e = above ? e + 1.0f : e;
  const Vec r = m - 1.0f;
  const Vec p = horner(r, 7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f,
                       -1.2420140846e-1f, 1.4249322787e-1f, -1.6668057665e-1f, 2.0000714765e-1f,
                       -2.4999993993e-1f, 3.3333331174e-1f);
  const Vec z = r * r;
  return (r * z * p - 0.5f * z + r) + e * 0.693147180559945f;
}

// 2^x = 2^n p(f) after x = n + f, |f| <= 1/2, p a polynomial approximating 2^f: for sums of
// exponentials whose exponent takes one multiply-add: exp(s (x - g)) = 2^(a x - a g), a = s
// log2(e) (seven vector operations fewer than vector_exp's rounding and two-constant reduction).
// On AVX-512 x needs no clamp (scalef takes any n: 2^n overflows to inf, underflows to 0);
// elsewhere it is clamped to [-126, 127].
template <typename Polynomial>
inline Vec exp2_of(Vec x, Polynomial p) {
#if defined(__AVX512F__)
  const Vec n = reinterpret_cast<Vec>(_mm512_roundscale_ps(
      reinterpret_cast<__m512>(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  x = x < -126.0f ? splat(-126.0f) : x;
  x = x > 127.0f ? splat(127.0f) : x;
  const Vec round = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds
  const Vec n = (x + round) - round;
#endif
  return times_power_of_two(p(x - n), n);
}

// 2^x (Cephes' exp2f polynomial, degree 6; ~2 ulp).
inline Vec vector_exp2(Vec x) {
  return exp2_of(x, [](Vec f) {
    return horner(f, 1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                  5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f);
  });
}

// 2^x with a polynomial of degree 5 (a minimax fit, relative error 2.3e-7, ~3 ulp): one
// multiply-add fewer, for the terms of a sum of thousands (a row's partition function over the
// vocabulary), whose own rounding is larger.
inline Vec vector_exp2_term(Vec x) {
  return exp2_of(x, [](Vec f) {
    return horner(f, 1.3278165e-3f, 9.675556e-3f, 5.5507079e-2f, 2.4022119e-1f, 6.9314694e-1f,
                  1.0000001f);
  });
}

}  // namespace fastnmt
