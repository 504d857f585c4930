// The op library of one CPU extension, registered under the build's name (TORCH_EXTENSION_NAME,
// extension.py's build_name). Before torch 2.10, TORCH_LIBRARY stringifies its namespace unexpanded
// (#ns), so TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) registers the literal "TORCH_EXTENSION_NAME":
// the ops are then missing under the build's name, and a second extension loaded in the same process
// aborts it (a namespace registered twice). One more macro level expands the name first.
#pragma once

#include <torch/library.h>

#define SWITCHYARD_LIBRARY_IN(ns, m) TORCH_LIBRARY(ns, m)
#define SWITCHYARD_LIBRARY(m) SWITCHYARD_LIBRARY_IN(TORCH_EXTENSION_NAME, m)
