#pragma once
// The batched low-rank kernels of LoRA adapters (core/lora, core/backend_contract.py LoraKernel;
// punica's SGMV/BGMV): for each token t whose adapter slot s = token_slots[t] is >= 0,
//   shrink: h[t] = A[s] x[t]                      x [T, in], a [S, R, in] -> h [T, R]
//   expand: y[t] += scales[s] * B[s] h[t]         h [T, R], b [S, out, R], y [T, out] in place
// x, h and y float32 or bfloat16 (h and y in x's dtype), the stacks float32 or bfloat16, every sum
// float32. Rows of slot -1 are left alone (shrink writes zeros there). y's rows may be strided
// (a column slice of a fused projection's output); its columns are contiguous.
//
// The work: the step's tokens are grouped by slot (SGMV's segments, gathered across the whole
// step: the decodes of requests on one adapter share it wherever they sit), each slot's tokens cut
// into runs of up to kRunTokens. shrink takes a run at a time, kTokens x kRanks (token, rank) sums
// in registers, so that an adapter's row is loaded once for kTokens tokens (AVX-512: 4 x 4 of the
// 32 registers; AVX2's 16 registers hold half as much: 2 x 2). expand takes a run and a block of
// kOutBlock outputs at a time, 16 outputs (16 rows of B[s]) for every token of the run. Tasks are
// split over threads (at::parallel_for) only when a thread's share holds at least kThreadMacs
// multiply-adds (a decode token's few thousand stay on one thread).
//
// Batch invariance: a token's result depends only on its row and its adapter, bit for bit. Each
// (token, rank) of shrink is one 16-lane sum over `in` (whole chunks in order, then the last chunk
// padded with zeros) folded across lanes once, whatever the tile. Each (token, output) of expand
// is 16 partial sums p[j] (ranks j, j + 16, ... by fused multiply-adds from zero, R padded with
// zeros to a multiple of 16) folded by vec16::hsum's tree, then scaled and added to y (float32: one
// fused multiply-add; bfloat16: the scaled sum rounded, then added, as `y += delta.to(y.dtype)`).
// expand computes that one sum two ways: a slot with fewer than kTransposeTokens tokens in the
// step puts the ranks in lanes (rows of B[s] against h[t], folded by vec16::hsum); a longer run
// transposes B's 16-row groups once (outputs in lanes) and adds the products in hsum's own tree,
// kColumnTokens tokens sharing each column's load: about a third of the work per token. Both do
// the same float operations in the same order (written out: nothing is left to the compiler's
// contraction of a multiply and an add), so what else is in the step, which path its run took
// and which thread took it change no bit; the tests check it on every instruction-set level.
//
// 2-core Zen 4 (AVX-512), one thread, the gate projection (576 -> 1536) of 256 prompt tokens in
// runs of 32 over 8 adapters, rank 16: shrink 0.09-0.13 ms, expand 0.29-0.39 ms, against 0.18-0.21
// and 0.40-0.51 ms through torch (TorchLoraKernel) and 2.1-4.6 ms for the base linear; the ranks-in-
// lanes expand alone took 2-4x longer per token on such runs (and as long on one token: a decode
// whose adapter no other token of the step uses takes the rows path). benchmarks/lora_kernel.py
// gives whole layers.
//
// Without vec16 (no AVX2) portable loops compute each sum in order, one token at a time.
//
// This header is the one copy of the arithmetic: lora.cpp registers lora_shrink / lora_expand over
// it (shrink_runs / expand_runs), and decode_layers.cpp applies each layer's deltas through the same
// typed kernels (shrink_into / expand_from, on raw rows of one scratch buffer per step: no tensor is
// made per call), so an adapter token's delta is the same bits on the fused decode path as through
// the wrappers (core/lora/layers.py). The step's tokens are grouped by slot once (runs_of) for all of
// a step's calls.
//
// A decode step is memory-bound: each call reads a slot's stacks once, from memory (the step's
// base weights evict them), so shrink prefetches the next rank block's rows and expand the lines
// kPrefetchBytes ahead. 2-core Zen 4, one thread, the default model's fused decode layers
// (DecodeLayers.forward alone, rank 16 on all 7 projections, the machine shared, best of 40-300):
// 4 tokens on one adapter, the deltas 2.8-3.3 ms a step before (a tensor made per call, no
// prefetch), 1.8-2.1 after; 32 tokens over 8 adapters, 19-24 ms before, 10.4-12.6 after.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace {
namespace lora {

constexpr int64_t kLanes = 16;
constexpr int64_t kRunTokens = 16;         // tokens of one task (one slot)
constexpr int64_t kOutBlock = 256;         // outputs of one expand task
constexpr int64_t kThreadMacs = 1 << 17;   // least multiply-adds worth a thread
constexpr int64_t kTransposeTokens = 4;    // runs from this many tokens expand through transposed groups
constexpr int64_t kMaxStackRank = 64;      // ranks whose buffers fit on the stack (more: on the heap)
// The stacks are read once per step from memory (one layer's rank-16 float32 stacks of one adapter
// are 650 KB, the step's base weights evict them): expand prefetches B's lines this far ahead, as
// block_matmul.h its weights (4 and 8 KB measured no better on 2-core Zen 4).
constexpr int64_t kPrefetchBytes = 2048;
#if defined(SY_VEC16) && !defined(SY_VEC16_AVX2)
constexpr int kTokens = 4, kRanks = 4;
#else
constexpr int kTokens = 2, kRanks = 2;
#endif

// Up to kRunTokens tokens with one slot: tokens[begin, end) of the step's order (Runs::tokens).
struct Run {
  int64_t begin, end, slot;
};

struct Runs {
  std::vector<int64_t> tokens;  // the step's tokens with a slot >= 0, by slot, then in token order
  std::vector<Run> runs;
  int64_t count() const { return static_cast<int64_t>(runs.size()); }
  int64_t adapted() const { return static_cast<int64_t>(tokens.size()); }
};

// The tokens grouped by slot (a counting sort; slot -1 left out), every slot checked against S.
Runs runs_of(const at::Tensor& token_slots, int64_t T, int64_t S, const char* op) {
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == T, op, ": token_slots must be [T]");
  TORCH_CHECK(token_slots.scalar_type() == at::kInt || token_slots.scalar_type() == at::kLong,
              op, ": int32 token_slots");
  const at::Tensor slots = token_slots.scalar_type() == at::kInt && token_slots.is_contiguous()
                               ? token_slots : token_slots.to(at::kInt).contiguous();
  const int32_t* s = slots.data_ptr<int32_t>();
  std::vector<int64_t> first(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(s[t] >= -1 && s[t] < S, op, ": token ", t, " has slot ", s[t], ", outside [-1, ", S, ")");
    if (s[t] >= 0) ++first[s[t] + 1];
  }
  for (int64_t slot = 0; slot < S; ++slot) first[slot + 1] += first[slot];
  Runs out;
  out.tokens.resize(first[S]);
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] >= 0) out.tokens[next[s[t]]++] = t;
  }
  for (int64_t slot = 0; slot < S; ++slot) {
    for (int64_t k = first[slot]; k < first[slot + 1]; k += kRunTokens) {
      out.runs.push_back({k, std::min(k + kRunTokens, first[slot + 1]), slot});
    }
  }
  return out;
}

// Tasks per thread chunk so that a chunk holds at least kThreadMacs multiply-adds.
int64_t grain(int64_t tasks, int64_t macs) {
  if (tasks == 0) return 1;
  return std::max<int64_t>(1, (kThreadMacs * tasks + macs - 1) / std::max<int64_t>(1, macs));
}

// The cache lines of [p, p + bytes), into L1 (a hint: a line past the stack's end is not read).
inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(static_cast<const char*>(p) + line, 0, 3);
}

#if defined(SY_VEC16)
// 16 values of which the first n (< 16) are p's, the rest zeros (never read past p + n).
template <typename T>
inline vec16::V load_first(const T* p, int64_t n) {
  T padded[kLanes] = {};
  std::copy(p, p + n, padded);
  return vec16::load(padded);
}

template <typename T>
inline vec16::V load_chunk(const T* p, int64_t n) {
  return n >= kLanes ? vec16::load(p) : load_first(p, n);
}

// h[t, r] for NT tokens (rows x[t]) and NR ranks (rows a + r * K). The NR rows (NR * K contiguous
// values) are read side by side; the next NR rows' lines are prefetched as these are read (into L2:
// several KB ahead, beside x's rows in L1).
template <int NT, int NR, typename T, typename W>
inline void shrink_block(const T* const* x, const W* a, int64_t K, T* const* h) {
  vec16::V acc[NT][NR];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = vec16::zero();
  for (int64_t k = 0; k < K; k += kLanes) {
    for (int r = 0; r < NR; ++r) __builtin_prefetch(a + (NR + r) * K + k, 0, 2);
    vec16::V xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = load_chunk(x[t] + k, K - k);
    for (int r = 0; r < NR; ++r) {
      const vec16::V av = load_chunk(a + r * K + k, K - k);
      for (int t = 0; t < NT; ++t) acc[t][r] = vec16::fmadd(av, xv[t], acc[t][r]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) h[t][r] = static_cast<T>(vec16::reduce_add(acc[t][r]));
}

template <int NT, typename T, typename W>
inline void shrink_tokens(const T* const* x, const W* a, int64_t K, int64_t R, T* const* h) {
  int64_t r = 0;
  for (; r + kRanks <= R; r += kRanks) {
    T* rows[NT];
    for (int t = 0; t < NT; ++t) rows[t] = h[t] + r;
    shrink_block<NT, kRanks>(x, a + r * K, K, rows);
  }
  for (; r < R; ++r) {
    T* rows[NT];
    for (int t = 0; t < NT; ++t) rows[t] = h[t] + r;
    shrink_block<NT, 1>(x, a + r * K, K, rows);
  }
}

// flatten: every call inlined, so that the accumulators stay in registers
template <typename T, typename W>
__attribute__((flatten)) void shrink_run(const T* x, int64_t ldx, const W* a, int64_t K, int64_t R, T* h,
                                         int64_t ldh, const int64_t* tokens, const Run& run) {
  int64_t k = run.begin;
  for (; k + kTokens <= run.end; k += kTokens) {
    const T* xs[kTokens];
    T* hs[kTokens];
    for (int t = 0; t < kTokens; ++t) xs[t] = x + tokens[k + t] * ldx, hs[t] = h + tokens[k + t] * ldh;
    shrink_tokens<kTokens>(xs, a, K, R, hs);
  }
  for (; k < run.end; ++k) {
    const T* xs[1] = {x + tokens[k] * ldx};
    T* hs[1] = {h + tokens[k] * ldh};
    shrink_tokens<1>(xs, a, K, R, hs);
  }
}

// y[i] += scale * sum for n <= 16 outputs. bfloat16: the scaled sum rounded to y's dtype, then added
// (what `y += delta.to(y.dtype)` computes); float32: one fused multiply-add, written as one so that
// no compiler's contraction choice can make the two expand paths differ.
template <typename T>
inline void add_delta(vec16::V sum, float scale, int64_t n, T* y) {
  vec16::V before;
  if (n == kLanes) {
    before = vec16::load(y);
  } else {
    alignas(64) float in[kLanes] = {};
    for (int64_t i = 0; i < n; ++i) in[i] = static_cast<float>(y[i]);
    before = vec16::load(in);
  }
  vec16::V out;
  if constexpr (std::is_same_v<T, float>) {
    out = vec16::fmadd(sum, vec16::set1(scale), before);
  } else {
    out = vec16::add(before, vec16::round_to<T>(vec16::mul(sum, vec16::set1(scale))));
  }
  if (n == kLanes) {
    vec16::store(y, out);
  } else {
    alignas(64) float o[kLanes];
    vec16::store(o, out);
    for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(o[i]);
  }
}

// Ranks in lanes: lane j of acc[i] sums h[r] * b[o + i, r] over r = j, j + 16, ...; vec16::hsum
// folds each acc[i] into lane i.
template <typename T, typename W>
inline void expand_rows(const T* h, const W* b, int64_t R, int64_t n, float scale, T* y) {
  vec16::V acc[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) acc[i] = vec16::zero();
  for (int64_t r = 0; r < R; r += kLanes) {
    const vec16::V hv = load_chunk(h + r, R - r);
    for (int64_t i = 0; i < n; ++i) acc[i] = vec16::fmadd(load_chunk(b + i * R + r, R - r), hv, acc[i]);
  }
  add_delta(vec16::hsum(acc), scale, n, y);
}

// In place: v[j] lane i <- v[i] lane j (a 16 x 16 transpose). AVX-512: pairs of rows interleaved,
// then pairs of pairs, then 128-bit lanes; AVX2: four 8 x 8 transposes of the halves.
#if !defined(SY_VEC16_AVX2)
inline void transpose(vec16::V* v) {
  __m512 a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_ps(v[2 * k].v, v[2 * k + 1].v);
    a[2 * k + 1] = _mm512_unpackhi_ps(v[2 * k].v, v[2 * k + 1].v);
  }
  for (int k = 0; k < 4; ++k) {  // b[4k + m], 128-bit lane L: column 4L + m of rows 4k .. 4k + 3
    const __m512d a0 = _mm512_castps_pd(a[4 * k]), a1 = _mm512_castps_pd(a[4 * k + 1]);
    const __m512d a2 = _mm512_castps_pd(a[4 * k + 2]), a3 = _mm512_castps_pd(a[4 * k + 3]);
    b[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    b[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    b[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    b[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int m = 0; m < 4; ++m) {  // the 4 x 4 transpose of the 128-bit lanes of b[m], b[4 + m], b[8 + m], b[12 + m]
    const __m512 e0 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0x44), e1 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0xEE);
    const __m512 e2 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0x44);
    const __m512 e3 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0xEE);
    v[m].v = _mm512_shuffle_f32x4(e0, e2, 0x88);
    v[4 + m].v = _mm512_shuffle_f32x4(e0, e2, 0xDD);
    v[8 + m].v = _mm512_shuffle_f32x4(e1, e3, 0x88);
    v[12 + m].v = _mm512_shuffle_f32x4(e1, e3, 0xDD);
  }
}

#else
// out[m] lane i = in[i] lane m, 8 x 8
inline void transpose8(const __m256* in, __m256* out) {
  __m256 t[8], s[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(in[2 * k], in[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(in[2 * k], in[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {  // s[4k + m], 128-bit lane L: column 4L + m of rows 4k .. 4k + 3
    s[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    s[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    s[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    s[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    out[m] = _mm256_permute2f128_ps(s[m], s[4 + m], 0x20);
    out[4 + m] = _mm256_permute2f128_ps(s[m], s[4 + m], 0x31);
  }
}

inline void transpose(vec16::V* v) {
  __m256 in[8], lo_lo[8], lo_hi[8], hi_lo[8], hi_hi[8];
  for (int i = 0; i < 8; ++i) in[i] = v[i].lo;
  transpose8(in, lo_lo);  // rows 0-7, columns 0-7
  for (int i = 0; i < 8; ++i) in[i] = v[8 + i].lo;
  transpose8(in, hi_lo);  // rows 8-15, columns 0-7
  for (int i = 0; i < 8; ++i) in[i] = v[i].hi;
  transpose8(in, lo_hi);  // rows 0-7, columns 8-15
  for (int i = 0; i < 8; ++i) in[i] = v[8 + i].hi;
  transpose8(in, hi_hi);  // rows 8-15, columns 8-15
  for (int m = 0; m < 8; ++m) {
    v[m] = {lo_lo[m], hi_lo[m]};
    v[8 + m] = {lo_hi[m], hi_hi[m]};
  }
}

#endif

// B's rows o .. o + n (n <= 16) as columns of 16 lanes, cols[r * 16 + i] = b[o + i, r] for r below
// R rounded up to 16 (zeros past R and past n): 16 ranks at a time, loaded as rows and transposed.
template <typename W>
inline void columns(const W* b, int64_t R, int64_t n, float* cols) {
  for (int64_t r = 0; r < R; r += kLanes) {
    vec16::V v[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) v[i] = i < n ? load_chunk(b + i * R + r, R - r) : vec16::zero();
    transpose(v);
    for (int64_t j = 0; j < kLanes; ++j) vec16::store(cols + (r + j) * kLanes, v[j]);
  }
}

// p[t] (t < NT) = the sum of h[t][r] * cols[r] over r = j, j + 16, ... (outputs in lanes), by fused
// multiply-adds from zero: lane j of expand_rows' accumulators, for NT tokens at once.
template <int NT>
inline void partials(const float* const* h, const float* cols, int64_t padded, int64_t j, vec16::V* p) {
  for (int t = 0; t < NT; ++t) p[t] = vec16::zero();
  for (int64_t r = j; r < padded; r += kLanes) {
    const vec16::V c = vec16::load(cols + r * kLanes);
    for (int t = 0; t < NT; ++t) p[t] = vec16::fmadd(c, vec16::set1(h[t][r]), p[t]);
  }
}

// The 16 partial sums folded in vec16::hsum's tree, outputs in lanes, each partial computed when
// the tree needs it (few registers: several tokens share each column's load).
#if !defined(SY_VEC16_AVX2)
constexpr int kColumnTokens = 2;
// AVX-512: lanes j, j + 2 within each 128-bit lane, then the two pairs; then 128-bit lanes L, L + 2,
// then the two.
template <int NT>
inline void fold(const float* const* h, const float* cols, int64_t padded, vec16::V* sum) {
  vec16::V q[4][NT];
  for (int l = 0; l < 4; ++l) {
    vec16::V p0[NT], p1[NT], p2[NT], p3[NT];
    partials<NT>(h, cols, padded, 4 * l, p0);
    partials<NT>(h, cols, padded, 4 * l + 1, p1);
    partials<NT>(h, cols, padded, 4 * l + 2, p2);
    partials<NT>(h, cols, padded, 4 * l + 3, p3);
    for (int t = 0; t < NT; ++t) q[l][t] = vec16::add(vec16::add(p0[t], p2[t]), vec16::add(p1[t], p3[t]));
  }
  for (int t = 0; t < NT; ++t) sum[t] = vec16::add(vec16::add(q[0][t], q[2][t]), vec16::add(q[1][t], q[3][t]));
}
#else
constexpr int kColumnTokens = 1;
// AVX2: lanes j and j + 8 (the two halves), then adjacent pairs, then pairs of pairs, then the
// two 128-bit lanes.
template <int NT>
inline void fold(const float* const* h, const float* cols, int64_t padded, vec16::V* sum) {
  vec16::V d[2][NT];
  for (int half = 0; half < 2; ++half) {
    vec16::V q[4][NT];
    for (int i = 0; i < 4; ++i) {
      vec16::V low[NT], high[NT];
      partials<NT>(h, cols, padded, 4 * half + i, low);
      partials<NT>(h, cols, padded, 4 * half + i + 8, high);
      for (int t = 0; t < NT; ++t) q[i][t] = vec16::add(low[t], high[t]);
    }
    for (int t = 0; t < NT; ++t) d[half][t] = vec16::add(vec16::add(q[0][t], q[1][t]), vec16::add(q[2][t], q[3][t]));
  }
  for (int t = 0; t < NT; ++t) sum[t] = vec16::add(d[0][t], d[1][t]);
}
#endif

// Outputs in lanes, for NT tokens (h rows as float32, zero-padded to `padded` ranks): the bits of
// expand_rows.
template <int NT, typename T>
inline void expand_columns(const float* const* h, const float* cols, int64_t padded, int64_t n, float scale,
                           T* const* y) {
  vec16::V sum[NT];
  fold<NT>(h, cols, padded, sum);
  for (int t = 0; t < NT; ++t) add_delta(sum[t], scale, n, y[t]);
}

// Outputs [begin, end) of the run's tokens: 16 rows of B (16 outputs) at a time, the lines
// kPrefetchBytes past them prefetched.
template <typename T, typename W>
__attribute__((flatten)) void expand_block(const T* h, int64_t ldh, const W* b, int64_t R, int64_t begin, int64_t end,
                                           float scale, T* y, int64_t ldy, const int64_t* tokens, const Run& run) {
  const int64_t group_bytes = kLanes * R * static_cast<int64_t>(sizeof(W));
  if (run.end - run.begin < kTransposeTokens) {
    for (int64_t o = begin; o < end; o += kLanes) {
      const int64_t n = std::min(kLanes, end - o);
      prefetch_lines(reinterpret_cast<const char*>(b + o * R) + kPrefetchBytes, group_bytes);
      for (int64_t k = run.begin; k < run.end; ++k) {
        expand_rows(h + tokens[k] * ldh, b + o * R, R, n, scale, y + tokens[k] * ldy + o);
      }
    }
    return;
  }
  const int64_t padded = (R + kLanes - 1) / kLanes * kLanes;
  alignas(64) float cols_stack[kMaxStackRank * kLanes];
  alignas(64) float hs_stack[kRunTokens * kMaxStackRank];
  std::vector<float> heap(padded > kMaxStackRank ? padded * (kLanes + kRunTokens) : 0);
  float* cols = padded > kMaxStackRank ? heap.data() : cols_stack;
  float* hs = padded > kMaxStackRank ? heap.data() + padded * kLanes : hs_stack;
  for (int64_t k = run.begin; k < run.end; ++k) {  // the run's h rows as float32, zero-padded
    float* row = hs + (k - run.begin) * padded;
    for (int64_t r = 0; r < padded; ++r) row[r] = r < R ? static_cast<float>(h[tokens[k] * ldh + r]) : 0.0f;
  }
  for (int64_t o = begin; o < end; o += kLanes) {
    const int64_t n = std::min(kLanes, end - o);
    prefetch_lines(reinterpret_cast<const char*>(b + o * R) + kPrefetchBytes, group_bytes);
    columns(b + o * R, R, n, cols);
    int64_t k = run.begin;
    for (; k + kColumnTokens <= run.end; k += kColumnTokens) {
      const float* rows[kColumnTokens];
      T* outs[kColumnTokens];
      for (int t = 0; t < kColumnTokens; ++t) {
        rows[t] = hs + (k + t - run.begin) * padded, outs[t] = y + tokens[k + t] * ldy + o;
      }
      expand_columns<kColumnTokens>(rows, cols, padded, n, scale, outs);
    }
    for (; k < run.end; ++k) {
      const float* rows[1] = {hs + (k - run.begin) * padded};
      T* outs[1] = {y + tokens[k] * ldy + o};
      expand_columns<1>(rows, cols, padded, n, scale, outs);
    }
  }
}
#else
template <typename T, typename W>
void shrink_run(const T* x, int64_t ldx, const W* a, int64_t K, int64_t R, T* h, int64_t ldh, const int64_t* tokens,
                const Run& run) {
  for (int64_t k = run.begin; k < run.end; ++k) {
    const int64_t t = tokens[k];
    for (int64_t r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (int64_t i = 0; i < K; ++i) sum += static_cast<float>(a[r * K + i]) * static_cast<float>(x[t * ldx + i]);
      h[t * ldh + r] = static_cast<T>(sum);
    }
  }
}

template <typename T, typename W>
void expand_block(const T* h, int64_t ldh, const W* b, int64_t R, int64_t begin, int64_t end, float scale, T* y,
                  int64_t ldy, const int64_t* tokens, const Run& run) {
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t k = run.begin; k < run.end; ++k) {
      const int64_t t = tokens[k];
      float sum = 0.0f;
      for (int64_t r = 0; r < R; ++r) sum += static_cast<float>(h[t * ldh + r]) * static_cast<float>(b[o * R + r]);
      const float delta = static_cast<float>(static_cast<T>(sum * scale));
      y[t * ldy + o] = static_cast<T>(static_cast<float>(y[t * ldy + o]) + delta);
    }
  }
}
#endif

bool is_float(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

// t itself when contiguous (no dispatcher call: a decode step's calls are a few microseconds).
at::Tensor dense(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// The typed kernels on raw rows: h's rows are ldh apart (a column range of a wider buffer: the
// fused layers shrink a fused projection's parts into one scratch buffer and expand each from its
// columns, with no tensor made per call).
template <typename T, typename W>
void shrink_typed(const T* xp, int64_t ldx, const W* ap, int64_t K, int64_t R, T* hp, int64_t ldh, const Runs& runs) {
  at::parallel_for(0, runs.count(), grain(runs.count(), runs.adapted() * R * K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs.runs[i];
      shrink_run<T, W>(xp, ldx, ap + run.slot * R * K, K, R, hp, ldh, runs.tokens.data(), run);
    }
  });
}

template <typename T, typename W>
void expand_typed(T* yp, int64_t ldy, int64_t N, const T* hp, int64_t ldh, const W* bp, int64_t R,
                  const float* scales, const Runs& runs) {
  const int64_t blocks = (N + kOutBlock - 1) / kOutBlock;
  const int64_t tasks = runs.count() * blocks;
  at::parallel_for(0, tasks, grain(tasks, runs.adapted() * N * R), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs.runs[i / blocks];
      const int64_t o = (i % blocks) * kOutBlock;
      expand_block<T, W>(hp, ldh, bp + run.slot * N * R, R, o, std::min(N, o + kOutBlock), scales[run.slot], yp, ldy,
                         runs.tokens.data(), run);
    }
  });
}

// f(the stack's data as const W*), W float or c10::BFloat16: the stack's dtype (float32 or bfloat16).
template <typename F>
void visit_stack(const at::Tensor& stack, F&& f) {
  if (stack.scalar_type() == at::kFloat) f(static_cast<const float*>(stack.data_ptr()));
  else f(static_cast<const c10::BFloat16*>(stack.data_ptr()));
}

// x [T, in] (T* rows ldx apart), a [S, R, in] (contiguous) -> h rows (ldh apart) of the tokens of
// `runs`; the other rows are left alone.
template <typename T>
void shrink_into(const T* x, int64_t ldx, const at::Tensor& a, T* h, int64_t ldh, const Runs& runs) {
  visit_stack(a, [&](const auto* ap) { shrink_typed(x, ldx, ap, a.size(2), a.size(1), h, ldh, runs); });
}

// y rows (ldy apart, N = b.size(1) contiguous columns) += scales[s] * h[t] B[s]^T for the tokens of
// `runs`; b [S, out, R] contiguous, scales float32 [S] contiguous.
template <typename T>
void expand_from(T* y, int64_t ldy, const T* h, int64_t ldh, const at::Tensor& b, const at::Tensor& scales,
                 const Runs& runs) {
  const float* sp = scales.data_ptr<float>();
  visit_stack(b, [&](const auto* bp) { expand_typed(y, ldy, b.size(1), h, ldh, bp, b.size(2), sp, runs); });
}

// x [T, in] (rows may be strided), a [S, R, in] -> h [T, R] in x's dtype, zeros for the tokens
// outside `runs` (slot -1).
inline at::Tensor shrink_runs(const at::Tensor& x, const at::Tensor& a, const Runs& runs) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && a.size(2) == x.size(1), "lora_shrink: x [T, in] and a [S, R, in]");
  TORCH_CHECK(is_float(x) && is_float(a), "lora_shrink: float32 or bfloat16 x and a");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor ac = dense(a);
  at::Tensor h = at::empty({x.size(0), a.size(1)}, x.options());
  if (h.numel() > 0) std::memset(h.data_ptr(), 0, h.nbytes());  // the rows of slot -1
  const int64_t R = a.size(1);
  if (x.scalar_type() == at::kFloat) shrink_into(xc.data_ptr<float>(), xc.stride(0), ac, h.data_ptr<float>(), R, runs);
  else shrink_into(xc.data_ptr<c10::BFloat16>(), xc.stride(0), ac, h.data_ptr<c10::BFloat16>(), R, runs);
  return h;
}

// y [T, out] (rows may be strided, columns contiguous) += scales[s] * h[t] B[s]^T, b [S, out, R],
// for the tokens of `runs`.
inline void expand_runs(const at::Tensor& y, const at::Tensor& h, const at::Tensor& b, const at::Tensor& scales,
                        const Runs& runs) {
  TORCH_CHECK(y.dim() == 2 && h.dim() == 2 && b.dim() == 3 && h.size(0) == y.size(0) && b.size(1) == y.size(1) &&
              b.size(2) == h.size(1), "lora_expand: y [T, out], h [T, R] and b [S, out, R]");
  TORCH_CHECK(y.stride(1) == 1 || y.size(1) <= 1, "lora_expand: y's columns must be contiguous");
  TORCH_CHECK(is_float(y) && is_float(b) && h.scalar_type() == y.scalar_type(),
              "lora_expand: float32 or bfloat16 y and b, h in y's dtype");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == b.size(0) && scales.scalar_type() == at::kFloat,
              "lora_expand: float32 scales [S]");
  const at::Tensor hc = dense(h), bc = dense(b), sc = dense(scales);
  const int64_t R = b.size(2);
  if (y.scalar_type() == at::kFloat) expand_from(y.data_ptr<float>(), y.stride(0), hc.data_ptr<float>(), R, bc, sc, runs);
  else expand_from(y.data_ptr<c10::BFloat16>(), y.stride(0), hc.data_ptr<c10::BFloat16>(), R, bc, sc, runs);
}

}  // namespace lora
}  // namespace
