#pragma once
// A vector of 16 float32 lanes for the decode kernels' arithmetic (paged_decode_simd.h,
// elementwise.h): one AVX-512 register, or two AVX2 registers on CPUs without AVX-512 (with
// FMA and F16C, e.g. AMD Zen 2/3, Intel Haswell..Alder Lake). The kernels are written once
// against these functions; SY_VEC16 is defined where the CPU has one of the two, and the
// kernels' portable loops run elsewhere. Both give the same results lane for lane (the same
// operations in the same order; only reductions across lanes differ in association).
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#define SY_VEC16 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SY_VEC16 1
#define SY_VEC16_AVX2 1
#endif

// Which loop a kernel built against this header runs ("avx512", "avx2" or "portable"): what the
// kernels' *_isa ops report (tests build each variant; loaders refuse the portable one where slow).
inline const char* vec16_isa() {
#if defined(SY_VEC16) && !defined(SY_VEC16_AVX2)
  return "avx512";
#elif defined(SY_VEC16)
  return "avx2";
#else
  return "portable";
#endif
}

#if defined(SY_VEC16)
namespace vec16 {

#if !defined(SY_VEC16_AVX2)
struct V {
  __m512 v;
};
inline V set1(float x) { return {_mm512_set1_ps(x)}; }
inline V zero() { return {_mm512_setzero_ps()}; }
inline V load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V load(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
}
// 16 one-byte codes of a quantized KV cache row (kv_rows.h), as float32: int8 exactly; float8 through
// the float16 of the same value (e5m2 is float16's top byte; e4m3fn's bits moved into a float16
// 2^8 smaller, whose conversion also takes the subnormals), so no float8 arithmetic is needed.
inline V load(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline __m256i codes16(const void* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
inline __m256i e4m3_as_half(__m256i b) {
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  return _mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
}
inline V load(const c10::Float8_e5m2* p) { return {_mm512_cvtph_ps(_mm256_slli_epi16(codes16(p), 8))}; }
inline V load(const c10::Float8_e4m3fn* p) {
  return {_mm512_mul_ps(_mm512_cvtph_ps(e4m3_as_half(codes16(p))), _mm512_set1_ps(256.0f))};
}
inline void store(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V add(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V sub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V mul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V div(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V min(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V max(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V fmadd(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V fnmadd(V a, V b, V c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline V round_nearest(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n for integral n in [-126, 127]
inline V scale_by_pow2(V a, V n) { return {_mm512_scalef_ps(a.v, n.v)}; }
inline float reduce_add(V a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(V a) { return _mm512_reduce_max_ps(a.v); }
// lanes [0, n) of a, the others `fill`
inline V first(V a, int64_t n, float fill) {
  return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), static_cast<__mmask16>((1u << n) - 1), a.v)};
}

// Lane i of the result: the sum of the 16 lanes of v[i]. Pairs are folded within 128-bit
// lanes (unpack 32-, then 64-bit), then the four 128-bit lanes are transposed and added.
inline V hsum(const V* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD))};
}

// float32 -> bfloat16 bits, round to nearest even (NaN stays NaN: quiet bit set).
inline __m256i bf16_bits(V a) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a.v));
#else
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}
inline void store(c10::BFloat16* p, V a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(a)); }
// v rounded to bfloat16 and back
inline V round_bf16(V a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(a)), 16))}; }

#else  // AVX2: lanes 0-7 in lo, 8-15 in hi

struct V {
  __m256 lo, hi;
};
inline V set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline V load(const c10::BFloat16* p) { return {bf16x8(p), bf16x8(p + 8)}; }
// quantized KV codes, as the AVX-512 loads above
inline V load(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline __m256i codes16(const void* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
inline __m256i e4m3_as_half(__m256i b) {
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  return _mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
}
inline V halves(__m256i h) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
inline V load(const c10::Float8_e5m2* p) { return halves(_mm256_slli_epi16(codes16(p), 8)); }
inline V load(const c10::Float8_e4m3fn* p) {
  const V v = halves(e4m3_as_half(codes16(p)));
  return {_mm256_mul_ps(v.lo, _mm256_set1_ps(256.0f)), _mm256_mul_ps(v.hi, _mm256_set1_ps(256.0f))};
}
inline void store(float* p, V a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
#define SY_VEC16_BINARY(name, op) \
  inline V name(V a, V b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
SY_VEC16_BINARY(add, _mm256_add_ps)
SY_VEC16_BINARY(sub, _mm256_sub_ps)
SY_VEC16_BINARY(mul, _mm256_mul_ps)
SY_VEC16_BINARY(div, _mm256_div_ps)
SY_VEC16_BINARY(min, _mm256_min_ps)
SY_VEC16_BINARY(max, _mm256_max_ps)
#undef SY_VEC16_BINARY
inline V fmadd(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V fnmadd(V a, V b, V c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline V round_nearest(V a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// a * 2^n for integral n in [-126, 127]: 2^n built in the exponent bits
inline __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V scale_by_pow2(V a, V n) { return {_mm256_mul_ps(a.lo, pow2(n.lo)), _mm256_mul_ps(a.hi, pow2(n.hi))}; }
inline float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_add(V a) { return sum8(_mm256_add_ps(a.lo, a.hi)); }
inline float reduce_max(V a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline V first(V a, int64_t n, float fill) {
  const __m256i count = _mm256_set1_epi32(static_cast<int32_t>(n));
  const __m256i lo = _mm256_cmpgt_epi32(count, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i hi = _mm256_cmpgt_epi32(count, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, _mm256_castsi256_ps(lo)), _mm256_blendv_ps(f, a.hi, _mm256_castsi256_ps(hi))};
}
// Lane i: the sum of the 8 lanes of a[i] (a transposing reduction of 8 registers).
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline V hsum(const V* v) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {hsum8(s), hsum8(s + 8)};
}
// 8 float32 -> 8 bfloat16 bits in the low 16 of each int32 lane, round to nearest even
// (NaN stays NaN: quiet bit set).
inline __m256i bf16_bits(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}
inline void store(c10::BFloat16* p, V a) {
  // packus works within 128-bit lanes: [lo0-3 hi0-3 | lo4-7 hi4-7], put back in order
  const __m256i packed = _mm256_packus_epi32(bf16_bits(a.lo), bf16_bits(a.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
inline V round_bf16(V a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.lo), 16)), _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.hi), 16))};
}
#endif

// exp of every lane (Cephes expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp;
// inputs clamped to float's finite range, so that n stays in [-126, 127]).
inline V exp(V x) {
  x = max(min(x, set1(88.37f)), set1(-87.33f));
  const V n = round_nearest(mul(x, set1(1.44269504088896341f)));
  V r = fnmadd(n, set1(0.693359375f), x);
  r = fmadd(n, set1(2.12194440e-4f), r);
  V p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return scale_by_pow2(p, n);
}

// cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1).
inline V soft_cap(V x, float cap) {
  const V e = exp(mul(x, set1(2.0f / cap)));
  return mul(sub(set1(1.0f), div(set1(2.0f), add(e, set1(1.0f)))), set1(cap));
}

// v rounded to bfloat16 and back (T = bfloat16), or v itself (T = float).
template <typename T>
inline V round_to(V v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return round_bf16(v);
  }
}

}  // namespace vec16
#endif
