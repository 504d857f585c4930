// The AVX-512 body of paged_decode.cpp: one task's attention over a range of positions.
//
// A task is one request's query heads over positions [lo, hi). Positions go in tiles of 16
// (a tile may straddle cache blocks: its rows are found through the block table one by
// one); on each tile, each KV head's `group` query heads together (GQA folded: every K/V
// row is read once for all of them):
//   scores  for each row, one fused multiply-add chain per query head leaves 16 partial
//           sums in a register; a transposing reduction (hsum16) turns the tile's 16 such
//           registers into one register of 16 scores;
//   softmax online, in float32, per query head: running max m and sum l, and the
//           unnormalised output acc rescaled once per tile;
//   values  acc += p * v, row by row, with acc held in registers across the tile when the
//           head dim and group are compile-time constants.
// Rows are converted bf16 -> float32 once per row (a shift of the 16 bits), then shared
// by the group's heads. head_dim must be a multiple of 16.
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace paged_decode_avx512 {

constexpr int64_t kTile = 16;  // rows per tile: one score register

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp of every lane (Cephes expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp;
// inputs clamped to float's finite range, 2^n applied by scalef).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.37f)), _mm512_set1_ps(-87.33f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1).
inline __m512 soft_cap16(__m512 x, float cap) {
  const __m512 e = exp16(_mm512_mul_ps(x, _mm512_set1_ps(2.0f / cap)));
  const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                 _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

// Lane i of the result: the sum of the 16 lanes of v[i]. Pairs are folded within 128-bit
// lanes (unpack 32-, then 64-bit), then the four 128-bit lanes are transposed and added.
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// What a task needs to find its rows: `table` is the request's block-table row.
struct Rows {
  const void* cache;
  const int32_t* table;
  int64_t block_size, num_kv_heads, kv_half;
};

// One tile (n <= 16 rows, `key` their first KV head's key rows) for the G query heads of
// KV head h: scores, online softmax update of m[G], l[G], and acc[G * D] += p * v.
template <typename T, int64_t kD, int64_t kG>
inline void attend_tile(const T* const* key, int64_t n, int64_t offset, int64_t kv_half, const float* q,
                        int64_t head_dim, int64_t group, float soft_cap, float* m, float* l, float* acc) {
  const int64_t D = kD > 0 ? kD : head_dim, G = kG > 0 ? kG : group, C = D / 16;
  constexpr int64_t kAcc = kD > 0 && kG > 0 ? kD / 16 * kG : 16 * 16;  // registers of acc
  __m512 a[kAcc], partial[16 * kTile];  // partial: [G][kTile]; 16 is the largest group
  alignas(64) float p[16 * kTile];
  for (int64_t t = 0; t < n; ++t) {
    __m512 k[kD > 0 ? kD / 16 : 16];
    for (int64_t c = 0; c < C; ++c) k[c] = load16(key[t] + offset + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), k[0]);
      for (int64_t c = 1; c < C; ++c) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * c), k[c], sum);
      partial[g * kTile + t] = sum;
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = n; t < kTile; ++t) partial[g * kTile + t] = _mm512_setzero_ps();
    __m512 s = hsum16(partial + g * kTile);
    if (soft_cap > 0.0f) s = soft_cap16(s, soft_cap);
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
    const float new_max = std::max(m[g], _mm512_reduce_max_ps(s));
    const float alpha = std::exp(m[g] - new_max);  // 0 on the first tile (m = -inf)
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
    l[g] = l[g] * alpha + _mm512_reduce_add_ps(e);
    m[g] = new_max;
    _mm512_store_ps(p + g * kTile, e);
    const __m512 scale = _mm512_set1_ps(alpha);
    for (int64_t c = 0; c < C; ++c) a[g * C + c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), scale);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[kD > 0 ? kD / 16 : 16];
    for (int64_t c = 0; c < C; ++c) v[c] = load16(key[t] + kv_half + offset + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 weight = _mm512_set1_ps(p[g * kTile + t]);
      for (int64_t c = 0; c < C; ++c) a[g * C + c] = _mm512_fmadd_ps(weight, v[c], a[g * C + c]);
    }
  }
  for (int64_t i = 0; i < G * C; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

// Attention of every query head (q [H * G * D], float32, already scaled) over positions
// [lo, hi) of the request; writes the running max m[H * G], sum l[H * G] and unnormalised
// acc[H * G * D]. A tile's rows hold all KV heads side by side, so the heads are taken one
// after the other on the same tile, which then stays in the core's cache.
template <typename T, int64_t kD, int64_t kG>
void attend_range(const Rows& rows, const float* q, int64_t head_dim, int64_t group, float soft_cap, int64_t lo,
                  int64_t hi, float* m, float* l, float* acc) {
  const int64_t D = kD > 0 ? kD : head_dim, G = kG > 0 ? kG : group, H = rows.num_kv_heads;
  const int64_t row_stride = H * D;
  const T* cache = static_cast<const T*>(rows.cache);
  std::fill(acc, acc + H * G * D, 0.0f);
  std::fill(m, m + H * G, -INFINITY);
  std::fill(l, l + H * G, 0.0f);
  int64_t block = lo / rows.block_size, offset = lo % rows.block_size;
  // the rows of the next tile: found (and prefetched) one tile ahead, since blocks lie
  // anywhere in the cache and the hardware prefetcher cannot guess the next one
  const auto find_rows = [&](int64_t n, const T** key) {
    for (int64_t t = 0; t < n; ++t) {
      key[t] = cache + (static_cast<int64_t>(rows.table[block]) * rows.block_size + offset) * row_stride;
      if (++offset == rows.block_size) offset = 0, ++block;
      for (int64_t byte = 0; byte < row_stride * static_cast<int64_t>(sizeof(T)); byte += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(key[t]) + byte, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(key[t] + rows.kv_half) + byte, _MM_HINT_T0);
      }
    }
  };
  const T* key[kTile];
  const T* next[kTile];
  find_rows(std::min<int64_t>(kTile, hi - lo), next);
  for (int64_t pos = lo; pos < hi; pos += kTile) {
    const int64_t n = std::min<int64_t>(kTile, hi - pos);
    std::copy(next, next + n, key);
    if (pos + kTile < hi) find_rows(std::min<int64_t>(kTile, hi - pos - kTile), next);
    for (int64_t h = 0; h < H; ++h) {
      attend_tile<T, kD, kG>(key, n, h * D, rows.kv_half, q + h * G * D, D, G, soft_cap, m + h * G, l + h * G,
                             acc + h * G * D);
    }
  }
}

}  // namespace paged_decode_avx512
