// The in-place decode-attention op; the kernel itself is paged_decode.h (also called by
// decode_layers.cpp). quantize_kv_rows writes rows of a quantized KV cache as decode_layers.cpp
// does (kv_rows.h), for the tests that hold them equal to core/kv/quantized.py's.
#include "paged_decode.h"
#include "extension_library.h"

namespace {

// x [N, D] (float32 or bfloat16, contiguous) -> out [N, D + 4] of a quantized cache's dtype.
void quantize_kv_rows(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous() &&
                  out.size(0) == x.size(0) && out.size(1) == x.size(1) + kv_rows::kScaleBytes,
              "quantize_kv_rows: x [N, D] and out [N, D + 4], contiguous");
  const int64_t D = x.size(1);
  kv_rows::visit_quantized(out.scalar_type(), [&](auto code) {
    using C = decltype(code);
    C* rows = out.data_ptr<C>();
    const int64_t W = D + kv_rows::kScaleBytes;
    const auto quantize = [&](const auto* values) {
      for (int64_t n = 0; n < x.size(0); ++n) kv_rows::quantize_row(values + n * D, D, rows + n * W);
    };
    if (x.scalar_type() == at::kFloat) {
      quantize(x.const_data_ptr<float>());
    } else {
      TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quantize_kv_rows: float32 or bfloat16 values");
      quantize(x.const_data_ptr<c10::BFloat16>());
    }
  });
}

}  // namespace

// TORCH_EXTENSION_NAME is set per build (see extension.py): one namespace per build
// directory, so two builds loaded in one process never register the same op twice.
SWITCHYARD_LIBRARY(m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int window, float soft_cap, Tensor? anchors=None) -> ()",
        &paged::paged_decode);
  m.def("quantize_kv_rows(Tensor x, Tensor(a!) out) -> ()", &quantize_kv_rows);
}
