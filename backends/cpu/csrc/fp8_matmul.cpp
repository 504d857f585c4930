// Weight-only float8 e4m3 matmul: out = x W^T for a few rows x [M, K] (float32 or bfloat16) and
// W [N, K] kept as its float8 bytes (1 byte a weight) with float32 scales [N, G], one per row and
// group of K / G columns (per channel: G = 1; 128x128 blocks: G = K / 128, each row carrying its
// block row's scales; core/quant/scaled.py "fp8_e4m3"). Each group of weights is dequantized in
// registers (w = fp8 * scale) and multiplied in float32: no float copy of W is made. The sums are
// float32, each output rounded once to x's dtype.
//
// An e4m3fn byte s.eeee.mmm read as the fp16 bits s.0eeee.mmm0000000 is its value / 2^8 (fp16's
// exponent bias 15 against e4m3's 7), subnormals included, so 16 bytes become 16 floats with a
// sign-extending widening, a shift, a mask and one F16C conversion; the 2^8 is folded into the
// group's scale. The NaN bytes 0x7F / 0xFF (never in weights) read as +-480. Without vec16 (no AVX2), a
// portable loop reads the same values from a 256-entry table.
//
// Tiles of kTileN weight rows are split over threads (at::parallel_for); a tile is multiplied by
// kTileM input rows at a time (the last 1..kTileM - 1 by a block of their own size) with kTileN x
// kTileM accumulators of 16 lanes (AVX-512: 4 x 4 of the 32 registers; AVX2, whose 16 registers
// hold half as much: 2 x 2). fp8_dequantize writes the
// whole dequantized matrix for callers that multiply many rows with oneDNN.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "vec16.h"
#include "extension_library.h"

namespace {
namespace fp8 {

constexpr float kRebias = 256.0f;  // an e4m3 byte read as fp16 bits is its value / 2^8
constexpr int64_t kStep = 16;      // weights converted at a time (and the group-size unit)
#if defined(SY_VEC16) && !defined(SY_VEC16_AVX2)
constexpr int64_t kTileN = 4, kTileM = 4;
#else
constexpr int64_t kTileN = 2, kTileM = 2;
#endif

// The value of every e4m3fn byte / 2^8, as the vector conversion reads it.
struct Table {
  float v[256];
  Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0x0F, m = b & 0x07;
      const float magnitude = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      v[b] = (b & 0x80 ? -magnitude : magnitude) / kRebias;
    }
  }
};
const float* table() {
  static const Table t;
  return t.v;
}

#if defined(SY_VEC16)
// 16 e4m3 bytes -> 16 floats, each its value / 2^8.
// Sign-extended to 16 bits and shifted left by 7, byte bit i lands on bit i + 7 and the sign also on
// bit 15; clearing bit 14 (and the low 7) leaves s.0eeee.mmm0000000.
inline vec16::V load16(const uint8_t* p) {
  const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
#if !defined(SY_VEC16_AVX2)
  return {_mm512_cvtph_ps(bits)};
#else
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1))};
#endif
}
#endif

// out[m0 .. m0 + MR, n0 .. n0 + kTileN) (weight rows past N are computed on a repeated row and dropped).
template <typename T, int64_t MR>
void block(const float* x, int64_t m0, int64_t K, const uint8_t* const* wr, const float* const* sr, int64_t G,
           const float* bias, T* out, int64_t N, int64_t n0, int64_t count) {
  const int64_t group = K / G;
  float sum[kTileN][MR];
#if defined(SY_VEC16)
  vec16::V acc[kTileN][MR];
  for (int64_t r = 0; r < kTileN; ++r)
    for (int64_t i = 0; i < MR; ++i) acc[r][i] = vec16::zero();
  for (int64_t g = 0; g < G; ++g) {
    vec16::V s[kTileN];
    for (int64_t r = 0; r < kTileN; ++r) s[r] = vec16::set1(sr[r][g] * kRebias);
    for (int64_t k = g * group; k < (g + 1) * group; k += kStep) {
      vec16::V wv[kTileN];
      for (int64_t r = 0; r < kTileN; ++r) wv[r] = vec16::mul(load16(wr[r] + k), s[r]);
      for (int64_t i = 0; i < MR; ++i) {
        const vec16::V xv = vec16::load(x + (m0 + i) * K + k);
        for (int64_t r = 0; r < kTileN; ++r) acc[r][i] = vec16::fmadd(wv[r], xv, acc[r][i]);
      }
    }
  }
  for (int64_t r = 0; r < kTileN; ++r)
    for (int64_t i = 0; i < MR; ++i) sum[r][i] = vec16::reduce_add(acc[r][i]);
#else
  const float* t = table();
  for (int64_t r = 0; r < kTileN; ++r)
    for (int64_t i = 0; i < MR; ++i) sum[r][i] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < kTileN; ++r) {
      const float s = sr[r][g] * kRebias;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        const float wv = t[wr[r][k]] * s;
        for (int64_t i = 0; i < MR; ++i) sum[r][i] += wv * x[(m0 + i) * K + k];
      }
    }
  }
#endif
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t r = 0; r < count; ++r)
      out[(m0 + i) * N + n0 + r] = static_cast<T>(sum[r][i] + (bias ? bias[n0 + r] : 0.0f));
}

// out[:, n0 .. n0 + kTileN): the tile's weight rows against every input row, kTileM rows at a time.
template <typename T>
void tile(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scales, int64_t G, const float* bias,
          T* out, int64_t N, int64_t n0) {
  const int64_t count = std::min(kTileN, N - n0);
  const uint8_t* wr[kTileN];
  const float* sr[kTileN];
  for (int64_t r = 0; r < kTileN; ++r) {
    const int64_t n = n0 + std::min(r, count - 1);
    wr[r] = w + n * K;
    sr[r] = scales + n * G;
  }
  int64_t m0 = 0;
  for (; m0 + kTileM <= M; m0 += kTileM) block<T, kTileM>(x, m0, K, wr, sr, G, bias, out, N, n0, count);
  switch (M - m0) {  // the last rows (fewer than kTileM)
    case 1: block<T, 1>(x, m0, K, wr, sr, G, bias, out, N, n0, count); break;
#if defined(SY_VEC16) && !defined(SY_VEC16_AVX2)
    case 2: block<T, 2>(x, m0, K, wr, sr, G, bias, out, N, n0, count); break;
    case 3: block<T, 3>(x, m0, K, wr, sr, G, bias, out, N, n0, count); break;
#endif
    default: break;
  }
}

template <typename T>
void run(const float* x, const uint8_t* w, const float* scales, int64_t G, const float* bias, T* out, int64_t M,
         int64_t N, int64_t K) {
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  // a task reads at least ~64 KB of weights, so that small linears stay on fewer threads
  const int64_t grain = std::max<int64_t>(1, 65536 / (kTileN * K));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile<T>(x, M, K, w, scales, G, bias, out, N, t * kTileN);
  });
}

void check_weight(const at::Tensor& data, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kByte && data.is_contiguous(),
              op, ": data must be contiguous uint8 [N, K] (the float8 e4m3 bytes)");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == data.size(0) && scales.size(1) > 0 && data.size(1) % scales.size(1) == 0 &&
                  (data.size(1) / scales.size(1)) % kStep == 0,
              op, ": scales must be contiguous float32 [N, G], G dividing K into groups of a multiple of 16");
}

// x [M, K] float32 or bfloat16, data uint8 [N, K], scales float32 [N, G], bias [N] (or none) -> [M, N] in x's dtype.
at::Tensor fp8_mm(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                  const std::optional<at::Tensor>& bias) {
  check_weight(data, scales, "fp8_mm");
  const int64_t M = x.size(0), N = data.size(0), K = data.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "fp8_mm: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "fp8_mm: float32 or bfloat16 rows");
  std::optional<at::Tensor> b;
  if (bias && bias->numel() > 0) {
    TORCH_CHECK(bias->numel() == N, "fp8_mm: a bias [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* bp = b ? b->data_ptr<float>() : nullptr;
  const uint8_t* w = data.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    run<float>(xf.data_ptr<float>(), w, s, scales.size(1), bp, out.data_ptr<float>(), M, N, K);
  } else {
    run<c10::BFloat16>(xf.data_ptr<float>(), w, s, scales.size(1), bp, out.data_ptr<c10::BFloat16>(), M, N, K);
  }
  return out;
}

template <typename T>
void dequantize_rows(const uint8_t* w, const float* scales, int64_t G, T* out, int64_t N, int64_t K) {
  const int64_t group = K / G;
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        const float s = scales[n * G + g] * kRebias;
#if defined(SY_VEC16)
        const vec16::V sv = vec16::set1(s);
        for (int64_t k = g * group; k < (g + 1) * group; k += kStep) {
          vec16::store(out + n * K + k, vec16::mul(load16(w + n * K + k), sv));
        }
#else
        const float* t = table();
        for (int64_t k = g * group; k < (g + 1) * group; ++k) out[n * K + k] = static_cast<T>(t[w[n * K + k]] * s);
#endif
      }
    }
  });
}

// data uint8 [N, K], scales float32 [N, G] -> the weight [N, K] in `dtype` (float32 or bfloat16).
at::Tensor fp8_dequantize(const at::Tensor& data, const at::Tensor& scales, at::ScalarType dtype) {
  check_weight(data, scales, "fp8_dequantize");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "fp8_dequantize: float32 or bfloat16");
  const int64_t N = data.size(0), K = data.size(1);
  at::Tensor out = at::empty({N, K}, data.options().dtype(dtype));
  if (dtype == at::kFloat) {
    dequantize_rows<float>(data.data_ptr<uint8_t>(), scales.data_ptr<float>(), scales.size(1), out.data_ptr<float>(),
                           N, K);
  } else {
    dequantize_rows<c10::BFloat16>(data.data_ptr<uint8_t>(), scales.data_ptr<float>(), scales.size(1),
                                   out.data_ptr<c10::BFloat16>(), N, K);
  }
  return out;
}

// Which loop this build runs (tests build each variant).
std::string fp8_mm_isa() { return vec16_isa(); }

}  // namespace fp8
}  // namespace

SWITCHYARD_LIBRARY(m) {
  m.def("fp8_mm(Tensor x, Tensor data, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("fp8_mm", c10::DispatchKey::CPU, &fp8::fp8_mm);
  m.def("fp8_dequantize(Tensor data, Tensor scales, ScalarType dtype) -> Tensor");
  m.impl("fp8_dequantize", c10::DispatchKey::CPU, &fp8::fp8_dequantize);
  m.def("fp8_mm_isa() -> str", &fp8::fp8_mm_isa);
}
