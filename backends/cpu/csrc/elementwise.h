#pragma once
// The elementwise steps of a decoder layer (decode_layers.cpp), one row at a time, rounded as
// the eager layers round (core/layers): in bfloat16 each torch op's result is rounded to
// bfloat16, so the same intermediate results are rounded here (`round_to<T>`); in float32
// nothing is. Where vec16.h has 16-lane vectors (AVX-512 or AVX2), rows are processed 16
// values at a time, with a scalar loop for the rest of a row; elsewhere, scalar loops.
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec16.h"

namespace {
namespace elementwise {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

#if defined(SY_VEC16)
using vec16::V;
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
#if defined(SY_VEC16)
  V sums = vec16::zero();
  for (int64_t j = 0; j < vn; j += 16) {
    V v = vec16::load(h + j);
    if (delta != nullptr) {
      v = vec16::round_to<T>(vec16::add(v, vec16::load(delta + j)));
      vec16::store(h + j, v);
    }
    sums = vec16::fmadd(v, v, sums);
  }
  sum = vec16::reduce_add(sums);
#endif
  for (int64_t j = vn; j < n; ++j) {
    if (delta != nullptr) h[j] = static_cast<T>(load(h[j]) + load(delta[j]));
    sum += load(h[j]) * load(h[j]);
  }
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#if defined(SY_VEC16)
  const V inv = vec16::set1(inverse);
  for (int64_t j = 0; j < vn; j += 16) {
    vec16::store(out + j, vec16::mul(vec16::load(weight + j), vec16::round_to<T>(vec16::mul(vec16::load(h + j), inv))));
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
#if defined(SY_VEC16)
  for (; d + 16 <= half; d += 16) {
    const V l = vec16::load(lo + d), u = vec16::load(hi + d);
    const V new_lo = vec16::add(vec16::round_to<T>(vec16::mul(l, vec16::load(cos + d))),
                                 vec16::round_to<T>(vec16::mul(u, vec16::load(sin + d))));
    const V new_hi = vec16::add(vec16::round_to<T>(vec16::mul(u, vec16::load(cos + half + d))),
                                 vec16::round_to<T>(vec16::mul(l, vec16::load(sin + half + d))));
    vec16::store(x + d, new_lo);
    vec16::store(x + half + d, new_hi);
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
#if defined(SY_VEC16)
  const V one = vec16::set1(1.0f);
  for (int64_t j = 0; j < vn; j += 16) {
    const V g = vec16::load(gate + j);
    const V silu = vec16::round_to<T>(vec16::div(g, vec16::add(one, vec16::exp(vec16::sub(vec16::zero(), g)))));
    vec16::store(out + j, vec16::mul(silu, vec16::load(up + j)));
  }
#endif
  for (int64_t j = vn; j < n; ++j) {
    const float g = load(gate[j]);
    out[j] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * load(up[j]));
  }
}

}  // namespace elementwise
}  // namespace
