// Every decoder layer of a Llama-family model for one decode step, in C++: no Python, and
// no torch op per elementwise step, between the embedding and the LM head.
//
// backends/cpu/fused_decode.py builds a `DecodeLayers` (a TorchBind class) from the model's
// declared layout (core/models/layout.py) after prepare_model, and calls `forward` with the
// step's embedded tokens. Per layer, for M rows (each a decode row: a decode, a verify row, or a
// prompt token attending to the cache up to its own position, backends/cpu/runner.py):
//   hidden += delta; x = rms_norm(hidden) * w1        (delta: the previous layer's MLP output)
//   qkv = x W_qkv^T (+ b)
//   [q_norm, k_norm: per-head RMSNorm]  rotary on q and k  (the model's cos / signed-sin tables)
//   k, v -> the paged cache at slot_mapping (a negative slot writes nothing; a quantized cache,
//           --kv-cache-dtype, takes each head's row quantized: kv_rows.h)
//   a = paged decode attention (paged_decode.h, reading the cache in place)
//   hidden += a W_o^T; x = rms_norm(hidden) * w2
//   delta = (silu(x W_g^T) * x W_u^T) W_d^T
// and at the end hidden += delta, returned as rms_norm(hidden) * w_final.
// The rounding follows the eager model (core/layers): in bfloat16 the residual adds, the
// normalised row before its weight, silu before the product, and q*cos and rot(q)*sin before
// their sum are each rounded to bfloat16; everything else is computed in float32.
//
// A linear is one of six kinds (fused_decode.py's linear_operands says which module each is):
//   0 dense: at::linear (or matrix-vector for one row, as core/layers/linear.py decides)
//   1 onednn: a weight packed by oneDNN (linear.py), mkldnn::_linear_pointwise (in float32 for a
//     bf16 weight where oneDNN packs no bf16)
//   2 blocks: ggml block-format tiles in segments (block_matmul.h), in integers for any number
//     of rows, with `mode` activation passes (1 or 2, block_mm) (one arithmetic for prompt and decode rows: a row's output is the same bits
//     whatever rows share its call)
//   3 int8 / 4 int4: torch's weight-only kernels in bf16 (quant.py), same batch rule
//   5 rows: a bf16 weight in the row kernel's tiles (row_matmul.h) up to batch_rows rows, and
//     as its float32 oneDNN packing beyond (linear.py, CPUs without bf16 packing)
//
// LoRA adapters (core/lora): `add_lora` gives a linear the stacks of its wrapper (layers.py): the
// very tensors the LoraManager writes each adapter into, so a load or an eviction needs nothing
// here. A step's `token_slots` ([M], -1 for a row of the base model; empty for a step without
// adapter rows) are grouped by slot once (lora.h runs_of); after each linear with stacks its
// input is shrunk (once for a fused projection's parts, whose A stacks are one tensor) and each
// part's delta expanded into its column slice of the output: the calls, operands and order of
// LoraLinear.forward, through lora.h's arithmetic, so the deltas are the same bits as there. The
// shrinks write into one scratch buffer of the step and the expands read their columns of it in
// place (no tensor made per call: a decode step makes 11 such calls a layer).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "block_matmul.h"
#include "elementwise.h"
#include "kv_rows.h"
#include "lora.h"
#include "paged_decode.h"
#include "row_matmul.h"
#include "extension_library.h"

namespace {

enum Kind : int64_t { kDense = 0, kOnednn = 1, kBlocks = 2, kInt8 = 3, kInt4 = 4, kRows = 5 };

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               c10::string_view, c10::List<std::optional<at::Scalar>>,
                                               std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

struct Linear {
  int64_t kind = kDense, out_features = 0, mode = 0, batch_rows = -1;  // mode: blocks' activation passes
  bool single_row_matvec = false;
  // dense/onednn/rows: weight; blocks: packed + segments; int8: qweight + scales; int4: packed +
  // scales_and_zeros
  at::Tensor weight, aux;
  // batch: for rows > batch_rows, the oneDNN packing for batches (onednn, rows: float32) or the
  // oneDNN-packed bf16 copy of a quantized weight; order: an act-order weight's input columns
  // (the layer multiplies x[:, order], its weight's columns sorted by group)
  std::optional<at::Tensor> bias, batch, order;

  at::Tensor operator()(const at::Tensor& input) const {
    const at::Tensor x = order ? input.index_select(1, *order) : input;
    if (kind == kDense) {
      if (x.size(0) == 1 && single_row_matvec) {
        at::Tensor out = at::mv(weight, x[0]).unsqueeze(0);
        return bias ? out.add_(*bias) : out;
      }
      return at::linear(x, weight, bias);
    }
    if (kind == kRows && x.size(0) <= batch_rows) return rows::bf16_rows_mm(x, weight, out_features, bias);
    if (kind == kOnednn || kind == kRows) {
      const at::Tensor& packed = batch && x.size(0) > batch_rows ? *batch : weight;
      if (packed.scalar_type() == x.scalar_type()) return onednn_linear(x, packed, bias);
      // a bf16 weight packed as float32 (linear.py, CPUs without bf16 packing)
      return onednn_linear(x.to(packed.scalar_type()), packed, bias).to(x.scalar_type());
    }
    at::Tensor out;
    if (kind != kBlocks && batch && x.size(0) > batch_rows) {
      out = onednn_linear(x.to(at::kBFloat16), *batch, std::nullopt).to(x.scalar_type());
    } else if (kind == kBlocks) {
      out = blocks::block_mm(x, weight, aux, out_features, mode);
    } else if (kind == kInt8) {
      out = at::_weight_int8pack_mm(x.to(at::kBFloat16), weight, aux).to(x.scalar_type());
    } else {
      TORCH_CHECK(kind == kInt4, "decode_layers: unknown linear kind ", kind);
      out = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), weight, 32, aux);
      if (out.size(1) != out_features) out = out.narrow(1, 0, out_features);
      out = out.to(x.scalar_type());
    }
    return bias ? out.add_(*bias) : out;
  }
};

// Python passes an empty tensor for an absent one (a bias, a batch weight, a q/k norm).
std::optional<at::Tensor> present(const at::Tensor& x) {
  return x.defined() && x.numel() > 0 ? std::optional<at::Tensor>(x) : std::nullopt;
}

// A linear from Python: tensors [weight, aux, bias, batch, order] (an empty tensor where absent),
// ints [kind, out_features, mode, batch_rows, single_row_matvec].
Linear make_linear(const std::vector<at::Tensor>& t, const std::vector<int64_t>& i) {
  TORCH_CHECK(t.size() == 5 && i.size() == 5, "decode_layers: a linear is 5 tensors and 5 ints");
  Linear l;
  l.kind = i[0], l.out_features = i[1], l.mode = i[2], l.batch_rows = i[3], l.single_row_matvec = i[4] != 0;
  l.weight = t[0], l.aux = t[1], l.bias = present(t[2]), l.batch = present(t[3]), l.order = present(t[4]);
  return l;
}

// One part of a linear's adapters (a LoraStack): its A stack [S, R, in] (unused when the linear's
// parts share one), B [S, out, R], scales [S], and its columns [start, stop) of the output.
struct LoraPart {
  at::Tensor a, b, scales;
  int64_t part, start, stop;
};

// A linear's adapters: the shared A [S, parts * R, in] of a fused projection (or none), its parts.
struct LoraStacks {
  std::optional<at::Tensor> shared;
  std::vector<LoraPart> parts;

  bool empty() const { return parts.empty(); }

  // Columns of h a step's scratch buffer needs for this linear (the widest shrink).
  int64_t width() const {
    int64_t w = shared ? shared->size(1) : 0;
    for (const LoraPart& p : parts) w = std::max(w, p.b.size(2));
    return w;
  }

  // Columns of the linear's output the parts write (the last part's stop).
  int64_t columns() const {
    int64_t c = 0;
    for (const LoraPart& p : parts) c = std::max(c, p.stop);
    return c;
  }

  // y (the linear's output) += each part's delta for x (its input): LoraLinear.forward's calls and
  // operands, on raw rows: h is the step's scratch (rows ldh apart, at least width() columns), a
  // fused projection's parts shrunk into it at once and each expanded from its own columns.
  template <typename T>
  void apply(const at::Tensor& input, const at::Tensor& y, const lora::Runs& runs, T* h, int64_t ldh) const {
    TORCH_CHECK((y.stride(1) == 1 || y.size(1) <= 1) && y.size(1) >= columns() &&
                input.size(1) == (shared ? *shared : parts[0].a).size(2), "decode_layers: a LoRA linear's operands");
    const at::Tensor x = input.stride(1) == 1 ? input : input.contiguous();
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    if (shared) lora::shrink_into(xp, x.stride(0), *shared, h, ldh, runs);
    for (const LoraPart& p : parts) {
      const int64_t rank = p.b.size(2);
      if (!shared) lora::shrink_into(xp, x.stride(0), p.a, h, ldh, runs);
      lora::expand_from(yp + p.start, y.stride(0), shared ? h + p.part * rank : h, ldh, p.b, p.scales, runs);
    }
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  std::optional<at::Tensor> q_norm, k_norm;
  Linear qkv, o, gate_up, down;
  int64_t window;  // sliding window (0: none)
  LoraStacks lora[4];  // of qkv, o, gate_up, down (empty: no adapter targets it)
};

// Rows per at::parallel_for task for work of `cost` values a row: a few thousand values a
// task, so that a small step stays on the calling thread.
int64_t row_grain(int64_t cost) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, cost)); }

// hidden += delta (when given), then out = rms_norm(hidden) * weight, row by row.
template <typename T>
void add_rms_norm(T* hidden, const T* delta, const T* weight, T* out, int64_t M, int64_t H, float eps) {
  at::parallel_for(0, M, row_grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      elementwise::add_rms_norm_row(hidden + m * H, delta ? delta + m * H : nullptr, weight, out + m * H, H, eps);
    }
  });
}

// The attention prologue of each row of qkv [M, (H + 2 Hkv) D], in place: Qwen3's per-head
// RMSNorm of q and k (when given), rotary on the first `rot` dims of every q and k head (the
// model's cos / signed-sin tables, [M, rot] each), then k and v into the paged cache
// [2, blocks, block_size, Hkv, D] of C (T itself, or a quantized cache's code, whose rows are
// D codes and a scale) at the row's slot (a negative slot writes nothing).
template <typename T, typename C>
void attention_prologue(T* qkv, int64_t M, int64_t heads, int64_t kv_heads, int64_t D, int64_t rot, const T* cos,
                        const T* sin, const T* q_norm, const T* k_norm, float eps, const int64_t* slots, C* cache,
                        int64_t kv_half) {
  const int64_t width = (heads + 2 * kv_heads) * D, kv_size = kv_heads * D;
  at::parallel_for(0, M, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      T* row = qkv + m * width;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* head = row + h * D;
        const T* norm = h < heads ? q_norm : k_norm;
        if (norm != nullptr) elementwise::add_rms_norm_row<T>(head, nullptr, norm, head, D, eps);
        elementwise::rotary_head(head, cos + m * rot, sin + m * rot, rot);
      }
      if (slots[m] < 0) continue;
      const T* k = row + heads * D;
      if constexpr (kv_rows::Format<C>::kQuantized) {
        const int64_t W = D + kv_rows::kScaleBytes;
        C* keys = cache + slots[m] * kv_heads * W;
        for (int64_t h = 0; h < kv_heads; ++h) {
          kv_rows::quantize_row(k + h * D, D, keys + h * W);
          kv_rows::quantize_row(k + kv_size + h * D, D, keys + kv_half + h * W);
        }
      } else {
        std::copy(k, k + kv_size, cache + slots[m] * kv_size);
        std::copy(k + kv_size, k + 2 * kv_size, cache + kv_half + slots[m] * kv_size);
      }
    }
  });
}

// out [M, I] = silu(gate) * up from gate_up [M, 2I].
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t M, int64_t I) {
  at::parallel_for(0, M, row_grain(8 * I), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) elementwise::silu_and_mul_row(gate_up + m * 2 * I, gate_up + m * 2 * I + I, out + m * I, I);
  });
}

struct DecodeLayers : torch::CustomClassHolder {
  int64_t hidden_size, num_heads, num_kv_heads, head_dim, rotary_dim;
  double eps, scale, soft_cap;
  std::vector<Layer> layers;
  at::Tensor final_norm;
  int64_t lora_slots = 0;  // S of every LoRA stack (0: none added)
  int64_t lora_width = 0;  // columns of a step's LoRA scratch (the widest shrink)

  DecodeLayers(int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
               double eps, double scale, double soft_cap, at::Tensor final_norm)
      : hidden_size(hidden_size), num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim),
        rotary_dim(rotary_dim), eps(eps), scale(scale), soft_cap(soft_cap), final_norm(std::move(final_norm)) {
    TORCH_CHECK(head_dim <= 256 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, "decode_layers: head or rotary dim");
  }

  // norms: [input, post_attention, q_norm, k_norm] (empty tensors where the model has none);
  // linears: 5 tensors each for qkv, o, gate_up, down; ints: 5 each, then the window.
  void add_layer(std::vector<at::Tensor> norms, std::vector<at::Tensor> linears, std::vector<int64_t> ints) {
    TORCH_CHECK(norms.size() == 4 && linears.size() == 20 && ints.size() == 21, "decode_layers: bad layer");
    auto part = [&](int k) {
      return make_linear({linears.begin() + 5 * k, linears.begin() + 5 * k + 5}, {ints.begin() + 5 * k, ints.begin() + 5 * k + 5});
    };
    layers.push_back(Layer{norms[0], norms[1], present(norms[2]), present(norms[3]), part(0), part(1), part(2), part(3),
                           ints[20]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // The adapters of linear `linear` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer`: `shared` the
  // parts' one A stack (empty when they have their own), and per part its A (a), B (b) and scales
  // stacks and ints [part, start, stop].
  void add_lora(int64_t layer, int64_t linear, at::Tensor shared, std::vector<at::Tensor> a,
                std::vector<at::Tensor> b, std::vector<at::Tensor> scales, std::vector<int64_t> ranges) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && linear >= 0 && linear < 4, "decode_layers: no such linear");
    TORCH_CHECK(a.size() == b.size() && b.size() == scales.size() && ranges.size() == 3 * b.size() && !b.empty(),
                "decode_layers: a LoRA part is a, b, scales and 3 ints");
    LoraStacks stacks;
    stacks.shared = present(shared);
    // The stacks are the manager's tensors, written in place at each load: checked once here, read
    // by pointer at each step.
    const auto stack = [](const at::Tensor& t, int64_t dim) {
      TORCH_CHECK(t.dim() == dim && t.is_contiguous() && lora::is_float(t), "decode_layers: a LoRA stack must be a "
                  "contiguous float32 or bfloat16 tensor of ", dim, " dims");
    };
    if (stacks.shared) stack(*stacks.shared, 3);
    for (size_t k = 0; k < b.size(); ++k) {
      const int64_t S = b[k].size(0);
      TORCH_CHECK(lora_slots == 0 || lora_slots == S, "decode_layers: LoRA stacks of different slot counts");
      lora_slots = S;
      if (!stacks.shared) stack(a[k], 3);
      stack(b[k], 3);
      TORCH_CHECK(scales[k].dim() == 1 && scales[k].size(0) == S && scales[k].is_contiguous() &&
                  scales[k].scalar_type() == at::kFloat, "decode_layers: LoRA scales must be float32 [S]");
      const at::Tensor& in = stacks.shared ? *stacks.shared : a[k];
      const int64_t start = ranges[3 * k + 1], stop = ranges[3 * k + 2];
      TORCH_CHECK(in.size(0) == S && b[k].size(1) == stop - start && start >= 0 &&
                  (!stacks.shared || (ranges[3 * k] + 1) * b[k].size(2) <= in.size(1)) &&
                  (stacks.shared || in.size(1) == b[k].size(2)), "decode_layers: LoRA part shapes");
      stacks.parts.push_back(LoraPart{a[k], b[k], scales[k], ranges[3 * k], start, stop});
    }
    lora_width = std::max(lora_width, stacks.width());
    layers[layer].lora[linear] = std::move(stacks);
  }

  // hidden [M, hidden_size] (embedded tokens; updated in place as the residual stream),
  // cos / sin [M, 1, rotary_dim], kv_caches one per layer, slot_mapping [M] int64,
  // block_table [M, W] int32, seq_lens [M] int32, token_slots [M] int32 (each row's LoRA slot, -1
  // none; empty: no adapter row) -> the final-normed hidden [M, hidden_size].
  at::Tensor forward(at::Tensor hidden, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv_caches,
                     at::Tensor slot_mapping, at::Tensor block_table, at::Tensor seq_lens, at::Tensor token_slots) {
    TORCH_CHECK(kv_caches.size() == layers.size(), "decode_layers: one cache per layer");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_size && hidden.is_contiguous(), "decode_layers: hidden");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "decode_layers: slot_mapping must be int64");
    TORCH_CHECK(cos.scalar_type() == hidden.scalar_type() && sin.scalar_type() == hidden.scalar_type() &&
                cos.numel() == hidden.size(0) * rotary_dim && sin.numel() == cos.numel(), "decode_layers: rotary tables");
    const at::Tensor c = cos.contiguous(), s = sin.contiguous(), slots = slot_mapping.contiguous();
    const bool adapted = token_slots.numel() > 0 && lora_slots > 0;  // (no stacks: no linear has adapters)
    const lora::Runs runs = adapted ? lora::runs_of(token_slots, hidden.size(0), lora_slots, "decode_layers")
                                    : lora::Runs();
    const lora::Runs* r = adapted ? &runs : nullptr;
    if (hidden.scalar_type() == at::kFloat) return run<float>(hidden, c, s, kv_caches, slots, block_table, seq_lens, r);
    TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "decode_layers: float32 or bfloat16");
    return run<c10::BFloat16>(hidden, c, s, kv_caches, slots, block_table, seq_lens, r);
  }

  // linear k of `layer` on x, plus its adapters' deltas when the step has adapter rows (runs; h the
  // step's LoRA scratch, rows lora_width apart).
  template <typename T>
  at::Tensor project(const Layer& layer, int k, const at::Tensor& x, const lora::Runs* runs, T* h) const {
    const Linear& linear = k == 0 ? layer.qkv : k == 1 ? layer.o : k == 2 ? layer.gate_up : layer.down;
    at::Tensor y = linear(x);
    if (runs != nullptr && !layer.lora[k].empty()) layer.lora[k].apply<T>(x, y, *runs, h, lora_width);
    return y;
  }

  template <typename T>
  at::Tensor run(at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& caches,
                 const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& seq_lens,
                 const lora::Runs* runs) {
    const int64_t M = hidden.size(0), H = hidden_size, D = head_dim;
    const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D, width = q_size + 2 * kv_size;
    const float e = static_cast<float>(eps);
    at::Tensor x = at::empty_like(hidden), delta;
    T* h = hidden.data_ptr<T>();
    // the LoRA shrinks' output, every linear's in turn (one buffer for the step)
    const at::Tensor lora_scratch = runs ? at::empty({M, lora_width}, hidden.options()) : at::Tensor();
    T* lh = runs ? lora_scratch.data_ptr<T>() : nullptr;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
      add_rms_norm<T>(h, delta.defined() ? delta.data_ptr<T>() : nullptr, layer.input_norm.data_ptr<T>(),
                      x.data_ptr<T>(), M, H, e);
      at::Tensor qkv = project<T>(layer, 0, x, runs, lh);
      TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == width, "decode_layers: qkv output");
      T* qp = qkv.data_ptr<T>();
      const at::Tensor& cache = caches[i];
      const bool quantized = kv_rows::is_quantized(cache.scalar_type());
      TORCH_CHECK((quantized || cache.scalar_type() == hidden.scalar_type()) && cache.is_contiguous(),
                  "decode_layers: cache dtype");
      const auto prologue = [&](auto* cache_data) {
        attention_prologue(qp, M, num_heads, num_kv_heads, D, rotary_dim, cos.data_ptr<T>(), sin.data_ptr<T>(),
                           layer.q_norm ? layer.q_norm->data_ptr<T>() : nullptr,
                           layer.k_norm ? layer.k_norm->data_ptr<T>() : nullptr, e, slots.data_ptr<int64_t>(),
                           cache_data, cache.stride(0));
      };
      if (quantized) {
        kv_rows::visit_quantized(cache.scalar_type(), [&](auto code) { prologue(cache.data_ptr<decltype(code)>()); });
      } else {
        prologue(cache.data_ptr<T>());
      }
      at::Tensor attention = at::empty({M, num_heads, D}, hidden.options());
      paged::paged_decode(attention, qkv.narrow(1, 0, q_size).view({M, num_heads, D}), cache, block_table, seq_lens,
                          scale, layer.window, soft_cap);
      const at::Tensor o = project<T>(layer, 1, attention.view({M, q_size}), runs, lh);
      add_rms_norm<T>(h, o.data_ptr<T>(), layer.post_norm.data_ptr<T>(), x.data_ptr<T>(), M, H, e);
      const at::Tensor gate_up = project<T>(layer, 2, x, runs, lh);
      const int64_t I = gate_up.size(1) / 2;
      at::Tensor act = at::empty({M, I}, hidden.options());
      silu_and_mul<T>(gate_up.data_ptr<T>(), act.data_ptr<T>(), M, I);
      delta = project<T>(layer, 3, act, runs, lh);
    }
    at::Tensor out = at::empty_like(hidden);
    add_rms_norm<T>(h, delta.defined() ? delta.data_ptr<T>() : nullptr, final_norm.data_ptr<T>(), out.data_ptr<T>(),
                    M, H, e);
    return out;
  }
};

}  // namespace

SWITCHYARD_LIBRARY(m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, double, at::Tensor>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("add_lora", &DecodeLayers::add_lora)
      .def("forward", &DecodeLayers::forward);
}
