// Decode attention that reads the paged KV cache in place (no gather).
//
// For each decode request b and KV head h (the `group` query heads sharing it, GQA
// folded), walk the request's tokens through its block table, score them against the
// group's queries, and keep an online (flash-decoding) softmax in float32: a running
// max m, a running sum l and an unnormalised output acc per query head, rescaled once
// per cache block. float32 and bfloat16 caches; queries and outputs in the
// cache's dtype; accumulation in float32. Scale, sliding window and soft cap as
// AttentionSpec declares them. Work is split over (request, KV head) with
// at::parallel_for. Loops are written for the compiler to vectorise (-O3,
// -march=native, -fopenmp-simd); exp is a polynomial the compiler can vectorise too.
//
// Layouts: kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous;
// query/out [B, num_heads, head_dim] (last dim contiguous); block_table [>=B, W] int32;
// seq_lens [>=B] int32 (the request's length including the token being decoded).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlock = 256;  // tokens per cache block, scored between two rescales of acc

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial;
// ~1 ulp), branch-free so that loops calling it vectorise.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// A row of the cache as float32: the row itself for a float cache, a converted copy otherwise.
inline const float* row_as_float(const float* row, float* /*buffer*/, int64_t /*n*/) { return row; }
inline const float* row_as_float(const c10::BFloat16* row, float* buffer, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(buffer + i, &widened, sizeof(float));
  }
  return buffer;
}

struct Shape {
  int64_t block_size, num_kv_heads, head_dim, group, table_width;
  int64_t kv_half;  // elements between the key and the value half of the cache
  int64_t q_stride0, q_stride1, o_stride0, o_stride1;
  float scale, soft_cap;
  int64_t window;
};

// Attention of one request's `group` query heads over KV head h. kD > 0: the head
// dimension as a compile-time constant (its loops unroll; measured 2x faster at 64);
// 0: s.head_dim.
template <typename T, int64_t kD>
void attend_one(const Shape& s, const T* query, T* out, const T* cache, const int32_t* table, int64_t seq_len,
                int64_t h) {
  const int64_t D = kD > 0 ? kD : s.head_dim, G = s.group;
  float q[kMaxGroup * kMaxHeadDim], acc[kMaxGroup * kMaxHeadDim];
  float scores[kMaxGroup * kMaxBlock], row_buffer[kMaxHeadDim];
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = query + (h * G + g) * s.q_stride1;
    for (int64_t d = 0; d < D; ++d) q[g * D + d] = to_float(qg[d]);
    std::fill(acc + g * D, acc + (g + 1) * D, 0.0f);
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, seq_len - s.window) : 0;
  const int64_t bs = s.block_size, row_stride = s.num_kv_heads * D;
  // One tile per block: its rows are base + i * row_stride, no division per token.
  for (int64_t block = first / bs; block * bs < seq_len; ++block) {
    const int64_t lo = std::max(first, block * bs), n = std::min(seq_len, (block + 1) * bs) - lo;
    const T* keys = cache + (static_cast<int64_t>(table[block]) * bs + (lo - block * bs)) * row_stride + h * D;
    const T* values = keys + s.kv_half;
    for (int64_t t = 0; t < n; ++t) {
      const float* k = row_as_float(keys + t * row_stride, row_buffer, D);
      for (int64_t g = 0; g < G; ++g) scores[g * kMaxBlock + t] = dot(q + g * D, k, D) * s.scale;
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * kMaxBlock;
      if (s.soft_cap > 0.0f) {
        for (int64_t t = 0; t < n; ++t) sg[t] = s.soft_cap * std::tanh(sg[t] / s.soft_cap);
      }
      float tile_max = sg[0];
      for (int64_t t = 1; t < n; ++t) tile_max = std::max(tile_max, sg[t]);
      const float new_max = std::max(m[g], tile_max);
      const float alpha = m[g] == -INFINITY ? 0.0f : exp_nonpositive(m[g] - new_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        sum += sg[t];
      }
      l[g] = l[g] * alpha + sum;
      m[g] = new_max;
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* v = row_as_float(values + t * row_stride, row_buffer, D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * kMaxBlock + t];
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    T* og = out + (h * G + g) * s.o_stride1;
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) og[d] = static_cast<T>(acc[g * D + d] * inv);
  }
}

template <typename T, int64_t kD>
void run(const Shape& s, const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t batch) {
  const T* q = query.const_data_ptr<T>();
  T* o = out.data_ptr<T>();
  const T* cache = kv_cache.const_data_ptr<T>();
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  at::parallel_for(0, batch * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / s.num_kv_heads, h = item % s.num_kv_heads;
      attend_one<T, kD>(s, q + b * s.q_stride0, o + b * s.o_stride0, cache, table + b * s.table_width, lens[b], h);
    }
  });
}

template <typename T>
void dispatch_head_dim(const Shape& s, const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t batch) {
  // Specialised code for the common head dims; generic otherwise.
  if (s.head_dim == 64) {
    run<T, 64>(s, out, query, kv_cache, block_table, seq_lens, batch);
  } else if (s.head_dim == 128) {
    run<T, 128>(s, out, query, kv_cache, block_table, seq_lens, batch);
  } else {
    run<T, 0>(s, out, query, kv_cache, block_table, seq_lens, batch);
  }
}

void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t window,
                  double soft_cap) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && query.sizes() == out.sizes(), "query/out must be [B, H, D]");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == kv_cache.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out must be contiguous in head_dim");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1 && seq_lens.is_contiguous(),
              "block_table must be [rows, width] with contiguous rows");
  const int64_t batch = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim && heads % kv_heads == 0, "head shapes do not match the cache");
  TORCH_CHECK(heads / kv_heads <= kMaxGroup && head_dim <= kMaxHeadDim && kv_cache.size(2) <= kMaxBlock,
              "group, head_dim or block size too large");
  TORCH_CHECK(block_table.size(0) >= batch && seq_lens.size(0) >= batch, "fewer block-table rows than queries");
  Shape s{kv_cache.size(2), kv_heads, head_dim, heads / kv_heads, block_table.stride(0),
          kv_cache.stride(0), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
          static_cast<float>(scale), static_cast<float>(soft_cap), window};
  if (kv_cache.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(s, out, query, kv_cache, block_table, seq_lens, batch);
  } else if (kv_cache.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<c10::BFloat16>(s, out, query, kv_cache, block_table, seq_lens, batch);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16 caches, not ", kv_cache.scalar_type());
  }
}

}  // namespace

// TORCH_EXTENSION_NAME is set per build (see extension.py): one namespace per build
// directory, so two builds loaded in one process never register the same op twice.
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int window, float soft_cap) -> ()",
        &paged_decode);
}
