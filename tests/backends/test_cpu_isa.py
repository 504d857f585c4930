"""`--cpu-isa`: the instruction-set levels a CPU runs, what each hides of its flags, the compiler
flags that hold a build there, and what holds torch's own kernels there (backends/cpu)."""
from __future__ import annotations

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu import backend as cpu_backend
from switchyard.backends.cpu import extension
from switchyard.core.config import EngineConfig

ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}


def test_levels_follow_the_cpus_flags(monkeypatch):
    monkeypatch.setattr(extension.platform, "machine", lambda: "x86_64")
    assert extension.isa_levels(frozenset({"sse4_2"})) == ("portable",)
    assert extension.isa_levels(ZEN3) == ("portable", "avx2")
    assert extension.isa_levels(ZEN4) == ("portable", "avx2", "avx512", "avx512-vnni")
    assert extension.isa_levels(SAPPHIRE_RAPIDS)[-1] == "amx"
    assert extension.resolve_isa("auto", ZEN4) == "avx512-vnni" and extension.resolve_isa("avx2", ZEN4) == "avx2"
    monkeypatch.setattr(extension.platform, "machine", lambda: "aarch64")
    assert extension.isa_levels(frozenset({"asimd", "sve"})) == ("portable",)
    assert extension.compile_flags("auto") == extension.CFLAGS  # no x86 -mno-* flags for an ARM compiler


def test_a_level_hides_what_is_above_it(monkeypatch):
    monkeypatch.setattr(extension.platform, "machine", lambda: "x86_64")
    assert extension.level_flags("avx2", SAPPHIRE_RAPIDS) == ZEN3
    assert extension.level_flags("avx512", SAPPHIRE_RAPIDS) == ZEN4 - {"avx512_vnni", "avx512_bf16"}
    assert extension.level_flags("auto", SAPPHIRE_RAPIDS) == SAPPHIRE_RAPIDS
    assert cpu_backend.preferred_dtype(extension.level_flags("avx2", SAPPHIRE_RAPIDS)) == "float32"


def test_each_level_builds_apart_with_its_own_flags():
    assert extension.compile_flags("avx2")[-1] == "-mno-avx512f"
    assert "-DSY_BLOCK_PORTABLE" in extension.compile_flags("portable")
    names = {extension.build_name(extension.SOURCE, "/tmp/c", level) for level in ("portable", "avx2", "avx512")}
    assert len(names) == 3
    # "auto" is the best level this CPU runs: the same binary as naming that level
    best = extension.isa_levels()[-1]
    assert extension.build_name(extension.SOURCE, "/tmp/c") == extension.build_name(extension.SOURCE, "/tmp/c", best)


def test_a_forced_level_holds_torchs_kernels_too():
    backend = CpuBackend()
    assert "ONEDNN_MAX_CPU_ISA" not in backend.process_environment(EngineConfig(runtime="plain"))
    held = backend.process_environment(EngineConfig(runtime="plain", isa="avx2"))
    assert (held["ATEN_CPU_CAPABILITY"], held["ONEDNN_MAX_CPU_ISA"]) == ("avx2", "AVX2")
    tuned = backend.process_environment(EngineConfig(isa="portable"))
    assert (tuned["ATEN_CPU_CAPABILITY"], tuned["ONEDNN_MAX_CPU_ISA"]) == ("default", "SSE41")


def test_capabilities_list_the_levels_with_their_dtype():
    caps = CpuBackend().capabilities()
    assert [level for level, _ in caps.isa_levels] == list(extension.isa_levels())
    assert dict(caps.isa_levels)["portable"] == "float32"
    assert caps.integer_quantizations == ("gguf", "int4")
