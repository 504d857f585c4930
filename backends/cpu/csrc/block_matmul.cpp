// The block-format matmul ops; the kernel itself is block_matmul.h (also called by
// decode_layers.cpp).
#include "block_matmul.h"
#include "extension_library.h"

SWITCHYARD_LIBRARY(m) {
  m.def("block_mm(Tensor x, Tensor packed, Tensor segments, int out_features, int passes=1) -> Tensor");
  m.impl("block_mm", c10::DispatchKey::CPU, &blocks::block_mm);
  m.def("block_dequantize(Tensor packed, Tensor segments, int out_features, int in_features, ScalarType dtype) -> Tensor");
  m.impl("block_dequantize", c10::DispatchKey::CPU, &blocks::block_dequantize);
  m.def("block_pack(Tensor head, Tensor super, Tensor u, int bits, int group, int scheme) -> Tensor");
  m.impl("block_pack", c10::DispatchKey::CPU, &blocks::block_pack);
  m.def("block_mm_isa() -> str", &blocks::block_mm_isa);
  m.def("block_mm_amx_rows() -> int", &blocks::block_mm_amx_rows);
}
