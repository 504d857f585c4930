#pragma once
// out = x W^T (+ bias) for a few rows x [M, K] (float32 or bfloat16) and a bfloat16 weight
// W [N, K] as the model holds it (row-major, not repacked): each weight is read once as its 2
// bytes, widened to float32 in registers, the products summed in float32 and each output
// rounded once to x's dtype (what a bf16 matmul with float32 accumulation computes).
//
// For CPUs where oneDNN packs no bf16 (AVX2 without AVX-512): there linear.py multiplies bf16
// weights as float32 copies, 4 bytes a weight, and a decode step of a few rows, bound by memory
// bandwidth, reads twice what this kernel reads. Many rows are compute-bound and stay with
// oneDNN (the callers' row limit, linear.py's ROWS_KERNEL_MAX_ROWS).
//
// The output rows are split over threads (at::parallel_for) in groups of kGroup weight rows; a
// group is multiplied by every input row in turn (its 4 rows, a few KB, stay in L1 after the
// first), with kGroup accumulators of 16 lanes (vec16.h) moving along K one cache line of each
// weight row at a time and prefetching kPrefetchBytes ahead. The 16 lanes are summed at the end
// of the row. Without vec16 (no AVX2) a portable loop does the same arithmetic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "vec16.h"

namespace {
namespace rows {

constexpr int64_t kGroup = 4;             // weight rows multiplied together
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the loads each weight row is prefetched

inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// out[m, n + r] for r < R and every m: x [M, K] float32, w the R rows from row n, bias float32 or null.
template <int R, typename T>
void dot_rows(const float* x, int64_t M, int64_t K, const c10::BFloat16* w, const float* bias, T* out, int64_t N,
              int64_t n) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float sum[R];
    int64_t k = 0;
#if defined(SY_VEC16)
    vec16::V acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vec16::zero();
    for (; k + 32 <= K; k += 32) {
      const vec16::V x0 = vec16::load(xm + k), x1 = vec16::load(xm + k + 16);
      for (int r = 0; r < R; ++r) {
        const c10::BFloat16* p = w + r * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        acc[r] = vec16::fmadd(vec16::load(p), x0, acc[r]);
        acc[r] = vec16::fmadd(vec16::load(p + 16), x1, acc[r]);
      }
    }
    for (; k + 16 <= K; k += 16) {
      const vec16::V x0 = vec16::load(xm + k);
      for (int r = 0; r < R; ++r) acc[r] = vec16::fmadd(vec16::load(w + r * K + k), x0, acc[r]);
    }
    for (int r = 0; r < R; ++r) sum[r] = vec16::reduce_add(acc[r]);
#else
    for (int r = 0; r < R; ++r) sum[r] = 0.0f;
#endif
    for (; k < K; ++k) {
      for (int r = 0; r < R; ++r) sum[r] += widen(w[r * K + k]) * xm[k];
    }
    for (int r = 0; r < R; ++r) out[m * N + n + r] = static_cast<T>(sum[r] + (bias ? bias[n + r] : 0.0f));
  }
}

template <typename T>
void run(const float* x, const c10::BFloat16* w, const float* bias, T* out, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = (N + kGroup - 1) / kGroup;
  // a task reads at least ~64 KB of weights, so that small linears stay on fewer threads
  const int64_t grain = std::max<int64_t>(1, 65536 / (kGroup * K * 2));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * kGroup;
      if (n + kGroup <= N) {
        dot_rows<kGroup>(x, M, K, w + n * K, bias, out, N, n);
      } else {
        for (int64_t r = n; r < N; ++r) dot_rows<1>(x, M, K, w + r * K, bias, out, N, r);
      }
    }
  });
}

// x [M, K] float32 or bfloat16, weight [N, K] bfloat16, bias [N] float32 (or none) -> [M, N] in x's dtype.
at::Tensor bf16_rows_mm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "bf16_rows_mm: x [M, K], weight [N, K]");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "bf16_rows_mm: a bfloat16 weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "bf16_rows_mm: float32 or bfloat16 rows");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  const at::Tensor w = weight.contiguous();
  std::optional<at::Tensor> b;
  if (bias && bias->numel() > 0) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "bf16_rows_mm: a float32 bias [N]");
    b = bias->contiguous();
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const float* bp = b ? b->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run<float>(xf.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), bp, out.data_ptr<float>(), M, N, K);
  } else {
    run<c10::BFloat16>(xf.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), bp, out.data_ptr<c10::BFloat16>(), M, N, K);
  }
  return out;
}

// Which loop this build runs, for tests and `switchyard backends`.
std::string rows_mm_isa() {
#if defined(SY_VEC16) && !defined(SY_VEC16_AVX2)
  return "avx512";
#elif defined(SY_VEC16)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace rows
}  // namespace
