// The in-place decode-attention op; the kernel itself is paged_decode.h (also called by
// decode_layers.cpp).
#include "paged_decode.h"
#include "extension_library.h"

// TORCH_EXTENSION_NAME is set per build (see extension.py): one namespace per build
// directory, so two builds loaded in one process never register the same op twice.
SWITCHYARD_LIBRARY(m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int window, float soft_cap) -> ()",
        &paged::paged_decode);
}
