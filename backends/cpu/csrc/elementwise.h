#pragma once
// The elementwise steps of a decoder layer (decode_layers.cpp), one row at a time, rounded as
// the eager layers round (core/layers): in bfloat16 each torch op's result is rounded to
// bfloat16, so the same intermediate results are rounded here (`Round<T>`); in float32
// nothing is. With AVX-512 rows are processed 16 values a register (the load/exp helpers are
// paged_decode_avx512.h's), with a scalar loop for the rest of a row; without, scalar loops.
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include "paged_decode_avx512.h"
#endif

namespace {
namespace elementwise {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

#if defined(__AVX512F__)
using paged_decode_avx512::exp16;
using paged_decode_avx512::load16;

// float32 -> bfloat16 bits, round to nearest even (NaN stays NaN: quiet bit set).
inline __m256i to_bf16_bits(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}

template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
  }
}
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 0;  // no vector loop: every value through the scalar tail
#endif

// Values [0, vector_end) go 16 at a time, the rest one at a time.
inline int64_t vector_end(int64_t n) { return kLanes ? n - n % 16 : 0; }

// h = T(h + delta) (delta may be null), then out = T(weight * T(h * rsqrt(mean(h^2) + eps))).
template <typename T>
void add_rms_norm_row(T* h, const T* delta, const T* weight, T* out, int64_t n, float eps) {
  const int64_t vn = vector_end(n);
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < vn; j += 16) {
    __m512 v = load16(h + j);
    if (delta != nullptr) {
      v = round16<T>(_mm512_add_ps(v, load16(delta + j)));
      store16(h + j, v);
    }
    sums = _mm512_fmadd_ps(v, v, sums);
  }
  sum = _mm512_reduce_add_ps(sums);
#endif
  for (int64_t j = vn; j < n; ++j) {
    if (delta != nullptr) h[j] = static_cast<T>(load(h[j]) + load(delta[j]));
    sum += load(h[j]) * load(h[j]);
  }
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#if defined(__AVX512F__)
  const __m512 inv = _mm512_set1_ps(inverse);
  for (int64_t j = 0; j < vn; j += 16) {
    store16(out + j, _mm512_mul_ps(load16(weight + j), round16<T>(_mm512_mul_ps(load16(h + j), inv))));
  }
#endif
  for (int64_t j = vn; j < n; ++j) out[j] = static_cast<T>(load(weight[j]) * round_to<T>(load(h[j]) * inverse));
}

// x = T(T(x * cos) + T(roll(x, rot / 2) * signed_sin)) over the first `rot` values of one head
// (core/layers/rotary.py: roll(x, half) is [x_hi, x_lo]; the sign of sin is in the table).
template <typename T>
void rotary_head(T* x, const T* cos, const T* sin, int64_t rot) {
  const int64_t half = rot / 2;
  float lo[256], hi[256];
  for (int64_t d = 0; d < half; ++d) lo[d] = load(x[d]), hi[d] = load(x[d + half]);
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= half; d += 16) {
    const __m512 l = _mm512_loadu_ps(lo + d), u = _mm512_loadu_ps(hi + d);
    const __m512 new_lo = _mm512_add_ps(round16<T>(_mm512_mul_ps(l, load16(cos + d))),
                                        round16<T>(_mm512_mul_ps(u, load16(sin + d))));
    const __m512 new_hi = _mm512_add_ps(round16<T>(_mm512_mul_ps(u, load16(cos + half + d))),
                                        round16<T>(_mm512_mul_ps(l, load16(sin + half + d))));
    store16(x + d, new_lo);
    store16(x + half + d, new_hi);
  }
#endif
  for (; d < half; ++d) {
    x[d] = static_cast<T>(round_to<T>(lo[d] * load(cos[d])) + round_to<T>(hi[d] * load(sin[d])));
    x[d + half] = static_cast<T>(round_to<T>(hi[d] * load(cos[d + half])) + round_to<T>(lo[d] * load(sin[d + half])));
  }
}

// out = T(T(silu(gate)) * up) for one row of n values.
template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  const int64_t vn = vector_end(n);
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < vn; j += 16) {
    const __m512 g = load16(gate + j);
    const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    store16(out + j, _mm512_mul_ps(silu, load16(up + j)));
  }
#endif
  for (int64_t j = vn; j < n; ++j) {
    const float g = load(gate[j]);
    out[j] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * load(up[j]));
  }
}

}  // namespace elementwise
}  // namespace
