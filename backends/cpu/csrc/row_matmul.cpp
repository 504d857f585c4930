// The bf16 few-rows matmul op; the kernel itself is row_matmul.h (also called by
// decode_layers.cpp).
#include <torch/library.h>

#include <string>

#include "row_matmul.h"
#include "extension_library.h"

SWITCHYARD_LIBRARY(m) {
  m.def("bf16_rows_mm(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.impl("bf16_rows_mm", c10::DispatchKey::CPU, &rows::bf16_rows_mm);
  m.def("rows_mm_isa() -> str", &rows::rows_mm_isa);
}
