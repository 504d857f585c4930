#pragma once
// out = x W^T (+ bias) for a few rows x [M, K] (float32 or bfloat16) and a bfloat16 weight
// W [N, K]: each weight is read once as its 2 bytes, widened to float32 in registers, the
// products summed in float32 and each output rounded once to x's dtype (what a bf16 matmul with
// float32 accumulation computes).
//
// For CPUs where oneDNN packs no bf16 (AVX2 without AVX-512): there linear.py multiplies bf16
// weights as float32 copies, 4 bytes a weight, and a decode step of a few rows, bound by memory
// bandwidth, reads twice what this kernel reads. Many rows are compute-bound and stay with
// oneDNN (the callers' row limit, linear.py's rows_kernel_rows).
//
// W is repacked once at load (linear.py's pack_rows, the one description of the layout) into
// tiles of kGroup = 4 rows: packed [N' / 4, K' / 32, 4, 32], N and K zero-padded to N' and K',
// so that a group's 4 rows are one sequential stream of 256-byte steps (4 rows x 32 columns)
// and a thread reads its part of W front to back: 2-core AVX2 EPYC, the default model's 120
// layer linears at one row, 10.8 ms row-major (4 streams a group) against 8.3-8.8 ms packed
// (24-26 GB/s, the machine's sequential read rate), prefetching kPrefetchBytes ahead.
//
// The groups are split over threads (at::parallel_for); a group is multiplied by every input
// row in turn (after the first its few KB come from L1), with 4 accumulators of 16 lanes
// (vec16.h) summed across lanes at the end. Without vec16 (no AVX2) a portable loop does the
// same arithmetic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "vec16.h"

namespace {
namespace rows {

constexpr int64_t kGroup = 4;             // weight rows of a tile
constexpr int64_t kColumns = 32;          // columns of a tile's step
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead of the loads the stream is prefetched

// out[m, n .. n + 3] for every m: x [M, K'] float32 (zero-padded), w the group's [K' / 32, 4, 32].
template <typename T>
void group(const float* x, int64_t M, int64_t K, const c10::BFloat16* w, const float* bias, T* out, int64_t N,
           int64_t n) {
  const int64_t count = std::min(kGroup, N - n);  // the last group may hold padding rows
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float sum[kGroup];
#if defined(SY_VEC16)
    vec16::V acc[kGroup];
    for (int r = 0; r < kGroup; ++r) acc[r] = vec16::zero();
    const c10::BFloat16* p = w;
    for (int64_t k = 0; k < K; k += kColumns, p += kGroup * kColumns) {
      for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + 64 * line, _MM_HINT_T0);
      const vec16::V x0 = vec16::load(xm + k), x1 = vec16::load(xm + k + 16);
      for (int r = 0; r < kGroup; ++r) {
        acc[r] = vec16::fmadd(vec16::load(p + kColumns * r), x0, acc[r]);
        acc[r] = vec16::fmadd(vec16::load(p + kColumns * r + 16), x1, acc[r]);
      }
    }
    for (int r = 0; r < kGroup; ++r) sum[r] = vec16::reduce_add(acc[r]);
#else
    for (int r = 0; r < kGroup; ++r) sum[r] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const c10::BFloat16* step = w + (k / kColumns) * kGroup * kColumns + k % kColumns;
      for (int r = 0; r < kGroup; ++r) sum[r] += static_cast<float>(step[kColumns * r]) * xm[k];
    }
#endif
    for (int64_t r = 0; r < count; ++r) out[m * N + n + r] = static_cast<T>(sum[r] + (bias ? bias[n + r] : 0.0f));
  }
}

template <typename T>
void run(const float* x, const c10::BFloat16* w, const float* bias, T* out, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = (N + kGroup - 1) / kGroup;
  // a task reads at least ~64 KB of weights, so that small linears stay on fewer threads
  const int64_t grain = std::max<int64_t>(1, 65536 / (kGroup * K * 2));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) group<T>(x, M, K, w + g * kGroup * K, bias, out, N, g * kGroup);
  });
}

// x [M, K] float32 or bfloat16, packed [N' / 4, K' / 32, 4, 32] bfloat16 (pack_rows), bias [N]
// float32 or bfloat16 (or none) -> [M, N] in x's dtype.
at::Tensor bf16_rows_mm(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == kColumns && packed.is_contiguous(),
              "bf16_rows_mm: packed must be contiguous [N/4, K/32, 4, 32] (pack_rows)");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "bf16_rows_mm: a bfloat16 weight");
  const int64_t M = x.size(0), N = out_features, K = packed.size(1) * kColumns;
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= K && x.size(1) > K - kColumns && N <= packed.size(0) * kGroup &&
              N > (packed.size(0) - 1) * kGroup, "bf16_rows_mm: x [M, K] and out_features must match the packed weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "bf16_rows_mm: float32 or bfloat16 rows");
  std::optional<at::Tensor> b;
  if (bias && bias->numel() > 0) {
    TORCH_CHECK((bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16) && bias->numel() == N,
                "bf16_rows_mm: a float32 or bfloat16 bias [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor xf = x.to(at::kFloat);
  if (x.size(1) < K) xf = at::constant_pad_nd(xf, {0, K - x.size(1)});
  xf = xf.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const float* bp = b ? b->data_ptr<float>() : nullptr;
  const c10::BFloat16* w = packed.data_ptr<c10::BFloat16>();
  if (x.scalar_type() == at::kFloat) {
    run<float>(xf.data_ptr<float>(), w, bp, out.data_ptr<float>(), M, N, K);
  } else {
    run<c10::BFloat16>(xf.data_ptr<float>(), w, bp, out.data_ptr<c10::BFloat16>(), M, N, K);
  }
  return out;
}

// Which loop this build runs (load_rows_kernel refuses the portable one; tests check each build).
std::string rows_mm_isa() { return vec16_isa(); }

}  // namespace rows
}  // namespace
