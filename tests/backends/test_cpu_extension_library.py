"""Every CPU extension registers its ops under its own build name, in every torch the project runs
under (the xla environment's torch 2.9 too): csrc/extension_library.h's SWITCHYARD_LIBRARY, never a
bare TORCH_LIBRARY(TORCH_EXTENSION_NAME, ...), which torch < 2.10 registers as the literal namespace
"TORCH_EXTENSION_NAME" (the second extension loaded then aborts the process)."""
from __future__ import annotations

import os
import re

from switchyard.backends.cpu import extension

SOURCES = sorted(name for name in os.listdir(extension.SOURCES) if name.endswith(".cpp"))


def test_every_extension_source_registers_through_the_expanding_macro():
    assert SOURCES
    for name in SOURCES:
        with open(os.path.join(extension.SOURCES, name)) as file:
            text = file.read()
        assert not re.search(r"^\s*TORCH_LIBRARY\s*\(", text, re.M), f"{name}: use SWITCHYARD_LIBRARY(m)"
        assert re.search(r"^SWITCHYARD_LIBRARY\(m\) \{", text, re.M), f"{name} registers no op library"
        assert '#include "extension_library.h"' in text, name


def test_two_extensions_load_side_by_side_each_under_its_name(tmp_path):
    from switchyard.backends.cpu.quant import load_block_kernel

    decode = extension.build_paged_decode(str(tmp_path))
    blocks = load_block_kernel(str(tmp_path))
    if not (decode.available and blocks.available):
        import pytest

        pytest.skip(f"no kernel build here: {decode.reason or blocks.reason}")
    assert blocks.ops.block_mm_isa()
    assert decode.op is not None and blocks.name != os.path.basename(decode.directory)
