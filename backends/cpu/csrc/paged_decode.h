#pragma once
// Decode attention that reads the paged KV cache in place (no gather).
//
// A task is one request's query heads over a range of its positions, each KV head's
// `group` query heads together (GQA folded: every K/V row is read once for all of them).
// The task walks its positions through the block table (a block's rows hold every KV head
// side by side, so it reads whole blocks), scores them against the queries and keeps an
// online (flash-decoding) softmax in float32: a running max m, a running sum l and an
// unnormalised output acc per query head. float32 and bfloat16 caches, queries and outputs in
// the cache's dtype; or a quantized cache (kv_rows.h: int8, float8_e4m3fn or float8_e5m2 codes
// with a float32 scale per row, --kv-cache-dtype), queries and outputs in float32 or bfloat16,
// its codes converted to float32 as they are read (no float8 arithmetic is needed). Accumulation
// in float32. Scale, sliding window and soft cap as AttentionSpec declares them; a row's window
// counts back from its anchor (AttentionMetadata.window_anchors: an image token's own position,
// core/multimodal/image_rows.py) where anchors are given, else from seq_len - 1.
//
// Work is spread with at::parallel_for over the tasks. A request longer than kSplit positions
// is split into ranges of kSplit (flash-decoding's split-KV), and the ranges' (m, l, acc) are
// merged afterwards, so that a single long request still keeps every thread busy. The split
// depends on the request's own length only, never on the batch: a row's output is the same
// bits whichever rows share its step (batch invariance; speculative decoding's verify rows give
// the logits the plain decode of the same token would, core/decode_batch.py decode_rows).
// Consecutive queries of one request one position apart (a prompt chunk's tokens, each laid out
// as a decode row) are one task per range, up to kGroupRows of them: each tile of the prefix is
// read once for all of them rather than once per query, with each query's arithmetic unchanged
// (paged_decode_simd.h attend_range_rows). 2-core Zen 4, AVX2 level, a 1,500-token prompt of the
// 1.7B shape: attention was ~28% of the prompt's time, reading its prefix once per token.
//
// The arithmetic: with AVX-512 or AVX2 and a head dim that is a multiple of 16,
// paged_decode_simd.h; otherwise the portable loops below, written for the compiler to
// vectorise (-O3, -march=native, -fopenmp-simd).
//
// Layouts: kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 scale bytes when
// quantized)] contiguous;
// query/out [B, num_heads, head_dim] (last dim contiguous); block_table [>=B, W] int32;
// seq_lens [>=B] int32 (the request's length including the token being decoded); anchors, when
// given, [>=B] int32 (each row attends to keys (anchor - window, seq_len) in a window).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "aligned.h"
#include "kv_rows.h"
#include "paged_decode_simd.h"

namespace {
namespace paged {

constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxHeads = 256;  // query heads
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlock = 256;      // tokens per cache block
// Positions per range of a split request. Against the batch-dependent split this replaced
// (batches under 4 requests a thread split into ranges of >= 64), one layer of SmolLM2's shapes
// on an idle 2-core AMX Xeon: 1-4 requests of 160-800 positions 0.91-1.05x the time, 32-64
// requests 1.00-1.06x (the extra merges); at 128 positions, 32-64 requests took 1.01-1.09x.
constexpr int64_t kSplit = 256;

using kv_rows::code_to_float;

struct Shape {
  int64_t block_size, num_kv_heads, head_dim, group, table_width;
  int64_t row;      // elements of one (token, KV head) row: head_dim, and a quantized row's scale
  int64_t kv_half;  // elements between the key and the value half of the cache
  int64_t q_stride0, q_stride1, o_stride0, o_stride1;
  float scale, soft_cap;
  int64_t window;
};

// ---- the portable arithmetic (no AVX-512 or AVX2, or a head dim that is not a multiple of 16) ----

// exp(x) for x <= 0 (Cephes expf, as vec16::exp), branch-free so loops vectorise.
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

// A row's n values (a quantized row's codes times its scale) into buffer.
template <typename T>
inline void row_to_float(const T* row, float* buffer, int64_t n) {
  if constexpr (kv_rows::Format<T>::kQuantized) {
    const float scale = kv_rows::row_scale(row, n);
    for (int64_t i = 0; i < n; ++i) buffer[i] = code_to_float(row[i]) * scale;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buffer[i] = code_to_float(row[i]);
  }
}

// One task's attention over positions [lo, hi) of KV head h, one cache block at a time
// (the tile between two rescales of acc); q is float32 and already scaled.
template <typename T>
void attend_range_portable(const Shape& s, const float* q, const T* cache, const int32_t* table, int64_t lo,
                           int64_t hi, int64_t h, float* m, float* l, float* acc) {
  const int64_t D = s.head_dim, G = s.group, bs = s.block_size, row_stride = s.num_kv_heads * s.row;
  float scores[kMaxGroup * kMaxBlock], row[kMaxHeadDim];
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, -INFINITY);
  std::fill(l, l + G, 0.0f);
  for (int64_t block = lo / bs; block * bs < hi; ++block) {
    const int64_t first = std::max(lo, block * bs), n = std::min(hi, (block + 1) * bs) - first;
    const T* keys = cache + (static_cast<int64_t>(table[block]) * bs + (first - block * bs)) * row_stride + h * s.row;
    for (int64_t t = 0; t < n; ++t) {
      row_to_float(keys + t * row_stride, row, D);
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < D; ++d) sum += q[g * D + d] * row[d];
        scores[g * kMaxBlock + t] = s.soft_cap > 0.0f ? s.soft_cap * std::tanh(sum / s.soft_cap) : sum;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * kMaxBlock;
      const float new_max = std::max(m[g], *std::max_element(sg, sg + n));
      const float alpha = std::exp(m[g] - new_max);  // 0 on the first block (m = -inf)
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        sum += sg[t];
      }
      l[g] = l[g] * alpha + sum;
      m[g] = new_max;
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
    }
    for (int64_t t = 0; t < n; ++t) {
      row_to_float(keys + s.kv_half + t * row_stride, row, D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * kMaxBlock + t];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * row[d];
      }
    }
  }
}

// Every KV head in turn: q [H * G * D], m and l [H * G], acc [H * G * D].
template <typename T>
void attend_heads_portable(const Shape& s, const float* q, const T* cache, const int32_t* table, int64_t lo,
                           int64_t hi, float* m, float* l, float* acc) {
  const int64_t G = s.group, D = s.head_dim;
  for (int64_t h = 0; h < s.num_kv_heads; ++h) {
    attend_range_portable(s, q + h * G * D, cache, table, lo, hi, h, m + h * G, l + h * G, acc + h * G * D);
  }
}

// ---- tasks ----

// Which positions each task covers: request b owns tasks [splits[b], splits[b + 1]), ranges
// of `chunk` positions (the last one shorter) from first[b] on.
struct TaskPlan {
  std::vector<int64_t> first, last, splits;  // splits: prefix sums, size B + 1
  int64_t chunk;
  int64_t num_tasks() const { return splits.back(); }
};

// anchors: nullptr (each window counts back from seq_len - 1) or each row's anchor.
TaskPlan plan_tasks(const Shape& s, const int32_t* lens, const int32_t* anchors, int64_t batch) {
  TaskPlan plan{std::vector<int64_t>(batch), std::vector<int64_t>(batch), std::vector<int64_t>(batch + 1, 0), 0};
  plan.chunk = kSplit;
  for (int64_t b = 0; b < batch; ++b) {
    plan.last[b] = lens[b];
    const int64_t window_end = anchors != nullptr ? int64_t{anchors[b]} + 1 : int64_t{lens[b]};
    plan.first[b] = s.window > 0 ? std::max<int64_t>(0, window_end - s.window) : 0;
    const int64_t length = plan.last[b] - plan.first[b];
    plan.splits[b + 1] = plan.splits[b] + std::max<int64_t>(1, (length + kSplit - 1) / kSplit);
  }
  return plan;
}

// Task `task` of the plan: its request b, its positions [lo, hi), and how many ranges b has.
struct TaskRange {
  int64_t b, lo, hi, ranges;
};

TaskRange task_range(const TaskPlan& plan, int64_t task) {
  const int64_t b = std::upper_bound(plan.splits.begin(), plan.splits.end(), task) - plan.splits.begin() - 1;
  const int64_t ranges = plan.splits[b + 1] - plan.splits[b];
  const int64_t lo = plan.first[b] + (task - plan.splits[b]) * plan.chunk;
  const int64_t hi = ranges == 1 ? plan.last[b] : std::min(plan.last[b], lo + plan.chunk);
  return {b, lo, hi, ranges};
}

// Task boundaries of `threads` contiguous shares of about equal positions (+ a fixed cost per
// task): a served batch mixes short and long contexts, and equal numbers of tasks per thread
// left one thread waiting for the other.
// A task: the queries [first, first + count) over their range `range` (positions from
// first[b] + range * chunk). count > 1: one request's consecutive positions (row_groups), whose
// ranges start alike, attended together (paged_decode_simd.h attend_range_rows).
struct Task {
  int64_t first, count, range;
};

// Up to this many queries are attended together: a prompt chunk's tokens laid out as decode rows
// (core/execution/runner.py by_row), so that its prefix is read once per tile for all of them.
constexpr int64_t kGroupRows = 32;
#if defined(SY_VEC16)
static_assert(kGroupRows <= paged_decode_simd::kMaxQueries, "attend_range_rows takes at most kMaxQueries");
#endif

// The tasks: consecutive queries b, b + 1 go in one task when query b + 1 is one position longer
// and reads the same blocks (its block-table entries equal b's, where b's positions lie), as a
// prompt chunk's rows are; `grouping` false (no vector arithmetic, or a window, which moves each
// query's first position): one query per task, each of its ranges a task, as before.
std::vector<Task> plan_group_tasks(const Shape& s, const TaskPlan& plan, const int32_t* tables, int64_t batch,
                                   bool grouping) {
  std::vector<Task> tasks;
  for (int64_t b = 0; b < batch;) {
    int64_t count = 1;
    while (grouping && count < kGroupRows && b + count < batch) {
      const int64_t prev = b + count - 1, next = b + count;
      const int64_t used = (plan.last[prev] + s.block_size - 1) / s.block_size;
      if (plan.last[next] != plan.last[prev] + 1 ||
          std::memcmp(tables + prev * s.table_width, tables + next * s.table_width, used * sizeof(int32_t)) != 0) {
        break;
      }
      ++count;
    }
    const int64_t last = b + count - 1, ranges = plan.splits[last + 1] - plan.splits[last];
    for (int64_t k = 0; k < ranges; ++k) tasks.push_back({b, count, k});
    b += count;
  }
  return tasks;
}

// Query b's range k ([lo, hi)) and how many ranges it has (k >= ranges: it has no range k).
inline TaskRange query_range(const TaskPlan& plan, int64_t b, int64_t k) {
  const int64_t ranges = plan.splits[b + 1] - plan.splits[b];
  if (k >= ranges) return {b, 0, 0, ranges};
  return task_range(plan, plan.splits[b] + k);
}

// Bounds of each thread's contiguous share of the tasks, by cost (positions read, and a little
// per query).
std::vector<int64_t> balance(const TaskPlan& plan, const std::vector<Task>& tasks, int64_t threads) {
  const int64_t count = static_cast<int64_t>(tasks.size());
  threads = std::max<int64_t>(1, std::min(threads, count));
  std::vector<int64_t> cost(count + 1, 0);
  for (int64_t t = 0; t < count; ++t) {
    cost[t + 1] = cost[t];
    for (int64_t b = tasks[t].first; b < tasks[t].first + tasks[t].count; ++b) {
      const TaskRange r = query_range(plan, b, tasks[t].range);
      if (tasks[t].range < r.ranges) cost[t + 1] += (r.hi - r.lo) + 16;
    }
  }
  std::vector<int64_t> bounds(threads + 1, count);
  bounds[0] = 0;
  for (int64_t i = 1; i < threads; ++i) {
    const int64_t target = cost[count] * i / threads;
    bounds[i] = std::max(bounds[i - 1], static_cast<int64_t>(std::lower_bound(cost.begin(), cost.end(), target) - cost.begin()));
  }
  return bounds;
}

template <typename T>
void write_out(const float* acc, const float* l, int64_t heads, int64_t D, T* out, int64_t o_stride1) {
  for (int64_t j = 0; j < heads; ++j) {
    const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[j * o_stride1 + d] = static_cast<T>(acc[j * D + d] * inv);
  }
}

// Merges the (acc, m, l) of a request's ranges (parts: [ranges][heads * (D + 2)]) into out.
template <typename T>
void merge_ranges(const float* parts, int64_t ranges, int64_t heads, int64_t D, T* out, int64_t o_stride1) {
  const int64_t stride = heads * (D + 2);
  std::vector<float> acc(heads * D, 0.0f), l(heads, 0.0f);
  for (int64_t j = 0; j < heads; ++j) {
    float max = -INFINITY;
    for (int64_t r = 0; r < ranges; ++r) max = std::max(max, parts[r * stride + heads * D + j]);
    for (int64_t r = 0; r < ranges; ++r) {
      const float* part = parts + r * stride;
      const float weight = std::exp(part[heads * D + j] - max);
      l[j] += weight * part[heads * D + heads + j];
      for (int64_t d = 0; d < D; ++d) acc[j * D + d] += weight * part[j * D + d];
    }
  }
  write_out(acc.data(), l.data(), heads, D, out, o_stride1);
}

// ---- choosing the arithmetic, running the tasks ----

template <typename T>
using RangeFn = void (*)(const Shape&, const float*, const T*, const int32_t*, int64_t, int64_t, float*, float*,
                         float*);
// Several queries of one request from one lo (Task.count > 1): q, m, l, acc per query, his their ends.
template <typename T>
using RowsFn = void (*)(const Shape&, int64_t, const float* const*, const T*, const int32_t*, int64_t, const int64_t*,
                        float* const*, float* const*, float* const*);

#if defined(SY_VEC16)
template <typename T, int64_t kD, int64_t kG>
void attend_range_simd(const Shape& s, const float* q, const T* cache, const int32_t* table, int64_t lo,
                         int64_t hi, float* m, float* l, float* acc) {
  const paged_decode_simd::Rows rows{cache, table, s.block_size, s.num_kv_heads, s.kv_half, s.row};
  paged_decode_simd::attend_range<T, kD, kG>(rows, q, s.head_dim, s.group, s.soft_cap, lo, hi, m, l, acc);
}

// Code specialised for the common head dims and groups (acc in registers), generic otherwise.
template <typename T, int64_t kD, int64_t kG>
void attend_rows_simd(const Shape& s, int64_t count, const float* const* q, const T* cache, const int32_t* table,
                      int64_t lo, const int64_t* his, float* const* m, float* const* l, float* const* acc) {
  const paged_decode_simd::Rows rows{cache, table, s.block_size, s.num_kv_heads, s.kv_half, s.row};
  paged_decode_simd::attend_range_rows<T, kD, kG>(rows, count, q, s.head_dim, s.group, s.soft_cap, lo, his, m, l, acc);
}

template <typename T, int64_t kD>
RowsFn<T> rows_for_group(int64_t group) {
  switch (group) {
    case 1: return &attend_rows_simd<T, kD, 1>;
    case 2: return &attend_rows_simd<T, kD, 2>;
    case 3: return &attend_rows_simd<T, kD, 3>;
    case 4: return &attend_rows_simd<T, kD, 4>;
    default: return &attend_rows_simd<T, 0, 0>;
  }
}

template <typename T, int64_t kD>
RangeFn<T> for_group(int64_t group) {
  switch (group) {
    case 1: return &attend_range_simd<T, kD, 1>;
    case 2: return &attend_range_simd<T, kD, 2>;
    case 3: return &attend_range_simd<T, kD, 3>;
    case 4: return &attend_range_simd<T, kD, 4>;
    default: return &attend_range_simd<T, 0, 0>;
  }
}
#endif

template <typename T>
RangeFn<T> choose_arithmetic(const Shape& s) {
#if defined(SY_VEC16)
  if (s.head_dim == 64) return for_group<T, 64>(s.group);
  if (s.head_dim == 128) return for_group<T, 128>(s.group);
  if (s.head_dim % 16 == 0) return &attend_range_simd<T, 0, 0>;
#endif
  return &attend_heads_portable<T>;
}

// The several-queries arithmetic that matches choose_arithmetic's, or nullptr (portable loops:
// one query per task).
template <typename T>
RowsFn<T> choose_rows_arithmetic(const Shape& s) {
#if defined(SY_VEC16)
  if (s.head_dim == 64) return rows_for_group<T, 64>(s.group);
  if (s.head_dim == 128) return rows_for_group<T, 128>(s.group);
  if (s.head_dim % 16 == 0) return &attend_rows_simd<T, 0, 0>;
#endif
  (void)s;
  return nullptr;
}

// Queries and outputs of type Q, the cache of element type C (Q itself, or a quantized code).
template <typename Q, typename C>
void run(const Shape& s, const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& block_table, const at::Tensor& seq_lens, const int32_t* anchors, int64_t batch) {
  const Q* queries = query.const_data_ptr<Q>();
  Q* outs = out.data_ptr<Q>();
  const C* cache = kv_cache.const_data_ptr<C>();
  const int32_t* tables = block_table.const_data_ptr<int32_t>();
  const TaskPlan plan = plan_tasks(s, seq_lens.const_data_ptr<int32_t>(), anchors, batch);
  const RangeFn<C> attend = choose_arithmetic<C>(s);
  const RowsFn<C> attend_rows = choose_rows_arithmetic<C>(s);
  const std::vector<Task> tasks = plan_group_tasks(s, plan, tables, batch, attend_rows != nullptr && s.window <= 0);
  const int64_t HG = s.num_kv_heads * s.group, D = s.head_dim, stride = HG * (D + 2);
  std::vector<float> parts(plan.num_tasks() > batch ? plan.num_tasks() * stride : 0);
  const std::vector<int64_t> bounds = balance(plan, tasks, at::get_num_threads());
  int64_t widest = 1;  // queries of the largest task: a decode step's tasks have one each
  for (const Task& task : tasks) widest = std::max(widest, task.count);
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t first, int64_t last) {
    // per query of a task: q, then acc, m, l (the order parts keep: acc, m, l), each written before
    // it is read (the arithmetic clears acc, m and l), so left uninitialised (cleared for kGroupRows
    // queries at every call, it was ~0.5 MB of memset a thread and layer), on cache lines (aligned.h)
    const auto buffer = aligned::array<float>(widest * HG * (2 * D + 2));
    float *q[kGroupRows], *acc[kGroupRows], *m[kGroupRows], *l[kGroupRows];
    int64_t his[kGroupRows], rows[kGroupRows];
    for (int64_t i = 0; i < widest; ++i) {
      float* at = buffer.get() + i * HG * (2 * D + 2);
      q[i] = at, acc[i] = at + HG * D, m[i] = acc[i] + HG * D, l[i] = m[i] + HG;
    }
    for (int64_t t = bounds[first]; t < bounds[last]; ++t) {
      const Task& task = tasks[t];
      int64_t count = 0, lo = 0;
      for (int64_t b = task.first; b < task.first + task.count; ++b) {
        const TaskRange r = query_range(plan, b, task.range);
        if (task.range >= r.ranges) continue;  // a shorter query of the group: it has no such range
        const Q* qb = queries + b * s.q_stride0;
        for (int64_t j = 0; j < HG; ++j) {
          for (int64_t d = 0; d < D; ++d) q[count][j * D + d] = code_to_float(qb[j * s.q_stride1 + d]) * s.scale;
        }
        lo = r.lo, his[count] = r.hi, rows[count] = b, ++count;
      }
      if (count == 1) {
        attend(s, q[0], cache, tables + rows[0] * s.table_width, lo, his[0], m[0], l[0], acc[0]);
      } else if (count > 1) {
        attend_rows(s, count, q, cache, tables + rows[0] * s.table_width, lo, his, m, l, acc);
      }
      for (int64_t i = 0; i < count; ++i) {
        const int64_t b = rows[i], ranges = plan.splits[b + 1] - plan.splits[b];
        if (ranges == 1) {
          write_out(acc[i], l[i], HG, D, outs + b * s.o_stride0, s.o_stride1);
        } else {
          std::copy(acc[i], acc[i] + stride, parts.data() + (plan.splits[b] + task.range) * stride);  // acc, m, l
        }
      }
    }
  });
  if (parts.empty()) return;
  at::parallel_for(0, batch, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t ranges = plan.splits[b + 1] - plan.splits[b];
      if (ranges > 1) {
        merge_ranges(parts.data() + plan.splits[b] * stride, ranges, HG, D, outs + b * s.o_stride0, s.o_stride1);
      }
    }
  });
}

void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t window,
                  double soft_cap, const std::optional<at::Tensor>& anchors = std::nullopt) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && query.sizes() == out.sizes(), "query/out must be [B, H, D]");
  const at::ScalarType cache_type = kv_cache.scalar_type(), query_type = query.scalar_type();
  const bool quantized = kv_rows::is_quantized(cache_type);
  TORCH_CHECK(out.scalar_type() == query_type && (quantized ? query_type == at::kFloat || query_type == at::kBFloat16
                                                            : query_type == cache_type),
              "query and out must share the cache's dtype (or, over a quantized cache, be float32 or bfloat16)");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out must be contiguous in head_dim");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1 && seq_lens.is_contiguous(),
              "block_table must be [rows, width] with contiguous rows");
  const int64_t batch = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  const int64_t row = head_dim + (quantized ? kv_rows::kScaleBytes : 0);
  TORCH_CHECK(kv_cache.size(4) == row && heads % kv_heads == 0, "head shapes do not match the cache");
  TORCH_CHECK(heads / kv_heads <= kMaxGroup && heads <= kMaxHeads && head_dim <= kMaxHeadDim &&
                  kv_cache.size(2) <= kMaxBlock,
              "group, heads, head_dim or block size too large");
  TORCH_CHECK(block_table.size(0) >= batch && seq_lens.size(0) >= batch, "fewer block-table rows than queries");
  TORCH_CHECK(!anchors.has_value() || (anchors->scalar_type() == at::kInt && anchors->is_contiguous() &&
                                       anchors->size(0) >= batch),
              "anchors must be int32, contiguous, one per query");
  const int32_t* row_anchors = anchors.has_value() ? anchors->const_data_ptr<int32_t>() : nullptr;
  Shape s{kv_cache.size(2), kv_heads, head_dim, heads / kv_heads, block_table.stride(0), row,
          kv_cache.stride(0), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
          static_cast<float>(scale), static_cast<float>(soft_cap), window};
  if (quantized) {
    kv_rows::visit_quantized(cache_type, [&](auto code) {
      using C = decltype(code);
      if (query_type == at::kFloat) {
        run<float, C>(s, out, query, kv_cache, block_table, seq_lens, row_anchors, batch);
      } else {
        run<c10::BFloat16, C>(s, out, query, kv_cache, block_table, seq_lens, row_anchors, batch);
      }
    });
  } else if (cache_type == at::kFloat) {
    run<float, float>(s, out, query, kv_cache, block_table, seq_lens, row_anchors, batch);
  } else if (cache_type == at::kBFloat16) {
    run<c10::BFloat16, c10::BFloat16>(s, out, query, kv_cache, block_table, seq_lens, row_anchors, batch);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32, bfloat16 and quantized (int8, float8) caches, not ", cache_type);
  }
}

}  // namespace paged
}  // namespace

