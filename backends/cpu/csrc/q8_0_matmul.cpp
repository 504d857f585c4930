// x @ W^T with W in ggml's Q8_0 blocks, multiplied without dequantizing W in memory.
//
// W [N, K] is stored as N rows of K/32 blocks of 34 bytes: an fp16 scale d, then 32 int8 q;
// w = d * q. For each output row n, one block at a time is widened to float32 in a
// stack buffer (L1) and dotted with the matching 32 values of every input row, so W is read
// once per call (decode steps are bound by that read: 1.06 bytes per weight instead of 2 for
// bf16). Accumulation in float32; x float32 or bfloat16 (converted once), output in x's dtype.
// Work is split over output rows with at::parallel_for. With AVX-512 (-march=native) the
// loop is written with intrinsics (the portable loop below, left to the compiler's
// vectoriser, ran the default model's head 15x slower than torch's int8 kernel); without, the
// portable loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kBlockBytes = 34;
constexpr int64_t kRowsPerTile = 4;  // input rows whose partial sums stay in registers

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; the portable conversion below is ~20
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// out[m] += sum_i w[i] * x[m][i] over one block, for up to kRowsPerTile rows m.
inline void block_dots(const float* w, const float* x, int64_t k_stride, int64_t rows, float* acc) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* xm = x + m * k_stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < kBlock; ++i) sum += w[i] * xm[i];
    acc[m] += sum;
  }
}

#if defined(__AVX512F__)
// AVX-512: a block's 32 int8 widen to two vectors of 16 floats; its dot with each input row
// is scaled by d into that row's vector accumulator (reduced once per output).
inline __m512 widen(const uint8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// One input row (a decode step's head): two independent accumulators, everything in registers.
float q8_0_dot(const uint8_t* row, const float* x, int64_t num_blocks) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = row + b * kBlockBytes;
    const __m512 d = _mm512_set1_ps(half_at(block));
    acc0 = _mm512_fmadd_ps(_mm512_mul_ps(d, widen(block + 2)), _mm512_loadu_ps(x + b * kBlock), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_mul_ps(d, widen(block + 18)), _mm512_loadu_ps(x + b * kBlock + 16), acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

void q8_0_rows(const float* x, const uint8_t* blocks, float* out, int64_t M, int64_t N, int64_t K,
               int64_t n_begin, int64_t n_end) {
  const int64_t num_blocks = K / kBlock;
  if (M == 1) {
    for (int64_t n = n_begin; n < n_end; ++n) out[n] = q8_0_dot(blocks + n * num_blocks * kBlockBytes, x, num_blocks);
    return;
  }
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = blocks + n * num_blocks * kBlockBytes;
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile) {
      const int64_t rows = std::min(kRowsPerTile, M - m0);
      __m512 acc[kRowsPerTile] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                                  _mm512_setzero_ps()};
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* block = row + b * kBlockBytes;
        const __m512 d = _mm512_set1_ps(half_at(block));
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(block + 2))));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(block + 18))));
        for (int64_t m = 0; m < rows; ++m) {
          const float* xm = x + (m0 + m) * K + b * kBlock;
          const __m512 dot = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), _mm512_mul_ps(w1, _mm512_loadu_ps(xm + 16)));
          acc[m] = _mm512_fmadd_ps(d, dot, acc[m]);
        }
      }
      for (int64_t m = 0; m < rows; ++m) out[(m0 + m) * N + n] = _mm512_reduce_add_ps(acc[m]);
    }
  }
}
#else
// Portable: one block at a time widened to float in a stack buffer, dotted with each row.
void q8_0_rows(const float* x, const uint8_t* blocks, float* out, int64_t M, int64_t N, int64_t K,
               int64_t n_begin, int64_t n_end) {
  const int64_t num_blocks = K / kBlock;
  alignas(64) float w[kBlock];
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = blocks + n * num_blocks * kBlockBytes;
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile) {
      const int64_t rows = std::min(kRowsPerTile, M - m0);
      float acc[kRowsPerTile] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* block = row + b * kBlockBytes;
        const float d = half_at(block);
        const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
#pragma omp simd
        for (int64_t i = 0; i < kBlock; ++i) w[i] = d * static_cast<float>(q[i]);
        block_dots(w, x + m0 * K + b * kBlock, K, rows, acc);
      }
      for (int64_t m = 0; m < rows; ++m) out[(m0 + m) * N + n] = acc[m];
    }
  }
}
#endif

at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "q8_0_mm: x must be [M, K]");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "q8_0_mm: blocks must be contiguous uint8 [N, K/32*34]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % kBlock == 0 && blocks.size(0) == N && blocks.size(1) == K / kBlock * kBlockBytes,
              "q8_0_mm: blocks do not match x's width or out_features");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { q8_0_rows(xp, bp, op, M, N, K, begin, end); });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("q8_0_mm(Tensor x, Tensor blocks, int out_features) -> Tensor");
  m.impl("q8_0_mm", c10::DispatchKey::CPU, &q8_0_mm);
}
