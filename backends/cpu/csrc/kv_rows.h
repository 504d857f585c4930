#pragma once
// The rows of a quantized KV cache (--kv-cache-dtype int8, fp8_e4m3fn, fp8_e5m2), as
// core/kv/quantized.py defines them: for every token and KV head, head_dim one-byte codes and
// then the 4 bytes of a float32 scale; value = code * scale. The cache tensor's dtype (int8,
// float8_e4m3fn or float8_e5m2) names the format.
//
// quantize_row writes the bytes quantize_rows writes (decode_layers.cpp's cache writes; a test
// compares them): amax = max |x| in float32, scale = amax / kMax, code = x * (kMax / amax)
// rounded to nearest (ties to even: nearbyint; float8: c10's conversion, torch's own) and
// clamped to +-kMax. paged_decode.h reads rows with code_to_float and row_scale, and its vector
// loop with vec16::load of the codes.
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kv_rows {

constexpr int64_t kScaleBytes = 4;  // a float32 after each row's codes

// What a cache element type stores: a value itself (float, bfloat16), or a quantized row's code.
template <typename C>
struct Format {
  static constexpr bool kQuantized = false;
};
template <>
struct Format<int8_t> {
  static constexpr bool kQuantized = true;
  static constexpr float kMax = 127.0f;
};
template <>
struct Format<c10::Float8_e4m3fn> {
  static constexpr bool kQuantized = true;
  static constexpr float kMax = 448.0f;
};
template <>
struct Format<c10::Float8_e5m2> {
  static constexpr bool kQuantized = true;
  static constexpr float kMax = 57344.0f;
};

inline bool is_quantized(at::ScalarType type) {
  return type == at::kChar || type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
}

// Calls f with a value of the code type of a quantized cache's dtype.
template <typename F>
void visit_quantized(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kChar: f(int8_t{}); break;
    case at::kFloat8_e4m3fn: f(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: f(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "not a quantized KV cache dtype: ", type);
  }
}

inline float code_to_float(float x) { return x; }
inline float code_to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float code_to_float(int8_t x) { return static_cast<float>(x); }
inline float code_to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float code_to_float(c10::Float8_e5m2 x) { return static_cast<float>(x); }

// The scale of a row whose head_dim codes start at `row`.
template <typename C>
inline float row_scale(const C* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, reinterpret_cast<const char*>(row + head_dim), sizeof scale);
  return scale;
}

// x [head_dim] -> the row at `out`: its codes, then its scale.
template <typename C, typename T>
inline void quantize_row(const T* x, int64_t head_dim, C* out) {
  constexpr float kMax = Format<C>::kMax;
  float amax = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = amax / kMax;
  const float inverse = amax > 0.0f ? kMax / amax : 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float y = static_cast<float>(x[d]) * inverse;
    if constexpr (std::is_same_v<C, int8_t>) {
      out[d] = static_cast<int8_t>(std::clamp(std::nearbyint(y), -kMax, kMax));
    } else {
      out[d] = C(std::clamp(y, -kMax, kMax));
    }
  }
  std::memcpy(reinterpret_cast<char*>(out + head_dim), &scale, sizeof scale);
}

}  // namespace kv_rows
