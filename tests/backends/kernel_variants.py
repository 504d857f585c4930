"""The CPU extensions built for another instruction set than this CPU's best, so that a test on
an AVX-512 machine also runs the loops an AVX2-only or a portable build runs (csrc/*.h pick
their loops by the compiler's target macros)."""
from __future__ import annotations

import pytest
import torch

from switchyard.backends.cpu.extension import CFLAGS, LDFLAGS, _cpu_flags

# variant -> extra compiler flags (after -march=native, so they take features away)
VARIANTS = {"portable": ("-DSY_BLOCK_PORTABLE", "-mno-avx512f", "-mno-avx2"), "avx2": ("-mno-avx512f",),
            "avx512-vnni": ("-mno-amx-tile",)}


def build_variant(source: str, variant: str, directory) -> object:
    """torch.ops namespace of `source` built as `variant` into `directory` (skips the test where
    this CPU cannot run that variant's instructions)."""
    from torch.utils.cpp_extension import load

    flags = set(_cpu_flags().split())
    if variant == "avx2" and not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    if variant == "avx512-vnni" and not {"avx512f", "avx512bw", "avx512_vnni", "f16c"} <= flags:
        pytest.skip("this CPU has no AVX512-VNNI")
    name = f"switchyard_{variant.replace('-', '_')}_{abs(hash((source, str(directory)))) % 10**8}"
    load(name=name, sources=[source], extra_cflags=[*CFLAGS, *VARIANTS[variant]], extra_ldflags=list(LDFLAGS),
         build_directory=str(directory), is_python_module=False)
    return getattr(torch.ops, name)
