// The block-format matmul op; the kernel itself is block_matmul.h (also called by
// decode_layers.cpp).
#include "block_matmul.h"

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("block_mm(Tensor x, Tensor packed, int out_features, int bits) -> Tensor");
  m.impl("block_mm", c10::DispatchKey::CPU, &blocks::block_mm);
  m.def("block_mm_isa() -> str", &blocks::block_mm_isa);
}
