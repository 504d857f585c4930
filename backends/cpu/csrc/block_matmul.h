#pragma once
// x @ W^T with W in ggml's block formats (q4_0, q4_1, q8_0), multiplied in integers without
// dequantizing W, as llama.cpp's CPU backend does with its repacked ("interleaved") formats.
//
// W is repacked once at load (backends/cpu/block_pack.py; the one description of the layout)
// into tiles of 16 output rows. Tile t, block b (weights 32b..32b+31 of the tile's 16 rows) is
// one record of 64 + P bytes:
//   fp16 d[16], fp16 c[16]      every weight of row r in the block is w = d[r] * u + c[r]
//   P payload bytes of u        u unsigned: 4 bits (P = 256) or 8 bits (P = 512)
// q4_1 is u = q, c = m; q4_0 is u = q, c = -8d; q8_0 is u = q + 128, c = -128d: one kernel.
// The payload is 8 chunks of 16 int32 lanes, lane r of chunk j holding row r's u for the 4
// weights 4j..4j+3 of the block; 4-bit payloads keep chunks 2g (low nibbles) and 2g+1 (high
// nibbles) in one 64-byte group g. A record's tiles follow each other: tile t is the bytes
// [t * blocks * record, (t + 1) * blocks * record).
//
// x [M, K] (float32 or bfloat16) is first rounded per 32 values to int8 qa with scale
// e = max|x| / 127 (llama.cpp's q8_0 activations), and s = e * sum(qa) per block. Then
//   out[m, n] = sum_b  d e_b * sum_k(u qa)  +  c s_b
// where sum_k(u qa) is 8 vpdpbusd (u8 x s8 -> 16 int32 lanes, one per output row) with the
// activations' 4-byte groups broadcast. A tile's weights are unpacked once into registers per
// group of kRowsPerTile input rows. Work is split over tiles with at::parallel_for (built with
// -fopenmp). With AVX2 (no AVX512-VNNI) each tile is two halves of 8 rows, each multiplied
// with vpmaddubsw (see the AVX2 section); without either a portable loop does the same arithmetic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// SY_BLOCK_PORTABLE (tests) builds the portable loop on any CPU.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__) && \
    !defined(SY_BLOCK_PORTABLE)
#define SY_BLOCK_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SY_BLOCK_PORTABLE)
#define SY_BLOCK_AVX2 1
#endif

namespace {
namespace blocks {

constexpr int64_t kBlock = 32;
constexpr int64_t kTileRows = 16;
constexpr int64_t kHeader = 64;
constexpr int64_t kRowsPerTile = 4;  // input rows whose accumulators stay in registers

constexpr int64_t record_bytes(int64_t bits) { return kHeader + (bits == 4 ? 256 : 512); }

inline float half_to_float(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }

// The activations in blocks: qa int8 [M, K], e [M, K/32], s = e * sum(qa) [M, K/32].
struct QuantizedInput {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> scaled_sum;
};

template <typename T>
void quantize_block(const T* v, int8_t* q, float* e_out, float* s_out) {
  float x[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) x[j] = static_cast<float>(v[j]);
  float amax = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float e = amax / 127.0f;
  const float inverse = e > 0.0f ? 1.0f / e : 0.0f;
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inverse));
    sum += q[j];
  }
  *e_out = e;
  *s_out = e * static_cast<float>(sum);
}

template <typename T>
QuantizedInput quantize_input(const T* x, int64_t M, int64_t K) {
  const int64_t blocks = M * (K / kBlock);
  QuantizedInput in{std::vector<int8_t>(M * K), std::vector<float>(blocks), std::vector<float>(blocks)};
  at::parallel_for(0, blocks, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // block i of the flattened [M, K] (K is a multiple of 32)
      quantize_block(x + i * kBlock, in.q.data() + i * kBlock, &in.scale[i], &in.scaled_sum[i]);
  });
  return in;
}

template <typename T>
inline void store_row(T* out, const float* values, int64_t count) {
  for (int64_t r = 0; r < count; ++r) out[r] = static_cast<T>(values[r]);
}

#if defined(SY_BLOCK_VNNI) || defined(SY_BLOCK_AVX2)
// Weights are read once per step, from memory: each record's lines are prefetched this far
// ahead (a thread's tiles are contiguous). 2-core AVX2 EPYC, the default model's 120 Q4_1
// linears at one row: 8.6-9.3 ms without, 6.1-7.9 with 2 KB (0.5 and 1 KB in between); its
// Q8_0 LM head 2.6-2.8 ms without, 1.5-1.9 with.
constexpr int64_t kPrefetchBytes = 2048;

// The lines of the record kPrefetchBytes ahead of rec.
template <int64_t Bits>
inline void prefetch_record(const uint8_t* rec) {
  for (int64_t line = 0; line < record_bytes(Bits); line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchBytes + line), _MM_HINT_T0);
  }
}
#endif

#if defined(SY_BLOCK_VNNI)
// The 8 chunks of one record's payload as u8 lanes (chunk j pairs with activation group j).
template <int64_t Bits>
inline void unpack(const uint8_t* payload, __m512i w[8]) {
  if constexpr (Bits == 8) {
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(payload + 64 * j);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(payload + 64 * g);
      w[2 * g] = _mm512_and_si512(v, low);
      w[2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  }
}

// One tile times R input rows from m0: the R accumulators (and the c terms, kept apart so that
// each block adds to two independent chains) stay in registers, R a constant.
template <int64_t Bits, int R, typename T>
inline void tile_rows(const QuantizedInput& in, const uint8_t* tile, int64_t blocks, int64_t m0, bool prefetch,
                      T* out, int64_t N, int64_t count) {
  constexpr int64_t record = record_bytes(Bits);
  __m512 acc[R], acc_c[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps(), acc_c[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + b * record;
    if (prefetch) prefetch_record<Bits>(rec);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
    const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
    __m512i w[8];
    unpack<Bits>(rec + kHeader, w);
    for (int m = 0; m < R; ++m) {
      const int64_t at = (m0 + m) * blocks + b;
      const int32_t* a = reinterpret_cast<const int32_t*>(in.q.data() + at * kBlock);
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(a[j]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(in.scale[at])), acc[m]);
      acc_c[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(in.scaled_sum[at]), acc_c[m]);
    }
  }
  for (int m = 0; m < R; ++m) {
    alignas(64) float values[kTileRows];
    _mm512_store_ps(values, _mm512_add_ps(acc[m], acc_c[m]));
    store_row(out + (m0 + m) * N, values, count);
  }
}

template <int64_t Bits, typename T>
void tiles(const QuantizedInput& in, const uint8_t* packed, T* out, int64_t M, int64_t N, int64_t K,
           int64_t t_begin, int64_t t_end) {
  const int64_t blocks = K / kBlock, record = record_bytes(Bits);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* tile = packed + t * blocks * record;
    const int64_t rows_here = std::min(kTileRows, N - t * kTileRows);
    T* o = out + t * kTileRows;
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile) {
      const bool prefetch = m0 == 0;  // later groups find the tile in cache
      switch (std::min(kRowsPerTile, M - m0)) {
        case 1: tile_rows<Bits, 1>(in, tile, blocks, m0, prefetch, o, N, rows_here); break;
        case 2: tile_rows<Bits, 2>(in, tile, blocks, m0, prefetch, o, N, rows_here); break;
        case 3: tile_rows<Bits, 3>(in, tile, blocks, m0, prefetch, o, N, rows_here); break;
        default: tile_rows<Bits, 4>(in, tile, blocks, m0, prefetch, o, N, rows_here); break;
      }
    }
  }
}
#elif defined(SY_BLOCK_AVX2)
// AVX2: a 256-bit register holds 8 rows' lanes, so a tile is two halves (rows 8h..8h+7: bytes
// 32h..32h+31 of every 64-byte chunk or group, fp16 fields 8h..8h+7), multiplied one after the
// other (a tile's records, at most a few KB, stay in L1 for the second half). vpmaddubsw takes
// u8 weights times s8 activations into int16 pair sums:
// - 4 bits: u <= 15 and |qa| <= 127, so even the 8 chunks' sum stays below 2^15: a block is
//   8 vpmaddubsw, 7 int16 adds and one vpmaddwd to int32.
// - 8 bits: u up to 255 would saturate int16, so u is turned back into q = u - 128 (u ^ 0x80 as
//   s8) and multiplied as |q| times qa with q's sign (llama.cpp's AVX2 q8_0 dot), each chunk
//   widened to int32 at once. That sums q qa = u qa - 128 qa, so the block's c becomes c + 128 d.

template <int64_t Bits>
inline void unpack_half(const uint8_t* payload, int64_t h, __m256i w[8]) {
  const auto at = [&](int64_t offset) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(payload + offset + 32 * h)); };
  if constexpr (Bits == 8) {
    const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; ++j) w[j] = _mm256_xor_si256(at(64 * j), sign);
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      const __m256i v = at(64 * g);
      w[2 * g] = _mm256_and_si256(v, low);
      w[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
  }
}

// The int32 dots of 8 rows' block (w) with one row's quantized block (a, 8 groups of 4 bytes).
template <int64_t Bits>
inline __m256i block_dot(const __m256i w[8], const int32_t* a) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 4) {
    __m256i sum = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(a[0]));
    for (int j = 1; j < 8; ++j) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(a[j])));
    return _mm256_madd_epi16(sum, ones);
  } else {
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(_mm256_set1_epi32(a[j]), w[j]));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
    }
    return sum;
  }
}

// Half h of one record: its rows' d and c (c corrected by +128d for q8, see above), its weights
// unpacked into w.
template <int64_t Bits>
inline void load_half(const uint8_t* rec, int64_t h, __m256& d, __m256& c, __m256i w[8]) {
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
  c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 + 16 * h)));
  if constexpr (Bits == 8) c = _mm256_fmadd_ps(d, _mm256_set1_ps(128.0f), c);
  unpack_half<Bits>(rec + kHeader, h, w);
}


// Half h of one tile times R input rows from m0: the R accumulators (and the c terms, kept apart
// so that each block adds to two independent chains) stay in registers, R a constant.
template <int64_t Bits, int R, typename T>
inline void tile_half(const QuantizedInput& in, const uint8_t* tile, int64_t blocks, int64_t h, int64_t m0, bool prefetch,
                      T* out, int64_t N, int64_t count) {
  constexpr int64_t record = record_bytes(Bits);
  __m256 acc[R], acc_c[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps(), acc_c[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + b * record;
    if (prefetch) prefetch_record<Bits>(rec);
    __m256 d, c;
    __m256i w[8];
    load_half<Bits>(rec, h, d, c, w);
    for (int m = 0; m < R; ++m) {
      const int64_t at = (m0 + m) * blocks + b;
      const __m256i dot = block_dot<Bits>(w, reinterpret_cast<const int32_t*>(in.q.data() + at * kBlock));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(in.scale[at])), acc[m]);
      acc_c[m] = _mm256_fmadd_ps(c, _mm256_set1_ps(in.scaled_sum[at]), acc_c[m]);
    }
  }
  for (int m = 0; m < R; ++m) {
    alignas(32) float values[8];
    _mm256_store_ps(values, _mm256_add_ps(acc[m], acc_c[m]));
    store_row(out + (m0 + m) * N, values, count);
  }
}

// A whole tile (both halves in one pass over its records, each read once) times one input row.
template <int64_t Bits, typename T>
inline void tile_one_row(const QuantizedInput& in, const uint8_t* tile, int64_t blocks, T* out, int64_t rows_here) {
  constexpr int64_t record = record_bytes(Bits);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, acc_c[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + b * record;
    prefetch_record<Bits>(rec);
    const int32_t* a = reinterpret_cast<const int32_t*>(in.q.data() + b * kBlock);
    const __m256 e = _mm256_set1_ps(in.scale[b]), s = _mm256_set1_ps(in.scaled_sum[b]);
    for (int h = 0; h < 2; ++h) {
      __m256 d, c;
      __m256i w[8];
      load_half<Bits>(rec, h, d, c, w);
      acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot<Bits>(w, a)), _mm256_mul_ps(d, e), acc[h]);
      acc_c[h] = _mm256_fmadd_ps(c, s, acc_c[h]);
    }
  }
  alignas(32) float values[16];
  _mm256_store_ps(values, _mm256_add_ps(acc[0], acc_c[0]));
  _mm256_store_ps(values + 8, _mm256_add_ps(acc[1], acc_c[1]));
  store_row(out, values, rows_here);
}

template <int64_t Bits, typename T>
void tiles(const QuantizedInput& in, const uint8_t* packed, T* out, int64_t M, int64_t N, int64_t K,
           int64_t t_begin, int64_t t_end) {
  const int64_t blocks = K / kBlock, record = record_bytes(Bits);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* tile = packed + t * blocks * record;
    const int64_t rows_here = std::min(kTileRows, N - t * kTileRows);
    if (M == 1) {
      tile_one_row<Bits>(in, tile, blocks, out + t * kTileRows, rows_here);
      continue;
    }
    for (int64_t h = 0; h < 2 && 8 * h < rows_here; ++h) {
      T* o = out + t * kTileRows + 8 * h;
      const int64_t count = std::min<int64_t>(8, rows_here - 8 * h);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile) {
        const bool prefetch = h == 0 && m0 == 0;
        switch (std::min(kRowsPerTile, M - m0)) {
          case 1: tile_half<Bits, 1>(in, tile, blocks, h, m0, prefetch, o, N, count); break;
          case 2: tile_half<Bits, 2>(in, tile, blocks, h, m0, prefetch, o, N, count); break;
          case 3: tile_half<Bits, 3>(in, tile, blocks, h, m0, prefetch, o, N, count); break;
          default: tile_half<Bits, 4>(in, tile, blocks, h, m0, prefetch, o, N, count); break;
        }
      }
    }
  }
}
#else
template <int64_t Bits, typename T>
void tiles(const QuantizedInput& in, const uint8_t* packed, T* out, int64_t M, int64_t N, int64_t K,
           int64_t t_begin, int64_t t_end) {
  const int64_t blocks = K / kBlock, record = record_bytes(Bits);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* tile = packed + t * blocks * record;
    const int64_t rows_here = std::min(kTileRows, N - t * kTileRows);
    for (int64_t m = 0; m < M; ++m) {
      float acc[kTileRows] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* rec = tile + b * record;
        const int64_t at = m * blocks + b;
        const int8_t* a = in.q.data() + at * kBlock;
        for (int64_t r = 0; r < kTileRows; ++r) {
          uint16_t d_bits, c_bits;
          std::memcpy(&d_bits, rec + 2 * r, 2);
          std::memcpy(&c_bits, rec + 32 + 2 * r, 2);
          int32_t dot = 0;
          for (int64_t j = 0; j < 8; ++j) {
            for (int64_t i = 0; i < 4; ++i) {
              int32_t u;
              if constexpr (Bits == 8) {
                u = rec[kHeader + 64 * j + 4 * r + i];
              } else {
                const uint8_t byte = rec[kHeader + 64 * (j / 2) + 4 * r + i];
                u = j % 2 == 0 ? byte & 0x0F : byte >> 4;
              }
              dot += u * a[4 * j + i];
            }
          }
          acc[r] += half_to_float(d_bits) * in.scale[at] * static_cast<float>(dot)
                    + half_to_float(c_bits) * in.scaled_sum[at];
        }
      }
      store_row(out + m * N + t * kTileRows, acc, rows_here);
    }
  }
}
#endif

template <typename T>
void run(const at::Tensor& x, const uint8_t* packed, at::Tensor& out, int64_t N, int64_t bits) {
  const int64_t M = x.size(0), K = x.size(1);
  const QuantizedInput in = quantize_input(x.data_ptr<T>(), M, K);
  T* op = out.data_ptr<T>();
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    if (bits == 4) tiles<4>(in, packed, op, M, N, K, begin, end);
    else tiles<8>(in, packed, op, M, N, K, begin, end);
  });
}

at::Tensor block_mm(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "block_mm: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "block_mm: x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "block_mm: packed must be contiguous uint8 [tiles, K/32 * record bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % kBlock == 0 && packed.size(0) == (N + kTileRows - 1) / kTileRows &&
              packed.size(1) == K / kBlock * record_bytes(bits),
              "block_mm: packed weight does not match x's width or out_features");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  if (x.scalar_type() == at::kFloat) run<float>(xc, packed.data_ptr<uint8_t>(), out, N, bits);
  else run<c10::BFloat16>(xc, packed.data_ptr<uint8_t>(), out, N, bits);
  return out;
}

// "avx512-vnni", "avx2" or "portable": which loop this build runs (the caller prefers another
// kernel over the portable loop where it has one).
std::string block_mm_isa() {
#if defined(SY_BLOCK_VNNI)
  return "avx512-vnni";
#elif defined(SY_BLOCK_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace blocks
}  // namespace

