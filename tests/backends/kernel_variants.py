"""The CPU extensions built for another instruction set than this CPU's best, so that a test on
an AVX-512 machine also runs the loops an AVX2-only or a portable build runs (csrc/*.h pick
their loops by the compiler's target macros): the engine's own levels (extension.py ISA_LEVELS,
what `--cpu-isa` builds), into a folder of the test's."""
from __future__ import annotations

import pytest
import torch

from switchyard.backends.cpu.extension import LDFLAGS, compile_flags, isa_levels


def build_variant(source: str, variant: str, directory) -> object:
    """torch.ops namespace of `source` built as `variant` into `directory` (skips the test where
    this CPU cannot run that variant's instructions)."""
    from torch.utils.cpp_extension import load

    if variant not in isa_levels():
        pytest.skip(f"this CPU cannot run {variant}")
    name = f"switchyard_{variant.replace('-', '_')}_{abs(hash((source, str(directory)))) % 10**8}"
    load(name=name, sources=[source], extra_cflags=list(compile_flags(variant)), extra_ldflags=list(LDFLAGS),
         build_directory=str(directory), is_python_module=False)
    return getattr(torch.ops, name)
