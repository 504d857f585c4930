// The LoRA kernel's ops (backends/cpu/lora.py): lora_shrink and lora_expand over lora.h, which
// holds the kernel and its description (also called by decode_layers.cpp).
#include <torch/library.h>
#include <ATen/ATen.h>

#include <string>

#include "lora.h"
#include "extension_library.h"

namespace {
namespace lora {

// x [T, in] (rows may be strided), a [S, R, in] -> h [T, R] in x's dtype, zeros for slot -1.
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& token_slots) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && a.size(2) == x.size(1), "lora_shrink: x [T, in] and a [S, R, in]");
  return shrink_runs(x, a, runs_of(token_slots, x.size(0), a.size(0), "lora_shrink"));
}

// y [T, out] (rows may be strided, columns contiguous) += scales[s] * h[t] B[s]^T, b [S, out, R].
void lora_expand(const at::Tensor& y, const at::Tensor& h, const at::Tensor& b, const at::Tensor& scales,
                 const at::Tensor& token_slots) {
  TORCH_CHECK(y.dim() == 2 && b.dim() == 3, "lora_expand: y [T, out], h [T, R] and b [S, out, R]");
  expand_runs(y, h, b, scales, runs_of(token_slots, y.size(0), b.size(0), "lora_expand"));
}

// Which loop this build runs (tests build each variant).
std::string lora_isa() { return vec16_isa(); }

}  // namespace lora
}  // namespace

SWITCHYARD_LIBRARY(m) {
  m.def("lora_shrink(Tensor x, Tensor a, Tensor token_slots) -> Tensor");
  m.impl("lora_shrink", c10::DispatchKey::CPU, &lora::lora_shrink);
  m.def("lora_expand(Tensor(a!) y, Tensor h, Tensor b, Tensor scales, Tensor token_slots) -> ()");
  m.impl("lora_expand", c10::DispatchKey::CPU, &lora::lora_expand);
  m.def("lora_isa() -> str", &lora::lora_isa);
}
