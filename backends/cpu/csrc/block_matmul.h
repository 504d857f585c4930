#pragma once
// x @ W^T with W in ggml's block formats (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k),
// multiplied in integers without dequantizing W, as llama.cpp's CPU backend does with its
// repacked ("interleaved") formats.
//
// W is repacked once at load (backends/cpu/block_pack.py; the one description of the layout)
// into tiles of 16 output rows, in one or more segments of consecutive output rows (a fused
// q/k/v whose parts come in different formats is one segment per part). A segment has a
// layout (bits, group, scheme): every weight is w = d * u + c with u unsigned of `bits` bits
// (4, 5, 6 or 8), d, c per `group` weights (32, or 16 for q6_k), stored as the scale scheme
// says (kScheme*: the file's own fields; for the k-quants sub-scales per group and fp16 scales
// per super-block of 8 blocks). Tile t, block b (weights 32b..32b+31 of the tile's 16 rows) is
// one record:
//   header: the scheme's fields, 16 rows each (scales1 reads them; 32 or 64 bytes a group)
//   payload: 8 chunks of 16 four-byte lanes, lane r of chunk j holding row r's u for the 4
//     weights 4j..4j+3 of the block. 8 bits: the 8 chunks, 512 bytes. 4-6 bits: the low
//     nibbles, chunks 2q (low halves) and 2q+1 (high halves) sharing the 64 bytes of nibble
//     group q (256 bytes), then one 64-byte plane per bit above 4: 8 bytes a chunk, bit 4r+i
//     of chunk j's 64-bit word = that bit of lane r's byte i.
// A k-quant super-block's scales come just before its first record. A segment's tiles follow
// each other: tile t is the bytes [t * tile_bytes, (t + 1) * tile_bytes) from the segment's
// byte offset. Every path (VNNI, AMX, AVX2, portable, dequantization) reads a group's (d, c)
// through one function per vector width (scales16, scales8, scales1), each forming the same
// exact float32 values.
//
// x [M, K] (float32 or bfloat16) is first rounded per 32 values to int8 qa with scale
// e = max|x| / 127 (llama.cpp's q8_0 activations), with s = e * sum(qa) per block and per half
// block; with two passes, what that rounding lost is rounded the same way into a second row of
// qa, multiplied as another input row, and the two rows' outputs are summed. Then
//   out[m, n] = sum_groups  d e * sum_k(u qa)  +  c s
// where sum_k(u qa) is vpdpbusd (u8 x s8 -> 16 int32 lanes, one per output row) with the
// activations' 4-byte groups broadcast. A tile's weights are unpacked once into registers per
// group of rows_per_pass input rows (with AMX, steps of 16 rows or more take tile ops instead:
// see "AMX"). Work is split over tiles with at::parallel_for (built with -fopenmp). AVX-512
// without VNNI runs the same loop with vpmaddubsw and vpmaddwd in place of vpdpbusd (dot_bw);
// with AVX2 each tile is two halves of 8 rows, each multiplied with vpmaddubsw (see the AVX2
// section); without either a portable loop does the same arithmetic. Every loop gives the same
// bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// SY_BLOCK_PORTABLE (tests) builds the portable loop on any CPU.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__) && \
    !defined(SY_BLOCK_PORTABLE)
#define SY_BLOCK_VNNI 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__) && !defined(SY_BLOCK_PORTABLE)
#define SY_BLOCK_AVX512 1  // AVX-512 without VNNI (Skylake-SP/X): see dot_bw
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SY_BLOCK_PORTABLE)
#define SY_BLOCK_AVX2 1
#endif
#if defined(SY_BLOCK_VNNI) || defined(SY_BLOCK_AVX512)
#define SY_BLOCK_ZMM 1  // the loop of 16-row tiles in 512-bit registers
#endif
// AMX-INT8 (Sapphire Rapids and later) beside VNNI: see "AMX" below.
#if defined(SY_BLOCK_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SY_BLOCK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
namespace blocks {

constexpr int64_t kBlock = 32;
constexpr int64_t kTileRows = 16;
// Input rows whose accumulators stay in registers through one pass over a tile (a tile half with
// AVX2): each unpacking of a record's weights serves that many rows. 8, or 4 for 8-bit weights
// in the VNNI loop (loaded as they lie, nothing to share). Idle 2-core Zen 4, against 4 rows,
// 8-256 rows: VNNI q6_k 1.09-1.23x, q4_k and q4_1 1.04-1.17x, q8_0 0.91x with 8 (hence 4); AVX2
// 1.05-1.38x on every format.
constexpr int64_t rows_per_pass(int64_t bits) {
#if defined(SY_BLOCK_ZMM)
  return bits == 8 ? 4 : 8;
#else
  return 8;
#endif
}

// Scale schemes: how a record (and, for the k-quants, its super-block) stores the (d, c) of
// each scale group; block_pack.py's SCHEMES, with the same numbers.
constexpr int64_t kSchemeDC = 0;   // fp16 d[16], fp16 c[16] per group (q4_1, q5_1)
constexpr int64_t kSchemeD = 1;    // fp16 d[16] per group; c = -2^(bits-1) d (q4_0, q5_0, q8_0)
constexpr int64_t kSchemeK = 2;    // uint8 sc[16], mn[16]; per super-block fp16 d[16], dmin[16] (q4_k, q5_k)
constexpr int64_t kSchemeK6 = 3;   // int8 sc[16] per group; per super-block fp16 d[16]; c = -32 d (q6_k)
constexpr int64_t kSuperBlocks = 8;  // blocks of a k-quant super-block (256 weights)

// The sizes of a layout (bits, group, scheme) in one place: scale groups of a block (G), a
// record's header and payload, a super-block's scales, a tile of `blocks` records.
constexpr int64_t groups_of(int64_t group) { return kBlock / group; }
constexpr int64_t header_bytes(int64_t group, int64_t scheme) {
  return scheme == kSchemeDC ? 64 * groups_of(group) : scheme == kSchemeD ? 32 * groups_of(group) : 32;
}
constexpr int64_t super_bytes(int64_t scheme) { return scheme == kSchemeK ? 64 : scheme == kSchemeK6 ? 32 : 0; }
constexpr int64_t payload_bytes(int64_t bits) { return bits == 8 ? 512 : 256 + 64 * (bits - 4); }
constexpr int64_t record_bytes(int64_t bits, int64_t group, int64_t scheme) {
  return header_bytes(group, scheme) + payload_bytes(bits);
}
constexpr int64_t tile_bytes(int64_t bits, int64_t group, int64_t scheme, int64_t blocks) {
  return blocks * record_bytes(bits, group, scheme) + blocks / kSuperBlocks * super_bytes(scheme);
}
// Block b's record in its tile, and its super-block's scales (k-quants), which precede the
// super-block's first record; where block b's bytes start (with its scales for a first block).
constexpr int64_t record_offset(int64_t bits, int64_t group, int64_t scheme, int64_t b) {
  return b * record_bytes(bits, group, scheme) + (b / kSuperBlocks + 1) * super_bytes(scheme);
}
constexpr int64_t super_offset(int64_t bits, int64_t group, int64_t scheme, int64_t b) {
  return b / kSuperBlocks * (kSuperBlocks * record_bytes(bits, group, scheme) + super_bytes(scheme));
}
constexpr int64_t block_start(int64_t bits, int64_t group, int64_t scheme, int64_t b) {
  return b % kSuperBlocks == 0 ? super_offset(bits, group, scheme, b) : record_offset(bits, group, scheme, b);
}
// The layouts the kernel has (read_segments refuses the others).
constexpr bool known_layout(int64_t bits, int64_t group, int64_t scheme) {
  return group == 32 ? ((bits == 4 || bits == 5) && scheme != kSchemeK6) || (bits == 8 && scheme == kSchemeD)
                     : group == 16 && bits == 6 && scheme == kSchemeK6;
}

inline float half_to_float(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return half_to_float(bits);
}

// The (d, c) of row r, scale group g of a record at rec (its super-block's scales at sup): the
// scalar reading of every scheme. The vector readings (scales16, scales8) compute the same
// float32 values: every product is exact (an 11-bit fp16 mantissa times an integer of at most 8
// bits), so the paths agree to the bit and the k-quants' (d, c) equal the file's.
template <int64_t Bits, int64_t Group, int64_t Scheme>
inline void scales1(const uint8_t* sup, const uint8_t* rec, int64_t r, int64_t g, float& d, float& c) {
  if constexpr (Scheme == kSchemeDC) {
    d = half_at(rec + 64 * g + 2 * r), c = half_at(rec + 64 * g + 32 + 2 * r);
  } else if constexpr (Scheme == kSchemeK) {
    d = half_at(sup + 2 * r) * static_cast<float>(rec[r]);
    c = -1.0f * (half_at(sup + 32 + 2 * r) * static_cast<float>(rec[16 + r]));
  } else {
    d = Scheme == kSchemeD ? half_at(rec + 32 * g + 2 * r)
                           : half_at(sup + 2 * r) * static_cast<float>(static_cast<int8_t>(rec[16 * g + r]));
    c = d * -static_cast<float>(1 << (Bits - 1));
  }
}

// The activations in blocks: qa int8 [M, K], e [M, K/32], s = e * sum(qa) [M, K/32] and per
// half block [M, K/16].
struct QuantizedInput {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> scaled_sum;
  std::vector<float> half_sum;
  std::vector<int32_t> sum;  // sum(qa) per block (the AVX2 loop's 8-bit weights)
  // For AMX (`amx`; transpose_scales): e, s [K/32, M'] and the half sums [K/16, M'], block-major,
  // so that a block's rows are one address apart; M' = padded_rows.
  bool amx = false;
  int64_t padded_rows = 0;
  std::vector<float> scale_t, sum_t, half_t;
};

// Fills the block-major copies of the scales (M' = padded_rows; rows past M stay 0).
inline void transpose_scales(QuantizedInput& in, int64_t M, int64_t blocks) {
  const int64_t Mp = in.padded_rows;
  in.scale_t.assign(blocks * Mp, 0.0f), in.sum_t.assign(blocks * Mp, 0.0f), in.half_t.assign(2 * blocks * Mp, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      in.scale_t[b * Mp + m] = in.scale[m * blocks + b];
      in.sum_t[b * Mp + m] = in.scaled_sum[m * blocks + b];
      in.half_t[2 * b * Mp + m] = in.half_sum[2 * (m * blocks + b)];
      in.half_t[(2 * b + 1) * Mp + m] = in.half_sum[2 * (m * blocks + b) + 1];
    }
  }
}

// One block of 32 values rounded to int8 with e = max|x| / 127; x is left holding what the
// rounding lost (x - e qa), for a second pass.
// The vector versions give the same bits as the scalar loop compiled with FMA (GCC contracts
// its x - e q into one fused multiply-add): max and integer sums are exact in any order, and
// each value takes the same multiply, round to nearest even and fused subtraction.
inline void quantize_block(float* x, int8_t* q, float* e_out, float* s_out, float* half_out, int32_t* sum_out) {
#if defined(SY_BLOCK_ZMM)
  __m512 v[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
  const float e = amax / 127.0f;
  const __m512 inverse = _mm512_set1_ps(e > 0.0f ? 1.0f / e : 0.0f), scale = _mm512_set1_ps(e);
  int32_t sum[2];
  for (int h = 0; h < 2; ++h) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[h], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i qi = _mm512_cvtps_epi32(r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(qi));
    sum[h] = _mm512_reduce_add_epi32(qi);
    _mm512_storeu_ps(x + 16 * h, _mm512_fnmadd_ps(r, scale, v[h]));
  }
#elif defined(SY_BLOCK_AVX2)
  __m256 v[4], a = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i), a = _mm256_max_ps(a, _mm256_and_ps(v[i], abs_mask));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float e = amax / 127.0f;
  const __m256 inverse = _mm256_set1_ps(e > 0.0f ? 1.0f / e : 0.0f), scale = _mm256_set1_ps(e);
  __m256i qi[4];
  int32_t sum[2] = {0, 0};
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[i] = _mm256_cvtps_epi32(r);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), qi[i]);
    for (int j = 0; j < 8; ++j) sum[i / 2] += lanes[j];
    _mm256_storeu_ps(x + 8 * i, _mm256_fnmadd_ps(r, scale, v[i]));
  }
  // int32 -> int8 (|q| <= 127, so the saturating packs are exact); packs work within 128-bit
  // lanes, and the permutation puts the 4-byte groups back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  float amax = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float e = amax / 127.0f;
  const float inverse = e > 0.0f ? 1.0f / e : 0.0f;
  int32_t sum[2] = {0, 0};
  for (int64_t j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inverse));
    sum[j / 16] += q[j];
    x[j] -= e * static_cast<float>(q[j]);
  }
#endif
  *e_out = e;
  *sum_out = sum[0] + sum[1];
  *s_out = e * static_cast<float>(sum[0] + sum[1]);
  half_out[0] = e * static_cast<float>(sum[0]);
  half_out[1] = e * static_cast<float>(sum[1]);
}

// `passes` rows of int8 blocks per input row m (rows passes*m + p): pass 0 is x rounded to
// int8 per 32 values (llama.cpp's q8_0 activations), pass 1 what that rounding lost, rounded
// the same way, so that the two together carry x to about 15 bits (see block_mm).
// `padded_rows` (>= passes M) > 0 (AMX): qa has that many rows, those past passes M zero, and the
// scales are also laid out block-major (transpose_scales); 0: passes M rows.
template <typename T>
QuantizedInput quantize_input(const T* x, int64_t M, int64_t K, int64_t padded_rows, int64_t passes) {
  const bool amx = padded_rows > 0;
  const int64_t rows = passes * M, per_row = K / kBlock;
  if (!amx) padded_rows = rows;
  const int64_t blocks = rows * per_row;
  QuantizedInput in{std::vector<int8_t>(padded_rows * K), std::vector<float>(blocks), std::vector<float>(blocks),
                    std::vector<float>(2 * blocks), std::vector<int32_t>(blocks), amx, padded_rows};
  at::parallel_for(0, M * per_row, 512, [&](int64_t begin, int64_t end) {
    float v[kBlock];
    for (int64_t i = begin; i < end; ++i) {  // block i of the flattened [M, K] (K is a multiple of 32)
      for (int64_t j = 0; j < kBlock; ++j) v[j] = static_cast<float>(x[i * kBlock + j]);
      const int64_t m = i / per_row, b = i % per_row;
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t at = (passes * m + p) * per_row + b;
        quantize_block(v, in.q.data() + at * kBlock, &in.scale[at], &in.scaled_sum[at], &in.half_sum[2 * at],
                       &in.sum[at]);
      }
    }
  });
  if (amx) transpose_scales(in, rows, per_row);
  return in;
}

// A row's outputs of one tile (count <= 16). A whole tile's 16, or an AVX2 half's 8, go through a
// loop of constant count, which the compiler inlines as vector moves: with a variable count GCC
// called memmove once per row and tile (2.6% of a 1,505-token prompt of the 1.7B shape, AVX-512).
template <typename T>
inline void store_row(T* out, const float* values, int64_t count) {
  const auto copy = [&](auto n) {
    for (int64_t r = 0; r < decltype(n)::value; ++r) out[r] = static_cast<T>(values[r]);
  };
  if (count == kTileRows) return copy(std::integral_constant<int64_t, kTileRows>{});
  if (count == 8) return copy(std::integral_constant<int64_t, 8>{});
  for (int64_t r = 0; r < count; ++r) out[r] = static_cast<T>(values[r]);
}

// u of row r, weight k (0..31) of one record's payload: the portable loop's and the
// dequantization's reading of the layout.
template <int64_t Bits>
inline int32_t weight_u(const uint8_t* payload, int64_t r, int64_t k) {
  const int64_t j = k / 4, i = k % 4;
  if constexpr (Bits == 8) {
    return payload[64 * j + 4 * r + i];
  } else {
    const uint8_t byte = payload[64 * (j / 2) + 4 * r + i];
    int32_t u = j % 2 == 0 ? byte & 0x0F : byte >> 4;
    for (int64_t p = 0; p < Bits - 4; ++p) {
      uint64_t plane;
      std::memcpy(&plane, payload + 256 + 64 * p + 8 * j, 8);
      u |= static_cast<int32_t>((plane >> (4 * r + i)) & 1) << (4 + p);
    }
    return u;
  }
}

#if defined(SY_BLOCK_AVX512) || defined(SY_BLOCK_AVX2)
// vpmaddubsw's int16 pair sums of u < 2^bits (4-6 bits) and |qa| <= 127: at most 2 * 63 * 127 =
// 16002 for 6 bits, so this many chunks' sums add up below 2^15 before vpmaddwd widens them (the
// AVX-512 loop without VNNI and the AVX2 loop).
constexpr int int16_chunks(int64_t bits) { return bits == 4 ? 8 : bits == 5 ? 4 : 2; }
#endif

#if defined(SY_BLOCK_ZMM) || defined(SY_BLOCK_AVX2)
// Weights are read once per step, from memory: each record's lines are prefetched this far
// ahead (a thread's tiles are contiguous). 2-core AVX2 EPYC, the default model's 120 Q4_1
// linears at one row: 8.6-9.3 ms without, 6.1-7.9 with 2 KB (0.5 and 1 KB in between); its
// Q8_0 LM head 2.6-2.8 ms without, 1.5-1.9 with.
constexpr int64_t kPrefetchBytes = 2048;

// The lines `Ahead` bytes after block b's bytes in its tile (its record, and before the first
// record of a super-block its scales: blocks follow each other, so every byte of a thread's
// tiles is prefetched once whatever the record's size; records need not start on a line).
template <int64_t Bits, int64_t Group, int64_t Scheme, int64_t Ahead = kPrefetchBytes>
inline void prefetch_record(const uint8_t* tile, int64_t b) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(tile + block_start(Bits, Group, Scheme, b) + Ahead);
  const uintptr_t end = reinterpret_cast<uintptr_t>(tile + block_start(Bits, Group, Scheme, b + 1) + Ahead);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
}
#endif

#if defined(SY_BLOCK_ZMM)
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
    for (int p = 0; p < Bits - 4; ++p) {  // the bit planes above the nibbles, as byte masks
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(0x10 << p));
      uint64_t plane[8];
      std::memcpy(plane, payload + 256 + 64 * p, 64);
      for (int j = 0; j < 8; ++j) w[j] = _mm512_or_si512(w[j], _mm512_maskz_mov_epi8(_cvtu64_mask64(plane[j]), bit));
    }
  }
}

inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// scales1 for the 16 rows at once (the VNNI loop's and AMX's reading of every scheme).
template <int64_t Bits, int64_t Group, int64_t Scheme>
inline void scales16(const uint8_t* sup, const uint8_t* rec, int g, __m512& d, __m512& c) {
  const auto bytes = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  if constexpr (Scheme == kSchemeDC) {
    d = halves16(rec + 64 * g), c = halves16(rec + 64 * g + 32);
  } else if constexpr (Scheme == kSchemeK) {
    d = _mm512_mul_ps(halves16(sup), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(rec))));
    c = _mm512_mul_ps(_mm512_set1_ps(-1.0f),
                      _mm512_mul_ps(halves16(sup + 32), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(rec + 16)))));
  } else {
    d = Scheme == kSchemeD ? halves16(rec + 32 * g)
                           : _mm512_mul_ps(halves16(sup), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(rec + 16 * g))));
    c = _mm512_mul_ps(d, _mm512_set1_ps(-static_cast<float>(1 << (Bits - 1))));
  }
}

// The float (d, c) of every block and group of a tile, [blocks][G][d[16], c[16]], for a step that
// passes over the tile more than once (more than rows_per_pass input rows): formed once a tile,
// the same numbers scales16 forms in each pass (so a row's output does not depend on the rows
// beside it), read back as two loads instead of a scheme's conversions and products.
template <int64_t Bits, int64_t Group, int64_t Scheme>
inline void fill_tile_scales(const uint8_t* tile, int64_t blocks, float* table) {
  constexpr int64_t G = groups_of(Group);
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_record<Bits, Group, Scheme>(tile, b);
    const uint8_t* rec = tile + record_offset(Bits, Group, Scheme, b);
    const uint8_t* sup = tile + super_offset(Bits, Group, Scheme, b);
    for (int g = 0; g < G; ++g) {
      __m512 d, c;
      scales16<Bits, Group, Scheme>(sup, rec, g, d, c);
      _mm512_storeu_ps(table + (b * G + g) * 32, d);
      _mm512_storeu_ps(table + (b * G + g) * 32 + 16, c);
    }
  }
}

#if defined(SY_BLOCK_AVX512)
// AVX-512 without VNNI: the dot vpdpbusd would give, from vpmaddubsw (u8 x s8 -> int16 pair sums)
// and vpmaddwd, as the AVX2 loop forms it (see there why no int16 sum saturates), 16 rows a
// register. 8-bit weights come as q = u - 128 (s8) and |q|: |q| times qa with q's sign, plus
// 128 sum(qa), is the exact u qa. So the dots, and every output bit, are VNNI's.
template <int64_t Bits, int chunks>
inline __m512i dot_bw(const __m512i* w, const __m512i* magnitude, const int32_t* a, int32_t a_sum) {
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (Bits == 8) {
    __m512i dot = _mm512_set1_epi32(128 * a_sum);
    for (int j = 0; j < chunks; ++j) {
      const __m512i qa = _mm512_set1_epi32(a[j]);
      const __m512i signed_qa = _mm512_mask_sub_epi8(qa, _mm512_movepi8_mask(w[j]), _mm512_setzero_si512(), qa);
      dot = _mm512_add_epi32(dot, _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude[j], signed_qa), ones));
    }
    return dot;
  } else {
    constexpr int in_int16 = std::min<int>(chunks, int16_chunks(Bits));
    __m512i dot = _mm512_setzero_si512();
    for (int j0 = 0; j0 < chunks; j0 += in_int16) {
      __m512i sum = _mm512_maddubs_epi16(w[j0], _mm512_set1_epi32(a[j0]));
      for (int j = j0 + 1; j < j0 + in_int16; ++j)
        sum = _mm512_add_epi16(sum, _mm512_maddubs_epi16(w[j], _mm512_set1_epi32(a[j])));
      dot = _mm512_add_epi32(dot, _mm512_madd_epi16(sum, ones));
    }
    return dot;
  }
}
#endif

// One tile times R input rows from m0: the R accumulators (and the c terms, kept apart so that
// each block adds to two independent chains) stay in registers, R a constant. `table`: the tile's
// fill_tile_scales, or nullptr (each block's scales formed here).
template <int64_t Bits, int64_t Group, int64_t Scheme, int R, typename T>
inline void tile_rows(const QuantizedInput& in, const uint8_t* tile, int64_t blocks, int64_t m0, bool prefetch,
                      const float* table, T* out, int64_t N, int64_t count) {
  constexpr int64_t G = groups_of(Group), chunks = 8 / G;
  __m512 acc[R], acc_c[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps(), acc_c[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + record_offset(Bits, Group, Scheme, b);
    if (prefetch) prefetch_record<Bits, Group, Scheme>(tile, b);
    __m512 d[G], c[G];
    for (int g = 0; g < G; ++g) {
      if (table != nullptr) {
        d[g] = _mm512_loadu_ps(table + (b * G + g) * 32), c[g] = _mm512_loadu_ps(table + (b * G + g) * 32 + 16);
      } else {
        scales16<Bits, Group, Scheme>(tile + super_offset(Bits, Group, Scheme, b), rec, g, d[g], c[g]);
      }
    }
    __m512i w[8];
    unpack<Bits>(rec + header_bytes(Group, Scheme), w);
#if defined(SY_BLOCK_AVX512)
    __m512i magnitude[Bits == 8 ? 8 : 1];
    if constexpr (Bits == 8) {
      for (int j = 0; j < 8; ++j)
        w[j] = _mm512_xor_si512(w[j], _mm512_set1_epi8(static_cast<char>(0x80))), magnitude[j] = _mm512_abs_epi8(w[j]);
    }
#endif
    for (int m = 0; m < R; ++m) {
      const int64_t at = (m0 + m) * blocks + b;
      const int32_t* a = reinterpret_cast<const int32_t*>(in.q.data() + at * kBlock);
      const __m512 e = _mm512_set1_ps(in.scale[at]);
      for (int g = 0; g < G; ++g) {
#if defined(SY_BLOCK_AVX512)
        const __m512i dot = dot_bw<Bits, chunks>(w + g * chunks, magnitude, a + g * chunks, in.sum[at]);
#else
        // With few rows the chunks' vpdpbusd chain is the loop's critical path (5 cycles each):
        // split it into P chains summed after (integer sums are exact, so the dot is unchanged).
        constexpr int P = R <= 2 ? (chunks >= 4 ? 4 : chunks) : chunks >= 2 ? 2 : 1;
        __m512i part[P];
        for (int p = 0; p < P; ++p) part[p] = _mm512_setzero_si512();
        for (int j = g * chunks; j < (g + 1) * chunks; ++j)
          part[j % P] = _mm512_dpbusd_epi32(part[j % P], w[j], _mm512_set1_epi32(a[j]));
        __m512i dot = part[0];
        for (int p = 1; p < P; ++p) dot = _mm512_add_epi32(dot, part[p]);
#endif
        const float s = G == 1 ? in.scaled_sum[at] : in.half_sum[2 * at + g];
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[g], e), acc[m]);
        acc_c[m] = _mm512_fmadd_ps(c[g], _mm512_set1_ps(s), acc_c[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m) {
    alignas(64) float values[kTileRows];
    _mm512_store_ps(values, _mm512_add_ps(acc[m], acc_c[m]));
    store_row(out + (m0 + m) * N, values, count);
  }
}

#if defined(SY_BLOCK_AMX)
// AMX: steps of at least kAmxMinRows rows multiply each record with TDPBSUD, one tile op per
// scale group: A = kAmxRows input rows' qa for the group (s8, Group bytes a row, read in place
// from the padded [M', K] activations), B = the group's weights (u8, Group / 4 rows of 64 bytes:
// row j is payload chunk j, lane r = output row r's 4 weights, so an 8-bit payload is B as it
// lies and 4-6 bits are unpacked into a scratch copy once per tile), C = 16 x 16 int32 dots. The
// dots are exact integers, the same as vpdpbusd's, and each is scaled and added in the VNNI
// loop's order with the same instructions, so a row's output does not depend on which path (or
// how many rows) computed it: speculation's verify steps and plain decodes stay bit-identical.
// Each 16 x 16 x 32 product has to leave its tile through memory to be scaled (its block's
// scales are its own), which bounds the gain: idle 2-core AMX Xeon, one 16384 x 2048 Q4_K
// weight, 2 threads, VNNI / AMX: 16 rows 1.86 / 1.77 ms, 32 rows 3.52 / 3.13, 64 rows 6.85 / 5.22;
// 8 rows (padded to 16) 0.99 / 1.39, hence kAmxMinRows. The 1.7B shape's 24 layers: 16 rows 118 /
// 97 ms, 32 rows 203 / 166, 64 rows 371 / 279.
constexpr int64_t kAmxRows = 16;     // input rows per C tile, their accumulators in registers
constexpr int64_t kAmxMinRows = 16;  // steps from this many rows take AMX
// Records are prefetched further ahead than VNNI's kPrefetchBytes: a tile op's load of a record
// that is not in cache stalls the tile unit, and a record goes through it faster.
constexpr int64_t kAmxPrefetchBytes = 8192;

// Linux gives a process AMX's tile data only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asked once, for every thread. Where it is refused, VNNI runs.
inline bool amx_usable() {
  static const bool usable = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 (C) rotate over the stages, so that two stages' products are under way while one is
// scaled and added; A and B alternate between tiles 4/6 and 5/7. Loaded per call (the config is a
// thread's state).
template <int64_t Group>
inline void configure_tiles() {
  TileConfig config;
  for (int i = 0; i < 4; ++i) config.rows[i] = kAmxRows, config.colsb[i] = 64;
  for (int i = 4; i < 6; ++i) config.rows[i] = kAmxRows, config.colsb[i] = Group;
  for (int i = 6; i < 8; ++i) config.rows[i] = Group / 4, config.colsb[i] = 64;
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes: make the whole config be stored.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// C = A B, A = kAmxRows rows of qa from a (stride K), B = Group / 4 rows of u at w (the tile
// intrinsics take their register numbers as literals, hence a macro).
#define SY_TILE_DOT(c, at, bt, a, K, w) \
  do {                                  \
    asm volatile("" : : "m"(*reinterpret_cast<const uint8_t(*)[Group * 16]>(w))); \
    _tile_zero(c);                      \
    _tile_loadd(at, a, K);              \
    _tile_loadd(bt, w, 64);             \
    _tile_dpbsud(c, at, bt);            \
  } while (0)

// One tile times R (<= kAmxRows) input rows from m0 (qa rows m0..m0 + 15 are read; those past R
// are the zero padding, their dots unused). The stages (block, group) run in order; each one's
// tile product is issued two stages before it is scaled and added. The c terms follow in a pass
// of their own (their chains would not fit in the registers beside the accumulators).
// `u` holds the tile's unpacked payloads (blocks x 512 bytes): written here when `unpack_now`.
template <int64_t Bits, int64_t Group, int64_t Scheme, int R, typename T>
inline void tile_rows_amx(const QuantizedInput& in, const uint8_t* tile, int64_t blocks, int64_t m0, bool unpack_now,
                          uint8_t* u, T* out, int64_t N, int64_t count) {
  constexpr int64_t G = groups_of(Group);
  const int64_t K = blocks * kBlock, stages = blocks * G;
  const int8_t* a = in.q.data() + m0 * K;
  const auto issue = [&](int64_t stage) {
    if (stage >= stages) return;
    const int64_t b = stage / G, g = stage % G;
    const uint8_t* rec = tile + record_offset(Bits, Group, Scheme, b);
    const uint8_t* weights = rec + header_bytes(Group, Scheme);
    if (g == 0 && unpack_now) prefetch_record<Bits, Group, Scheme, kAmxPrefetchBytes>(tile, b);
    if constexpr (Bits != 8) {
      if (g == 0 && unpack_now) {
        __m512i w[8];
        unpack<Bits>(weights, w);
        for (int j = 0; j < 8; ++j) _mm512_store_si512(u + 512 * b + 64 * j, w[j]);
      }
      weights = u + 512 * b;
    }
    const int8_t* qa = a + b * kBlock + g * Group;
    const uint8_t* w = weights + 256 * g;
    switch (stage % 4) {
      case 0: SY_TILE_DOT(0, 4, 6, qa, K, w); break;
      case 1: SY_TILE_DOT(1, 5, 7, qa, K, w); break;
      case 2: SY_TILE_DOT(2, 4, 6, qa, K, w); break;
      default: SY_TILE_DOT(3, 5, 7, qa, K, w); break;
    }
  };
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  alignas(64) int32_t dots[4][kAmxRows][16];  // one per C tile
  issue(0);
  issue(1);
  for (int64_t stage = 0; stage < stages; ++stage) {
    issue(stage + 2);
    switch (stage % 4) {
      case 0: _tile_stored(0, dots[0], 64); break;
      case 1: _tile_stored(1, dots[1], 64); break;
      case 2: _tile_stored(2, dots[2], 64); break;
      default: _tile_stored(3, dots[3], 64); break;
    }
    asm volatile("" : "=m"(dots[stage % 4]));  // GCC's tile intrinsics do not say they touch memory
    const int64_t b = stage / G, g = stage % G;
    __m512 d, c;  // c: in the pass below
    scales16<Bits, Group, Scheme>(tile + super_offset(Bits, Group, Scheme, b), tile + record_offset(Bits, Group, Scheme, b),
                                  static_cast<int>(g), d, c);
    const float* e_rows = in.scale_t.data() + b * in.padded_rows + m0;
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
      const __m512 e = _mm512_set1_ps(e_rows[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[stage % 4][m])), _mm512_mul_ps(d, e), acc[m]);
    }
  }
  alignas(64) float sums[R][kTileRows];
  for (int m = 0; m < R; ++m) _mm512_store_ps(sums[m], acc[m]);
  __m512 acc_c[R];  // the c terms, in a pass of their own (the tile's records are in cache now)
  for (int m = 0; m < R; ++m) acc_c[m] = _mm512_setzero_ps();
  for (int64_t stage = 0; stage < stages; ++stage) {
    const int64_t b = stage / G, g = stage % G;
    __m512 d, c;  // d: in the pass above
    scales16<Bits, Group, Scheme>(tile + super_offset(Bits, Group, Scheme, b), tile + record_offset(Bits, Group, Scheme, b),
                                  static_cast<int>(g), d, c);
    const float* s_rows = (G == 1 ? in.sum_t.data() + b * in.padded_rows : in.half_t.data() + (2 * b + g) * in.padded_rows) + m0;
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) acc_c[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(s_rows[m]), acc_c[m]);
  }
  for (int m = 0; m < R; ++m) {
    alignas(64) float values[kTileRows];
    _mm512_store_ps(values, _mm512_add_ps(_mm512_load_ps(sums[m]), acc_c[m]));
    store_row(out + (m0 + m) * N, values, count);
  }
}

// tiles() on AMX (M >= kAmxMinRows; the activations padded to a multiple of kAmxRows rows).
template <int64_t Bits, int64_t Group, int64_t Scheme, typename T>
void tiles_amx(const QuantizedInput& in, const uint8_t* packed, T* out, int64_t M, int64_t N, int64_t K, int64_t rows,
               int64_t t_begin, int64_t t_end) {
  const int64_t blocks = K / kBlock, tile_size = tile_bytes(Bits, Group, Scheme, blocks);
  static thread_local std::vector<__m512i> scratch;
  if (Bits != 8 && static_cast<int64_t>(scratch.size()) < blocks * 8) scratch.resize(blocks * 8);
  uint8_t* u = reinterpret_cast<uint8_t*>(scratch.data());
  configure_tiles<Group>();
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* tile = packed + t * tile_size;
    const int64_t rows_here = std::min(kTileRows, rows - t * kTileRows);
    T* o = out + t * kTileRows;
    for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
      const bool first = m0 == 0;
      switch (std::min(kAmxRows, M - m0)) {
#define SY_AMX_CASE(r) case r: tile_rows_amx<Bits, Group, Scheme, r>(in, tile, blocks, m0, first, u, o, N, rows_here); break;
        SY_AMX_CASE(1) SY_AMX_CASE(2) SY_AMX_CASE(3) SY_AMX_CASE(4) SY_AMX_CASE(5) SY_AMX_CASE(6) SY_AMX_CASE(7)
        SY_AMX_CASE(8) SY_AMX_CASE(9) SY_AMX_CASE(10) SY_AMX_CASE(11) SY_AMX_CASE(12) SY_AMX_CASE(13) SY_AMX_CASE(14)
        SY_AMX_CASE(15)
        default: tile_rows_amx<Bits, Group, Scheme, 16>(in, tile, blocks, m0, first, u, o, N, rows_here); break;
#undef SY_AMX_CASE
      }
    }
  }
  _tile_release();
}
#endif

// Tiles [t_begin, t_end) of one segment of `rows` output rows; out points at its first column.
template <int64_t Bits, int64_t Group, int64_t Scheme, typename T>
void tiles(const QuantizedInput& in, const uint8_t* packed, T* out, int64_t M, int64_t N, int64_t K, int64_t rows,
           int64_t t_begin, int64_t t_end) {
#if defined(SY_BLOCK_AMX)
  if (in.amx) return tiles_amx<Bits, Group, Scheme>(in, packed, out, M, N, K, rows, t_begin, t_end);
#endif
  const int64_t blocks = K / kBlock, tile_size = tile_bytes(Bits, Group, Scheme, blocks);
  constexpr int R = rows_per_pass(Bits);
  // More than one pass over each tile: its scales formed once (fill_tile_scales).
  const std::unique_ptr<float[]> table(M > R ? new float[blocks * groups_of(Group) * 32] : nullptr);  // fill_tile_scales writes it all
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* tile = packed + t * tile_size;
    const int64_t rows_here = std::min(kTileRows, rows - t * kTileRows);
    T* o = out + t * kTileRows;
    const float* scales = nullptr;
    if (table) fill_tile_scales<Bits, Group, Scheme>(tile, blocks, table.get()), scales = table.get();
    for (int64_t m0 = 0; m0 < M; m0 += R) {
      const bool prefetch = m0 == 0;  // later groups find the tile in cache
      switch (std::min<int64_t>(R, M - m0)) {
#define SY_VNNI_CASE(r) case r: tile_rows<Bits, Group, Scheme, std::min(r, R)>(in, tile, blocks, m0, prefetch, scales, o, N, rows_here); break;
        SY_VNNI_CASE(1) SY_VNNI_CASE(2) SY_VNNI_CASE(3) SY_VNNI_CASE(4) SY_VNNI_CASE(5) SY_VNNI_CASE(6) SY_VNNI_CASE(7)
        default: tile_rows<Bits, Group, Scheme, R>(in, tile, blocks, m0, prefetch, scales, o, N, rows_here); break;
#undef SY_VNNI_CASE
      }
    }
  }
}
#elif defined(SY_BLOCK_AVX2)
// Code generation, measured (idle 2-core Zen 4, against the 4-row loop): the helpers the AVX2
// loops call per block are always inlined (with eight row counts to instantiate GCC left some out
// of line: q4_k at 2-4 rows 0.76x; inlined 1.2-1.4x); tile_half is never inlined into tiles()
// (inlined, its 8-bit instantiations for 3-4 rows ran 0.55-0.85x); block_dot is the compiler's
// choice.
#define SY_INLINE inline __attribute__((always_inline))
// AVX2: a 256-bit register holds 8 rows' lanes, so a tile is two halves (rows 8h..8h+7: bytes
// 32h..32h+31 of every 64-byte chunk or group, bits 32h..32h+31 of every plane word, fp16
// fields 8h..8h+7), multiplied one after the other (a tile's records, at most a few KB, stay in
// L1 for the second half). vpmaddubsw takes u8 weights times s8 activations into int16 pair
// sums, widened to int32 (vpmaddwd) before they could saturate:
// - 4 to 6 bits: u < 2^bits and |qa| <= 127, so a pair is at most 2 * 63 * 127 = 16002 and the
//   int16 sum of 8 (4 bits), 4 (5 bits) or 2 (6 bits) chunks stays below 2^15.
// - 8 bits: u up to 255 would saturate int16, so u is turned back into q = u - 128 (u ^ 0x80 as
//   s8) and multiplied as |q| times qa with q's sign (llama.cpp's AVX2 q8_0 dot), each chunk
//   widened to int32 at once. That sums q qa = u qa - 128 qa; adding 128 sum(qa) gives back the
//   exact u qa that vpdpbusd sums, so every loop scales the same integers (the same bits).

// 32 bits -> 32 bytes, `value` where the bit is set (ggml's bytes_from_bits_32).
SY_INLINE __m256i bits_to_bytes(uint32_t x, char value) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(x)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i all = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(all, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(value));
}

template <int64_t Bits>
SY_INLINE void unpack_half(const uint8_t* payload, int64_t h, __m256i w[8]) {
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
    for (int p = 0; p < Bits - 4; ++p) {
      for (int j = 0; j < 8; ++j) {
        uint32_t word;
        std::memcpy(&word, payload + 256 + 64 * p + 8 * j + 4 * h, 4);
        w[j] = _mm256_or_si256(w[j], bits_to_bytes(word, static_cast<char>(0x10 << p)));
      }
    }
  }
}

// The int32 dots of 8 rows' block (w) with one row's quantized block (a, 8 groups of 4 bytes,
// summing to a_sum), one per scale group (chunks 8g/G .. 8(g+1)/G - 1).
template <int64_t Bits, int64_t G>
inline void block_dot(const __m256i w[8], const int32_t* a, int32_t a_sum, __m256i dots[G]) {
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int chunks = 8 / G;
  for (int g = 0; g < G; ++g) dots[g] = _mm256_setzero_si256();
  if constexpr (Bits == 8) {
    dots[0] = _mm256_set1_epi32(128 * a_sum);  // G == 1: u qa = q qa + 128 qa
    for (int j = 0; j < 8; ++j) {
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(_mm256_set1_epi32(a[j]), w[j]));
      dots[j / chunks] = _mm256_add_epi32(dots[j / chunks], _mm256_madd_epi16(pairs, ones));
    }
  } else {
    constexpr int in_int16 = std::min<int>(chunks, int16_chunks(Bits));
    for (int j0 = 0; j0 < 8; j0 += in_int16) {
      __m256i sum = _mm256_maddubs_epi16(w[j0], _mm256_set1_epi32(a[j0]));
      for (int j = j0 + 1; j < j0 + in_int16; ++j) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(a[j])));
      dots[j0 / chunks] = _mm256_add_epi32(dots[j0 / chunks], _mm256_madd_epi16(sum, ones));
    }
  }
}

SY_INLINE __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// scales1 for the 8 rows of half h: the AVX2 loops' one reading of every scheme.
template <int64_t Bits, int64_t Group, int64_t Scheme>
SY_INLINE void scales8(const uint8_t* sup, const uint8_t* rec, int64_t h, int g, __m256& d, __m256& c) {
  const auto bytes = [](const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); };
  if constexpr (Scheme == kSchemeDC) {
    d = halves8(rec + 64 * g + 16 * h), c = halves8(rec + 64 * g + 32 + 16 * h);
  } else if constexpr (Scheme == kSchemeK) {
    d = _mm256_mul_ps(halves8(sup + 16 * h), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes(rec + 8 * h))));
    c = _mm256_mul_ps(_mm256_set1_ps(-1.0f), _mm256_mul_ps(halves8(sup + 32 + 16 * h),
                                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes(rec + 16 + 8 * h)))));
  } else {
    d = Scheme == kSchemeD
            ? halves8(rec + 32 * g + 16 * h)
            : _mm256_mul_ps(halves8(sup + 16 * h), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(rec + 16 * g + 8 * h))));
    c = _mm256_mul_ps(d, _mm256_set1_ps(-static_cast<float>(1 << (Bits - 1))));
  }
}

// Half h of block b of a tile: its rows' d and c per scale group (scales8), its weights
// unpacked into w.
template <int64_t Bits, int64_t Group, int64_t Scheme>
SY_INLINE void load_half(const uint8_t* tile, int64_t b, int64_t h, __m256 d[], __m256 c[], __m256i w[8]) {
  const uint8_t* rec = tile + record_offset(Bits, Group, Scheme, b);
  for (int g = 0; g < groups_of(Group); ++g)
    scales8<Bits, Group, Scheme>(tile + super_offset(Bits, Group, Scheme, b), rec, h, g, d[g], c[g]);
  unpack_half<Bits>(rec + header_bytes(Group, Scheme), h, w);
}

// acc += the block's products for one input row at block index `at` (its e, s, half sums).
template <int64_t Bits, int64_t Group, int64_t Scheme>
inline void add_block(const QuantizedInput& in, int64_t at, const __m256 d[], const __m256 c[], const __m256i w[8],
                      __m256& acc, __m256& acc_c) {
  constexpr int64_t G = groups_of(Group);
  __m256i dots[G];
  block_dot<Bits, G>(w, reinterpret_cast<const int32_t*>(in.q.data() + at * kBlock), in.sum[at], dots);
  const __m256 e = _mm256_set1_ps(in.scale[at]);
  for (int g = 0; g < G; ++g) {
    const float s = G == 1 ? in.scaled_sum[at] : in.half_sum[2 * at + g];
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[g]), _mm256_mul_ps(d[g], e), acc);
    acc_c = _mm256_fmadd_ps(c[g], _mm256_set1_ps(s), acc_c);
  }
}

// The float (d, c) of every block and group of a tile, [blocks][G][d[16], c[16]] (each half's 8
// rows from scales8), for a step that passes over the tile more than once: formed once a tile,
// the same numbers each pass would form (see the VNNI loop's fill_tile_scales).
template <int64_t Bits, int64_t Group, int64_t Scheme>
inline void fill_tile_scales(const uint8_t* tile, int64_t blocks, float* table) {
  constexpr int64_t G = groups_of(Group);
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_record<Bits, Group, Scheme>(tile, b);
    const uint8_t* rec = tile + record_offset(Bits, Group, Scheme, b);
    const uint8_t* sup = tile + super_offset(Bits, Group, Scheme, b);
    for (int g = 0; g < G; ++g) {
      for (int64_t h = 0; h < 2; ++h) {
        __m256 d, c;
        scales8<Bits, Group, Scheme>(sup, rec, h, g, d, c);
        _mm256_storeu_ps(table + (b * G + g) * 32 + 8 * h, d);
        _mm256_storeu_ps(table + (b * G + g) * 32 + 16 + 8 * h, c);
      }
    }
  }
}

// Half h of one tile times R input rows from m0: the R accumulators (and the c terms, kept apart
// so that each block adds to two independent chains) stay in registers, R a constant. `table`:
// the tile's fill_tile_scales, or nullptr (each block's scales formed here).
template <int64_t Bits, int64_t Group, int64_t Scheme, int R, typename T>
__attribute__((noinline)) void tile_half(const QuantizedInput& in, const uint8_t* tile, int64_t blocks, int64_t h, int64_t m0, bool prefetch,
                      const float* table, T* out, int64_t N, int64_t count) {
  constexpr int64_t G = groups_of(Group);
  __m256 acc[R], acc_c[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps(), acc_c[m] = _mm256_setzero_ps();
  // The d e dot terms first, with only the weights and R accumulators live (16 ymm registers)...
  for (int64_t b = 0; b < blocks; ++b) {
    if (prefetch) prefetch_record<Bits, Group, Scheme>(tile, b);
    __m256 d[G], unused[G];
    __m256i w[8];
    if (table != nullptr) {
      for (int g = 0; g < G; ++g) d[g] = _mm256_loadu_ps(table + (b * G + g) * 32 + 8 * h);
      unpack_half<Bits>(tile + record_offset(Bits, Group, Scheme, b) + header_bytes(Group, Scheme), h, w);
    } else {
      load_half<Bits, Group, Scheme>(tile, b, h, d, unused, w);
    }
    for (int m = 0; m < R; ++m) {
      const int64_t at = (m0 + m) * blocks + b;
      __m256i dots[G];
      block_dot<Bits, G>(w, reinterpret_cast<const int32_t*>(in.q.data() + at * kBlock), in.sum[at], dots);
      const __m256 e = _mm256_set1_ps(in.scale[at]);
      for (int g = 0; g < G; ++g) acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[g]), _mm256_mul_ps(d[g], e), acc[m]);
    }
  }
  // ... then the c s terms, in the same order per row (the headers are in cache now).
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + record_offset(Bits, Group, Scheme, b);
    for (int g = 0; g < G; ++g) {
      __m256 d, c;
      if (table != nullptr) c = _mm256_loadu_ps(table + (b * G + g) * 32 + 16 + 8 * h);
      else scales8<Bits, Group, Scheme>(tile + super_offset(Bits, Group, Scheme, b), rec, h, g, d, c);
      for (int m = 0; m < R; ++m) {
        const int64_t at = (m0 + m) * blocks + b;
        acc_c[m] = _mm256_fmadd_ps(c, _mm256_set1_ps(G == 1 ? in.scaled_sum[at] : in.half_sum[2 * at + g]), acc_c[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m) {
    alignas(32) float values[8];
    _mm256_store_ps(values, _mm256_add_ps(acc[m], acc_c[m]));
    store_row(out + (m0 + m) * N, values, count);
  }
}

// A whole tile (both halves in one pass over its records, each read once) times one input row.
template <int64_t Bits, int64_t Group, int64_t Scheme, typename T>
inline void tile_one_row(const QuantizedInput& in, const uint8_t* tile, int64_t blocks, T* out, int64_t rows_here) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, acc_c[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_record<Bits, Group, Scheme>(tile, b);
    for (int h = 0; h < 2; ++h) {
      __m256 d[groups_of(Group)], c[groups_of(Group)];
      __m256i w[8];
      load_half<Bits, Group, Scheme>(tile, b, h, d, c, w);
      add_block<Bits, Group, Scheme>(in, b, d, c, w, acc[h], acc_c[h]);
    }
  }
  alignas(32) float values[16];
  _mm256_store_ps(values, _mm256_add_ps(acc[0], acc_c[0]));
  _mm256_store_ps(values + 8, _mm256_add_ps(acc[1], acc_c[1]));
  store_row(out, values, rows_here);
}

template <int64_t Bits, int64_t Group, int64_t Scheme, typename T>
void tiles(const QuantizedInput& in, const uint8_t* packed, T* out, int64_t M, int64_t N, int64_t K, int64_t rows,
           int64_t t_begin, int64_t t_end) {
  const int64_t blocks = K / kBlock, tile_size = tile_bytes(Bits, Group, Scheme, blocks);
  // More than one pass over each half of a tile: its scales formed once (fill_tile_scales).
  constexpr int64_t R = rows_per_pass(Bits);
  const std::unique_ptr<float[]> table(M > R ? new float[blocks * groups_of(Group) * 32] : nullptr);  // fill_tile_scales writes it all
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* tile = packed + t * tile_size;
    const int64_t rows_here = std::min(kTileRows, rows - t * kTileRows);
    if (M == 1) {
      tile_one_row<Bits, Group, Scheme>(in, tile, blocks, out + t * kTileRows, rows_here);
      continue;
    }
    const float* scales = nullptr;
    if (table) fill_tile_scales<Bits, Group, Scheme>(tile, blocks, table.get()), scales = table.get();
    for (int64_t h = 0; h < 2 && 8 * h < rows_here; ++h) {
      T* o = out + t * kTileRows + 8 * h;
      const int64_t count = std::min<int64_t>(8, rows_here - 8 * h);
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        const bool prefetch = h == 0 && m0 == 0;
        switch (std::min(R, M - m0)) {
          case 1: tile_half<Bits, Group, Scheme, 1>(in, tile, blocks, h, m0, prefetch, scales, o, N, count); break;
          case 2: tile_half<Bits, Group, Scheme, 2>(in, tile, blocks, h, m0, prefetch, scales, o, N, count); break;
          case 3: tile_half<Bits, Group, Scheme, 3>(in, tile, blocks, h, m0, prefetch, scales, o, N, count); break;
          case 4: tile_half<Bits, Group, Scheme, 4>(in, tile, blocks, h, m0, prefetch, scales, o, N, count); break;
          case 5: tile_half<Bits, Group, Scheme, 5>(in, tile, blocks, h, m0, prefetch, scales, o, N, count); break;
          case 6: tile_half<Bits, Group, Scheme, 6>(in, tile, blocks, h, m0, prefetch, scales, o, N, count); break;
          case 7: tile_half<Bits, Group, Scheme, 7>(in, tile, blocks, h, m0, prefetch, scales, o, N, count); break;
          default: tile_half<Bits, Group, Scheme, R>(in, tile, blocks, h, m0, prefetch, scales, o, N, count); break;
        }
      }
    }
  }
}
#else
template <int64_t Bits>
inline void record_u(const uint8_t* payload, uint8_t u[kTileRows][kBlock]);

// The portable loop: each record's u unpacked once per tile (record_u), then plain integer dots
// the compiler vectorises, scaled and summed per row in the vector loops' order (acc: the d e dot
// terms, acc_c: the c s terms, added at the end).
template <int64_t Bits, int64_t Group, int64_t Scheme, typename T>
void tiles(const QuantizedInput& in, const uint8_t* packed, T* out, int64_t M, int64_t N, int64_t K, int64_t rows,
           int64_t t_begin, int64_t t_end) {
  const int64_t blocks = K / kBlock, tile_size = tile_bytes(Bits, Group, Scheme, blocks);
  constexpr int64_t G = groups_of(Group);
  std::vector<uint8_t> unpacked(blocks * kTileRows * kBlock);
  auto* u = reinterpret_cast<uint8_t(*)[kTileRows][kBlock]>(unpacked.data());
  for (int64_t t = t_begin; t < t_end; ++t) {
    const uint8_t* tile = packed + t * tile_size;
    const int64_t rows_here = std::min(kTileRows, rows - t * kTileRows);
    for (int64_t b = 0; b < blocks; ++b)
      record_u<Bits>(tile + record_offset(Bits, Group, Scheme, b) + header_bytes(Group, Scheme), u[b]);
    for (int64_t m = 0; m < M; ++m) {
      float acc[kTileRows] = {}, acc_c[kTileRows] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* rec = tile + record_offset(Bits, Group, Scheme, b);
        const uint8_t* sup = tile + super_offset(Bits, Group, Scheme, b);
        const int64_t at = m * blocks + b;
        const int8_t* a = in.q.data() + at * kBlock;
        for (int64_t g = 0; g < G; ++g) {
          const float e = in.scale[at], s = G == 1 ? in.scaled_sum[at] : in.half_sum[2 * at + g];
          for (int64_t r = 0; r < kTileRows; ++r) {
            float d, c;
            scales1<Bits, Group, Scheme>(sup, rec, r, g, d, c);
            int32_t dot = 0;
            for (int64_t k = g * Group; k < (g + 1) * Group; ++k) dot += static_cast<int32_t>(u[b][r][k]) * a[k];
            acc[r] = std::fma(static_cast<float>(dot), d * e, acc[r]);
            acc_c[r] = std::fma(c, s, acc_c[r]);
          }
        }
      }
      float values[kTileRows];
      for (int64_t r = 0; r < kTileRows; ++r) values[r] = acc[r] + acc_c[r];
      store_row(out + m * N + t * kTileRows, values, rows_here);
    }
  }
}
#endif

// One segment of a packed weight: `rows` output rows from `row0`, layout (bits, group, scale
// scheme), its tiles (tile_size bytes each) from byte `offset`.
struct Segment {
  int64_t row0, rows, bits, group, scheme, offset, tiles, tile_size;
};

// The segments table from Python: int64 [S, 5] rows (rows, bits, group, scheme, byte offset);
// checks that every layout is one the kernel has and that the table covers out_features rows and
// the packed bytes.
inline std::vector<Segment> read_segments(const at::Tensor& table, int64_t K, int64_t out_features, int64_t packed_bytes) {
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 5 && table.is_contiguous(),
              "block_mm: segments must be contiguous int64 [S, 5] (rows, bits, group, scheme, offset)");
  std::vector<Segment> segments;
  const int64_t* t = table.data_ptr<int64_t>();
  int64_t row0 = 0, end = 0;
  for (int64_t i = 0; i < table.size(0); ++i) {
    const int64_t* f = t + 5 * i;
    Segment s{row0, f[0], f[1], f[2], f[3], f[4], (f[0] + kTileRows - 1) / kTileRows, 0};
    TORCH_CHECK(known_layout(s.bits, s.group, s.scheme), "block_mm: no kernel for ", s.bits, "-bit weights in groups of ",
                s.group, " (scale scheme ", s.scheme, ")");
    s.tile_size = tile_bytes(s.bits, s.group, s.scheme, K / kBlock);
    TORCH_CHECK(super_bytes(s.scheme) == 0 || K % (kSuperBlocks * kBlock) == 0,
                "block_mm: k-quant weights need a multiple of 256 inputs");
    TORCH_CHECK(s.rows > 0 && s.offset >= end, "block_mm: segment ", i, " overlaps the one before it");
    end = s.offset + s.tiles * s.tile_size;
    row0 += s.rows;
    segments.push_back(s);
  }
  TORCH_CHECK(row0 == out_features && end <= packed_bytes,
              "block_mm: the segments do not match out_features or the packed weight's size");
  return segments;
}

// The kernel of one layout (read_segments checked it is known), called as fn(bits, group,
// scheme) with compile-time constants on a contiguous range of one segment's tiles.
template <typename Fn>
inline void dispatch_layout(const Segment& s, Fn&& fn) {
#define SY_LAYOUT(b, g, sc)                                                                                 \
  if (s.bits == b && s.group == g && s.scheme == sc)                                                       \
    return fn(std::integral_constant<int64_t, b>(), std::integral_constant<int64_t, g>(),                  \
              std::integral_constant<int64_t, sc>());
  SY_LAYOUT(4, 32, kSchemeDC) SY_LAYOUT(5, 32, kSchemeDC) SY_LAYOUT(4, 32, kSchemeD) SY_LAYOUT(5, 32, kSchemeD)
  SY_LAYOUT(8, 32, kSchemeD) SY_LAYOUT(4, 32, kSchemeK) SY_LAYOUT(5, 32, kSchemeK) SY_LAYOUT(6, 16, kSchemeK6)
#undef SY_LAYOUT
  TORCH_CHECK(false, "block_mm: no kernel for this layout");
}

// Runs fn(segment, first tile, end tile) over every segment's tiles, split over threads by their
// bytes: a fused weight's parts may differ in format (a Q4_K_M q/k/v: q and k Q4_K, v Q6_K), and
// a tile's time, read from memory or multiplied, goes about with its bytes, so equal tile counts
// left one thread ~1.3x the other's bytes (7B qkv at one row). Thread i takes the tiles whose
// first byte lies in its equal share of the whole; which thread makes a tile changes no bit.
template <typename Fn>
inline void for_tiles(const std::vector<Segment>& segments, Fn&& fn) {
  int64_t bytes = 0, tiles = 0;
  for (const Segment& s : segments) bytes += s.tiles * s.tile_size, tiles += s.tiles;
  const int64_t shares = std::min<int64_t>(at::get_num_threads(), tiles);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t lo = bytes * i / shares, hi = bytes * (i + 1) / shares;
      int64_t first = 0;  // the segment's first byte in the whole
      for (const Segment& s : segments) {
        // the tiles t with lo <= first + t * tile_size < hi
        const auto from = [&](int64_t at) {
          return std::min(s.tiles, (std::max<int64_t>(at - first, 0) + s.tile_size - 1) / s.tile_size);
        };
        if (from(lo) < from(hi)) fn(s, from(lo), from(hi));
        first += s.tiles * s.tile_size;
      }
    }
  });
}

// The rows the activations are padded to where AMX multiplies them (it loads kAmxRows rows at a
// time), else 0.
inline int64_t padded_rows(int64_t M) {
#if defined(SY_BLOCK_AMX)
  if (M >= kAmxMinRows && amx_usable()) return (M + kAmxRows - 1) / kAmxRows * kAmxRows;
#endif
  return 0;
}

template <typename T>
void run(const at::Tensor& x, const uint8_t* packed, const std::vector<Segment>& segments, at::Tensor& out, int64_t N,
         int64_t passes) {
  const int64_t M = x.size(0), K = x.size(1), rows = passes * M;
  const QuantizedInput in = quantize_input(x.data_ptr<T>(), M, K, padded_rows(rows), passes);
  // then(n0, n1): what the thread that multiplied output columns [n0, n1) does with them next.
  const auto multiply = [&](auto* op, auto&& then) {
    for_tiles(segments, [&](const Segment& s, int64_t begin, int64_t end) {
      dispatch_layout(s, [&](auto bits, auto group, auto scheme) {
        tiles<decltype(bits)::value, decltype(group)::value, decltype(scheme)::value>(in, packed + s.offset, op + s.row0,
                                                                                      rows, N, K, s.rows, begin, end);
      });
      then(s.row0 + begin * kTileRows, s.row0 + std::min(end * kTileRows, s.rows));
    });
  };
  if (passes == 1) return multiply(out.data_ptr<T>(), [](int64_t, int64_t) {});
  // Two passes: each output is its rows' products summed in float32, pass 0 then pass 1, by the
  // thread that made those columns (no second parallel region; `parts` is all written first).
  const std::unique_ptr<float[]> parts(new float[rows * N]);
  T* op = out.data_ptr<T>();
  multiply(parts.get(), [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m) {
      const float* p0 = parts.get() + 2 * m * N;
      const float* p1 = p0 + N;
      for (int64_t n = n0; n < n1; ++n) op[m * N + n] = static_cast<T>(p0[n] + p1[n]);
    }
  });
}

// passes: 1 rounds the activations to int8 per 32 values, as llama.cpp's CPU backend does; 2
// also multiplies what that rounding lost (rounded the same way) with the same weights, so the
// activations carry about 15 bits for twice the integer work (a memory-bound step, e.g. one
// decode of a small model, hardly pays it). Either way a row's output depends on that row alone.
at::Tensor block_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& segments, int64_t out_features,
                    int64_t passes) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "block_mm: x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "block_mm: packed must be contiguous uint8");
  TORCH_CHECK(passes == 1 || passes == 2, "block_mm: passes must be 1 or 2");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % kBlock == 0, "block_mm: x's width must be a multiple of 32");
  const std::vector<Segment> parts = read_segments(segments, K, N, packed.numel());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  if (x.scalar_type() == at::kFloat) run<float>(xc, packed.data_ptr<uint8_t>(), parts, out, N, passes);
  else run<c10::BFloat16>(xc, packed.data_ptr<uint8_t>(), parts, out, N, passes);
  return out;
}

// One record's u as bytes u[r][k] (row r, weight k of the block): the SIMD unpacking where
// there is one (lane r of chunk j holds u[r][4j..4j+3]), else the portable reading.
template <int64_t Bits>
inline void record_u(const uint8_t* payload, uint8_t u[kTileRows][kBlock]) {
#if defined(SY_BLOCK_ZMM)
  __m512i w[8];
  unpack<Bits>(payload, w);
  for (int j = 0; j < 8; ++j) {
    alignas(64) uint32_t lanes[16];
    _mm512_store_si512(lanes, w[j]);
    for (int r = 0; r < kTileRows; ++r) std::memcpy(&u[r][4 * j], &lanes[r], 4);
  }
#else
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t k = 0; k < kBlock; ++k) u[r][k] = static_cast<uint8_t>(weight_u<Bits>(payload, r, k));
#endif
}

// Tiles [begin, end) of one segment as floats: out rows of K values (w = d u + c).
template <int64_t Bits, int64_t Group, int64_t Scheme, typename T>
void dequantize_tiles(const uint8_t* packed, T* out, int64_t K, int64_t rows, int64_t begin, int64_t end) {
  const int64_t blocks = K / kBlock, tile_size = tile_bytes(Bits, Group, Scheme, blocks);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t rows_here = std::min(kTileRows, rows - t * kTileRows);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* tile = packed + t * tile_size;
      const uint8_t* rec = tile + record_offset(Bits, Group, Scheme, b);
      const uint8_t* sup = tile + super_offset(Bits, Group, Scheme, b);
      alignas(64) uint8_t u[kTileRows][kBlock];
      record_u<Bits>(rec + header_bytes(Group, Scheme), u);
      for (int64_t r = 0; r < rows_here; ++r) {
        T* o = out + (t * kTileRows + r) * K + b * kBlock;
        for (int64_t g = 0; g < groups_of(Group); ++g) {
          float d, c;
          scales1<Bits, Group, Scheme>(sup, rec, r, g, d, c);
#if defined(SY_BLOCK_ZMM)
          if constexpr (Group == 16 || Group == 32) {
            bool done = false;
            for (int64_t h = 0; h < Group / 16; ++h) {  // 16 weights a register
              const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&u[r][g * Group + 16 * h]));
              const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), _mm512_set1_ps(d),
                                               _mm512_set1_ps(c));
              if constexpr (std::is_same_v<T, float>) {
                _mm512_storeu_ps(reinterpret_cast<float*>(o + g * Group + 16 * h), w);
                done = true;
              }
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<T, c10::BFloat16>) {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + g * Group + 16 * h), (__m256i)_mm512_cvtneps_pbh(w));
                done = true;
              }
#endif
            }
            if (done) continue;
          }
#endif
          float values[Group];
          for (int64_t k = 0; k < Group; ++k) values[k] = d * static_cast<float>(u[r][g * Group + k]) + c;
          for (int64_t k = 0; k < Group; ++k) o[g * Group + k] = static_cast<T>(values[k]);
        }
      }
    }
  }
}

// The float weight [out_features, K] the packed tiles encode, in float32 or bfloat16 (for a
// big batch's one GEMM: the caller drops it after the call).
at::Tensor block_dequantize(const at::Tensor& packed, const at::Tensor& segments, int64_t out_features, int64_t K,
                            at::ScalarType dtype) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "block_dequantize: packed must be contiguous uint8");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "block_dequantize: float32 or bfloat16");
  TORCH_CHECK(K % kBlock == 0, "block_dequantize: in_features must be a multiple of 32");
  const std::vector<Segment> parts = read_segments(segments, K, out_features, packed.numel());
  at::Tensor out = at::empty({out_features, K}, packed.options().dtype(dtype));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  for_tiles(parts, [&](const Segment& s, int64_t begin, int64_t end) {
    dispatch_layout(s, [&](auto bits, auto group, auto scheme) {
      constexpr int64_t B = decltype(bits)::value, G = decltype(group)::value, S = decltype(scheme)::value;
      if (dtype == at::kFloat)
        dequantize_tiles<B, G, S>(p + s.offset, out.data_ptr<float>() + s.row0 * K, K, s.rows, begin, end);
      else
        dequantize_tiles<B, G, S>(p + s.offset, out.data_ptr<c10::BFloat16>() + s.row0 * K, K, s.rows, begin, end);
    });
  });
  return out;
}

// The tiles of one part (block_pack.py's pack_fields, the layout's description, in C++ for
// speed): head [out, in / 32, F] (fp16, uint8 or int8) the fields of each row's record header,
// field f of row r at byte (16 f + r) * its size; super [out, in / 256, F'] likewise those of
// each super-block's scales (k-quants; else empty); u uint8 [out, in].
at::Tensor block_pack(const at::Tensor& head, const at::Tensor& super, const at::Tensor& u, int64_t bits, int64_t group,
                      int64_t scheme) {
  TORCH_CHECK(known_layout(bits, group, scheme), "block_pack: no tile layout for ", bits, "-bit weights in groups of ",
              group, " (scale scheme ", scheme, ")");
  TORCH_CHECK(u.scalar_type() == at::kByte && u.dim() == 2 && u.size(1) % kBlock == 0, "block_pack: u must be uint8 [out, in]");
  const int64_t out = u.size(0), K = u.size(1), blocks = K / kBlock, supers = super_bytes(scheme) ? blocks / kSuperBlocks : 0;
  TORCH_CHECK(super_bytes(scheme) == 0 || blocks % kSuperBlocks == 0, "block_pack: k-quants need a multiple of 256 inputs");
  const int64_t hw = head.element_size(), sw = super.element_size();
  TORCH_CHECK(head.dim() == 3 && head.size(0) == out && head.size(1) == blocks && head.size(2) * hw * kTileRows == header_bytes(group, scheme),
              "block_pack: head must be [out, in / 32, fields] of the scheme's header");
  TORCH_CHECK(supers == 0 ? super.numel() == 0
                          : super.dim() == 3 && super.size(0) == out && super.size(1) == supers &&
                                super.size(2) * sw * kTileRows == super_bytes(scheme),
              "block_pack: super must be [out, in / 256, fields] of the scheme's super-block scales");
  const at::Tensor hc = head.contiguous(), sc = super.contiguous(), uc = u.contiguous();
  const auto* hp = static_cast<const uint8_t*>(hc.data_ptr());
  const auto* sp = static_cast<const uint8_t*>(sc.data_ptr());
  const uint8_t* up = uc.data_ptr<uint8_t>();
  const int64_t hf = head.size(2), sf = supers ? super.size(2) : 0;
  const int64_t tiles = (out + kTileRows - 1) / kTileRows, tile_size = tile_bytes(bits, group, scheme, blocks);
  at::Tensor packed = at::zeros({tiles * tile_size}, u.options());
  uint8_t* pp = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* rec = pp + t * tile_size + record_offset(bits, group, scheme, b);
        uint8_t* sup = pp + t * tile_size + super_offset(bits, group, scheme, b);
        uint8_t* payload = rec + header_bytes(group, scheme);
        for (int64_t r = 0; r < kTileRows && t * kTileRows + r < out; ++r) {
          const int64_t row = t * kTileRows + r;
          for (int64_t f = 0; f < hf; ++f) std::memcpy(rec + (16 * f + r) * hw, hp + ((row * blocks + b) * hf + f) * hw, hw);
          if (supers && b % kSuperBlocks == 0)
            for (int64_t f = 0; f < sf; ++f)
              std::memcpy(sup + (16 * f + r) * sw, sp + ((row * supers + b / kSuperBlocks) * sf + f) * sw, sw);
          const uint8_t* ur = up + row * K + b * kBlock;
          for (int64_t k = 0; k < kBlock; ++k) {
            const int64_t j = k / 4, i = k % 4, n = 4 * r + i;
            if (bits == 8) {
              payload[64 * j + n] = ur[k];
              continue;
            }
            payload[64 * (j / 2) + n] |= j % 2 == 0 ? (ur[k] & 0x0F) : (ur[k] & 0x0F) << 4;
            for (int64_t p = 0; p < bits - 4; ++p)
              payload[256 + 64 * p + 8 * j + n / 8] |= ((ur[k] >> (4 + p)) & 1) << (n % 8);
          }
        }
      }
    }
  });
  return packed;
}

// From how many rows a step multiplies with AMX tiles; 0 where this build or the OS has none.
int64_t block_mm_amx_rows() {
#if defined(SY_BLOCK_AMX)
  if (amx_usable()) return kAmxMinRows;
#endif
  return 0;
}

// "avx512-vnni", "avx512", "avx2" or "portable": which loop this build runs (the caller prefers another
// kernel over the portable loop where it has one).
std::string block_mm_isa() {
#if defined(SY_BLOCK_VNNI)
  return "avx512-vnni";
#elif defined(SY_BLOCK_AVX512)
  return "avx512";
#elif defined(SY_BLOCK_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace blocks
}  // namespace
