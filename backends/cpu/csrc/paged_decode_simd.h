// The vector body of paged_decode.h: one task's attention over a range of positions, on
// vec16.h's 16-lane vectors (AVX-512, or AVX2 in pairs of registers).
//
// A task is one request's query heads over positions [lo, hi). Positions go in tiles of 16
// (a tile may straddle cache blocks: its rows are found through the block table one by
// one); on each tile, each KV head's `group` query heads together (GQA folded: every K/V
// row is read once for all of them):
//   scores  for each row, one fused multiply-add chain per query head leaves 16 partial
//           sums in a vector; a transposing reduction (vec16::hsum) turns the tile's 16 such
//           vectors into one vector of 16 scores;
//   softmax online, in float32, per query head: running max m and sum l, and the
//           unnormalised output acc rescaled once per tile;
//   values  acc += p * v, row by row, with acc held in registers across the tile when the
//           head dim and group are compile-time constants.
// Rows are converted bf16 -> float32 once per row (a shift of the 16 bits), then shared
// by the group's heads. head_dim must be a multiple of 16.
//
// A quantized cache (kv_rows.h: one-byte codes and a float32 scale per row) is read as its
// codes, converted by vec16::load; a tile's 16 scores are multiplied by their keys' 16 scales
// after the reduction, and each value row's scale is folded into its softmax weight.
#pragma once

#include "kv_rows.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(SY_VEC16)
namespace paged_decode_simd {

using vec16::V;
constexpr int64_t kTile = 16;  // rows per tile: one score vector
constexpr int64_t kMaxQueries = 32;  // queries attend_range_rows takes at once

// What a task needs to find its rows: `table` is the request's block-table row; `row` the
// elements of one (token, KV head) row: head_dim, and a quantized row's scale bytes.
struct Rows {
  const void* cache;
  const int32_t* table;
  int64_t block_size, num_kv_heads, kv_half, row;
};

// Whether add_values takes one query head at a time: with AVX2, whose vector is two of its 16
// registers, where a group's accumulators (G * D / 16 vectors) would not fit beside a value row and
// so live on the stack (SmolLM2-135M's 3 heads of 64 are 24 registers). Then one head's stay in
// registers over the tile and the value rows are read once per head (from L1): 500 prompt rows,
// SmolLM2's shape 1.08-1.10x, Llama-3-8B's (4 heads of 128) 1.14x (benchmarks/kernel_ab.py). With
// AVX-512's 32 registers the stack is cheaper than the reads (Llama-3-8B's: 0.92-0.96x). Not for a
// quantized cache, whose codes would be converted again for each head.
template <typename T, int64_t kD, int64_t kG, int Q>
constexpr bool heads_apart() {
#if defined(SY_VEC16_AVX2)
  return Q == 1 && kD > 0 && kG > 1 && kD / 16 * kG * 2 > 16 && !kv_rows::Format<T>::kQuantized;
#else
  return false;
#endif
}

// The values' part of attend_tile: acc[i][G * D] = acc * rescale + sum over the tile's rows t < n[i] of
// p[i][t] * v[t], rows in order. Out of line: inlined beside the scores' registers, GCC stored every
// accumulator to the stack at every row (AVX-512, 4 queries: 16 stores a row). Where every query
// takes every row (all but the prompt's diagonal tiles) the loop runs without the test. Every
// (query, head, 16 values) chain takes the same products in the same order whichever loop runs
// (heads_apart or not), so the same bits.
template <typename T, int64_t kD, int64_t kG, int Q>
inline void add_values(const T* const* key, const int64_t* n, int64_t rows, int64_t offset, int64_t head_dim,
                       int64_t group, const float (*p)[(kG > 0 ? kG : 16) * kTile],
                       const float (*rescale)[kG > 0 ? kG : 16], float* const* acc) {
  const int64_t D = kD > 0 ? kD : head_dim, G = kG > 0 ? kG : group, C = D / 16;
  if constexpr (heads_apart<T, kD, kG, Q>()) {
    for (int64_t g = 0; g < G; ++g) {
      const V scale = vec16::set1(rescale[0][g]);
      V a[kD / 16];
      for (int64_t c = 0; c < C; ++c) a[c] = vec16::mul(vec16::load(acc[0] + g * D + 16 * c), scale);
      for (int64_t t = 0; t < rows; ++t) {
        const V weight = vec16::set1(p[0][g * kTile + t]);
        for (int64_t c = 0; c < C; ++c) a[c] = vec16::fmadd(weight, vec16::load(key[t] + offset + 16 * c), a[c]);
      }
      for (int64_t c = 0; c < C; ++c) vec16::store(acc[0] + g * D + 16 * c, a[c]);
    }
    return;
  }
  constexpr int64_t kAcc = kD > 0 && kG > 0 ? kD / 16 * kG : 16 * 16;  // registers of acc
  V a[Q][kAcc];
  for (int i = 0; i < Q; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const V scale = vec16::set1(rescale[i][g]);
      for (int64_t c = 0; c < C; ++c) a[i][g * C + c] = vec16::mul(vec16::load(acc[i] + g * D + 16 * c), scale);
    }
  }
  bool full = true;
  for (int i = 0; i < Q; ++i) full = full && n[i] == rows;
  const auto values = [&](auto all) {
    for (int64_t t = 0; t < rows; ++t) {
      V v[kD > 0 ? kD / 16 : 16];
      for (int64_t c = 0; c < C; ++c) v[c] = vec16::load(key[t] + offset + 16 * c);
      for (int i = 0; i < Q; ++i) {
        if (!decltype(all)::value && t >= n[i]) continue;
        for (int64_t g = 0; g < G; ++g) {
          const V weight = vec16::set1(p[i][g * kTile + t]);
          for (int64_t c = 0; c < C; ++c) a[i][g * C + c] = vec16::fmadd(weight, v[c], a[i][g * C + c]);
        }
      }
    }
  };
  if (Q == 1 || full) {
    values(std::true_type{});
  } else {
    values(std::false_type{});
  }
  for (int i = 0; i < Q; ++i) {
    for (int64_t j = 0; j < G * C; ++j) vec16::store(acc[i] + 16 * j, a[i][j]);
  }
}
template <typename T, int64_t kD, int64_t kG, int Q>
__attribute__((noinline)) void add_values_apart(const T* const* key, const int64_t* n, int64_t rows, int64_t offset,
                                                int64_t head_dim, int64_t group,
                                                const float (*p)[(kG > 0 ? kG : 16) * kTile],
                                                const float (*rescale)[kG > 0 ? kG : 16], float* const* acc) {
  add_values<T, kD, kG, Q>(key, n, rows, offset, head_dim, group, p, rescale, acc);
}

// One tile (n[i] <= 16 rows for query i, `key` their first KV head's key rows) for the G query
// heads of KV head h (its rows at `offset`) of Q queries: scores, online softmax update of
// m[i][G], l[i][G], and acc[i][G * D] += p * v. Each key and value row is loaded once for all Q
// queries, and each query gets exactly the operations it would get alone (Q = 1: the same chains
// in the same order), so its m, l and acc do not depend on the queries beside it.
template <typename T, int64_t kD, int64_t kG, int Q = 1>
inline void attend_tile(const T* const* key, const int64_t* n, int64_t offset, int64_t kv_half,
                        const float* const* q, int64_t head_dim, int64_t group, float soft_cap, float* const* m,
                        float* const* l, float* const* acc) {
  static_assert(Q == 1 || (kD > 0 && kG > 0), "several queries at once need a compile-time head dim and group");
  const int64_t D = kD > 0 ? kD : head_dim, G = kG > 0 ? kG : group, C = D / 16;
  constexpr int64_t kHeads = kG > 0 ? kG : 16;                          // 16 is the largest group
  constexpr bool kScaled = kv_rows::Format<T>::kQuantized;
  V partial[Q][kHeads * kTile];
  float rescale[Q][kHeads];
  alignas(64) float p[Q][kHeads * kTile];
  alignas(64) float key_scale[kScaled ? kTile : 1], value_scale[kScaled ? kTile : 1];
  int64_t rows = 0;
  for (int i = 0; i < Q; ++i) rows = std::max(rows, n[i]);
  if constexpr (kScaled) {
    for (int64_t t = 0; t < kTile; ++t) {
      key_scale[t] = t < rows ? kv_rows::row_scale(key[t] + offset, D) : 0.0f;
      value_scale[t] = t < rows ? kv_rows::row_scale(key[t] + kv_half + offset, D) : 0.0f;
    }
  }
  for (int64_t t = 0; t < rows; ++t) {
    V k[kD > 0 ? kD / 16 : 16];
    for (int64_t c = 0; c < C; ++c) k[c] = vec16::load(key[t] + offset + 16 * c);
    for (int i = 0; i < Q; ++i) {
      if (t >= n[i]) continue;
      for (int64_t g = 0; g < G; ++g) {
        V sum = vec16::mul(vec16::load(q[i] + g * D), k[0]);
        for (int64_t c = 1; c < C; ++c) sum = vec16::fmadd(vec16::load(q[i] + g * D + 16 * c), k[c], sum);
        partial[i][g * kTile + t] = sum;
      }
    }
  }
  for (int i = 0; i < Q; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t t = n[i]; t < kTile; ++t) partial[i][g * kTile + t] = vec16::zero();
      V s = vec16::hsum(partial[i] + g * kTile);
      if constexpr (kScaled) s = vec16::mul(s, vec16::load(key_scale));
      if (soft_cap > 0.0f) s = vec16::soft_cap(s, soft_cap);
      s = vec16::first(s, n[i], -INFINITY);
      const float new_max = std::max(m[i][g], vec16::reduce_max(s));
      const float alpha = std::exp(m[i][g] - new_max);  // 0 on the first tile (m = -inf)
      const V e = vec16::first(vec16::exp(vec16::sub(s, vec16::set1(new_max))), n[i], 0.0f);
      l[i][g] = std::fma(l[i][g], alpha, vec16::reduce_add(e));  // fused explicitly: the same in every instantiation
      m[i][g] = new_max;
      if constexpr (kScaled) {
        vec16::store(p[i] + g * kTile, vec16::mul(e, vec16::load(value_scale)));
      } else {
        vec16::store(p[i] + g * kTile, e);
      }
      rescale[i][g] = alpha;
    }
  }
  if constexpr (Q > 1) {
    add_values_apart<T, kD, kG, Q>(key, n, rows, offset + kv_half, head_dim, group, p, rescale, acc);
  } else {
    add_values<T, kD, kG, Q>(key, n, rows, offset + kv_half, head_dim, group, p, rescale, acc);
  }
}

// How many queries attend_tile takes at once in a prompt's rows: as many as keep their
// accumulators (G * D / 16 vectors each) in 16 of AVX-512's 32 registers, at most 4; one with
// AVX2 (a vector is two of its 16 registers) or a head dim or group known only at run time.
// Idle 2-core Zen 4, 500 prompt rows after 1,000 cached positions, against one query at a time:
// the 1.7B shape (one query head per KV head: 4 rows at once) 1.21-1.29x; SmolLM2-135M (groups
// of 3) ran 0.65x with 2 rows at once (24 registers), hence the 16.
template <int64_t kD, int64_t kG>
constexpr int queries_at_once() {
#if defined(SY_VEC16_AVX2)
  return 1;
#else
  return kD > 0 && kG > 0 ? static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(4, 16 / (kD / 16 * kG)))) : 1;
#endif
}

// Attention (as attend_range) for `count` queries of one request that start their range at the same `lo` (a
// prompt's consecutive tokens laid out as decode rows: one block-table row, query i's range ending
// at his[i]): each tile's rows are found and prefetched once, and each KV head's share of the tile
// is taken by every query whose range covers it while it is in L1, so a prompt chunk reads its
// prefix once per tile instead of once per query. Each query gets exactly the attend_tile calls
// attend_range would make for it alone (the same tiles and counts, heads in the same order), so
// its m, l and acc are the same bits. A tile's rows hold all KV heads side by side, so the heads
// are taken one after the other on the same tile, which then stays in the core's cache.
// Blocks lie anywhere in the cache, so the hardware prefetcher cannot guess the next one: each
// tile's rows (keys and values) are prefetched into L2 while the tile before is worked on, a
// share before each KV head's work, so the misses overlap the arithmetic (2-core Zen 4, 64
// requests of ~160 positions, 30 layers: 21 -> 14 ms; into L1, or all at once at the tile's
// start, stalls on the misses instead).
template <typename T, int64_t kD, int64_t kG>
void attend_range_rows(const Rows& rows, int64_t count, const float* const* q, int64_t head_dim, int64_t group,
                       float soft_cap, int64_t lo, const int64_t* his, float* const* m, float* const* l,
                       float* const* acc) {
  const int64_t D = kD > 0 ? kD : head_dim, G = kG > 0 ? kG : group, H = rows.num_kv_heads, W = rows.row;
  const int64_t row_stride = H * W;
  constexpr int kQ = queries_at_once<kD, kG>();
  const T* cache = static_cast<const T*>(rows.cache);
  int64_t hi = lo;
  for (int64_t i = 0; i < count; ++i) {
    std::fill(acc[i], acc[i] + H * G * D, 0.0f);
    std::fill(m[i], m[i] + H * G, -INFINITY);
    std::fill(l[i], l[i] + H * G, 0.0f);
    hi = std::max(hi, his[i]);
  }
  const int64_t bs = rows.block_size, row_bytes = row_stride * static_cast<int64_t>(sizeof(T));
  const int64_t half_bytes = rows.kv_half * static_cast<int64_t>(sizeof(T));
  int64_t reading_block = lo / bs, reading_offset = lo % bs, prefetch_block = reading_block, prefetch_offset = reading_offset;
  const auto next_row = [&](int64_t& block, int64_t& offset) {
    const T* row = cache + (static_cast<int64_t>(rows.table[block]) * bs + offset) * row_stride;
    if (++offset == bs) offset = 0, ++block;
    return row;
  };
  const auto prefetch = [&](int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const char* row = reinterpret_cast<const char*>(next_row(prefetch_block, prefetch_offset));
      for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        _mm_prefetch(row + byte, _MM_HINT_T1);
        _mm_prefetch(row + half_bytes + byte, _MM_HINT_T1);
      }
    }
  };
  prefetch(std::min<int64_t>(kTile, hi - lo));
  const T* key[kTile];
  for (int64_t pos = lo; pos < hi; pos += kTile) {
    const int64_t n = std::min<int64_t>(kTile, hi - pos);
    const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(kTile, hi - pos - kTile));
    for (int64_t t = 0; t < n; ++t) key[t] = next_row(reading_block, reading_offset);
    for (int64_t h = 0; h < H; ++h) {
      prefetch(ahead * (h + 1) / H - ahead * h / H);
      if constexpr (kQ == 1) {
        for (int64_t i = 0; i < count; ++i) {
          if (his[i] <= pos) continue;
          const int64_t n_i = std::min<int64_t>(kTile, his[i] - pos);
          const float* q_i = q[i] + h * G * D;
          float *m_i = m[i] + h * G, *l_i = l[i] + h * G, *acc_i = acc[i] + h * G * D;
          attend_tile<T, kD, kG>(key, &n_i, h * W, rows.kv_half, &q_i, D, G, soft_cap, &m_i, &l_i, &acc_i);
        }
      } else {
        // the queries whose range reaches this tile, their rows of it and their head h's state
        int64_t active = 0, counts[kMaxQueries];
        const float* qh[kMaxQueries];
        float *mh[kMaxQueries], *lh[kMaxQueries], *acch[kMaxQueries];
        for (int64_t i = 0; i < count; ++i) {
          if (his[i] <= pos) continue;
          counts[active] = std::min<int64_t>(kTile, his[i] - pos), qh[active] = q[i] + h * G * D;
          mh[active] = m[i] + h * G, lh[active] = l[i] + h * G, acch[active] = acc[i] + h * G * D, ++active;
        }
        int64_t i = 0;
        for (; i + kQ <= active; i += kQ)
          attend_tile<T, kD, kG, kQ>(key, counts + i, h * W, rows.kv_half, qh + i, D, G, soft_cap, mh + i, lh + i, acch + i);
        for (; i < active; ++i)
          attend_tile<T, kD, kG>(key, counts + i, h * W, rows.kv_half, qh + i, D, G, soft_cap, mh + i, lh + i, acch + i);
      }
    }
  }
}

// Attention of every query head (q [H * G * D], float32, already scaled) over positions
// [lo, hi) of the request; writes the running max m[H * G], sum l[H * G] and unnormalised
// acc[H * G * D]: attend_range_rows for one query.
template <typename T, int64_t kD, int64_t kG>
void attend_range(const Rows& rows, const float* q, int64_t head_dim, int64_t group, float soft_cap, int64_t lo,
                  int64_t hi, float* m, float* l, float* acc) {
  attend_range_rows<T, kD, kG>(rows, 1, &q, head_dim, group, soft_cap, lo, &hi, &m, &l, &acc);
}

}  // namespace paged_decode_simd
#endif  // SY_VEC16
