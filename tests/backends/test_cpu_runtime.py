"""The tuned CPU runtime (backends/cpu/runtime.py): what it finds, the environment it asks
for, and the dtype the CPU backend prefers. Its effect on a served engine process:
tests/gateway/test_cpu_runtime_serve.py."""
from __future__ import annotations

import os
import platform

import pytest

from switchyard.backends.cpu import CpuBackend
from switchyard.backends.cpu import backend as cpu_backend_module
from switchyard.backends.cpu import runtime
from switchyard.backends.cpu.runtime import CpuRuntime, Library
from switchyard.core.config import EngineConfig, ParallelConfig

IOMP = Library("libiomp5", "/venv/lib/libiomp5.so")
TCMALLOC = Library("tcmalloc", "/usr/lib/libtcmalloc_minimal.so.4")


def _touch(folder, name):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(b"")
    return str(folder / name)


def test_tcmalloc_is_preferred_then_jemalloc_then_none(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    jemalloc = _touch(second, "libjemalloc.so.2")
    assert runtime.find_allocator([str(first), str(second)], {}) == Library("jemalloc", jemalloc)
    tcmalloc = _touch(second, "libtcmalloc.so.4")
    assert runtime.find_allocator([str(first), str(second)], {}) == Library("tcmalloc", tcmalloc)
    minimal = _touch(second, "libtcmalloc_minimal.so.4")
    assert runtime.find_allocator([str(first), str(second)], {}).path == minimal
    assert runtime.find_allocator([str(first)], {}) is None


def test_ldconfig_cache_is_searched_after_the_folders(tmp_path):
    elsewhere = _touch(tmp_path / "opt", "libjemalloc.so.2")
    assert runtime.find_allocator([str(tmp_path / "none")], {"libjemalloc.so.2": elsewhere}).path == elsewhere
    # a cache entry whose file is gone is not used
    assert runtime.find_allocator([], {"libtcmalloc.so.4": str(tmp_path / "gone.so")}) is None


def test_ldconfig_output_is_parsed(monkeypatch):
    class Done:
        stdout = ("2 libs found in cache `/etc/ld.so.cache'\n"
                  "\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n"
                  "\tlibjemalloc.so.2 (libc6,x86-64) => /lib/x86_64-linux-gnu/libjemalloc.so.2\n")

    monkeypatch.setattr(runtime.subprocess, "run", lambda *a, **k: Done())
    assert runtime.ldconfig_libraries() == {
        "libtcmalloc_minimal.so.4": "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "libjemalloc.so.2": "/lib/x86_64-linux-gnu/libjemalloc.so.2"}


def test_intel_openmp_is_found_where_its_wheel_installs_it(tmp_path):
    path = _touch(tmp_path / "venv" / "lib", "libiomp5.so")
    assert runtime.find_intel_openmp([str(tmp_path / "other"), str(tmp_path / "venv")]) == Library("libiomp5", path)
    assert runtime.find_intel_openmp([str(tmp_path / "other")]) is None


def test_one_thread_per_physical_core(tmp_path):
    # cpus 0 and 2 are hyperthreads of one core, 1 and 3 of another; cpu 5 has no topology
    for cpu, core in {0: 0, 1: 1, 2: 0, 3: 1}.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert runtime.physical_cores({3, 2, 1, 0, 5}, str(tmp_path)) == (0, 1, 5)
    assert runtime.physical_cores({2, 3}, str(tmp_path)) == (2, 3)


def test_intel_openmp_environment_binds_with_kmp_affinity():
    env = CpuRuntime(TCMALLOC, IOMP, cores=(0, 2), bind=True).environment({})
    assert env["LD_PRELOAD"] == f"{TCMALLOC.path} {IOMP.path}"
    assert env["OMP_NUM_THREADS"] == "2" and env["KMP_BLOCKTIME"] == "1" and env["KMP_TPAUSE"] == "0"
    assert env["KMP_AFFINITY"] == "granularity=fine,proclist=[0,2],explicit"
    assert "OMP_PROC_BIND" not in env and "OMP_PLACES" not in env


def test_gnu_openmp_environment_binds_with_omp_places():
    env = CpuRuntime(None, None, cores=(1, 3), bind=True).environment({})
    assert env == {"OMP_NUM_THREADS": "2", "OMP_PROC_BIND": "close", "OMP_PLACES": "{1},{3}",
                   "GLIBC_TUNABLES": runtime.GLIBC_HEAP_TUNABLES}
    assert CpuRuntime(None, None, cores=(1, 3), bind=False).environment({}) == {
        "OMP_NUM_THREADS": "2", "GLIBC_TUNABLES": runtime.GLIBC_HEAP_TUNABLES}


def test_glibc_malloc_keeps_large_blocks_on_the_heap_unless_an_allocator_is_preloaded():
    assert "GLIBC_TUNABLES" not in CpuRuntime(TCMALLOC, None, cores=(0,), bind=False).environment({})
    heap = CpuRuntime(None, None, cores=(0,), bind=False)
    # the user's own tunables come after ours (a later setting wins), and asking again changes nothing
    users = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}
    env = heap.environment(users)
    assert env["GLIBC_TUNABLES"] == f"{runtime.GLIBC_HEAP_TUNABLES}:glibc.malloc.trim_threshold=0"
    assert heap.environment({**users, **env}) == env
    assert "large blocks kept on the heap" in heap.describe()


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_heap_tunables_are_ones_glibc_reads():
    # a child started with them runs, and its malloc keeps a 64 MB block on the heap (brk), not mapped
    import subprocess
    import sys
    code = ("import ctypes, re; libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; "
            "p = libc.malloc(64 << 20); maps = open('/proc/self/maps').read(); "
            "heap = [l for l in maps.splitlines() if l.endswith('[heap]')]; "
            "lo, hi = (int(x, 16) for x in heap[0].split()[0].split('-')); print(lo <= p < hi)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "GLIBC_TUNABLES": runtime.GLIBC_HEAP_TUNABLES}).stdout
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}).stdout
    assert (out.strip(), plain.strip()) == ("True", "False")


def test_the_users_own_settings_are_kept_and_preloads_merged():
    users = {"LD_PRELOAD": "/mine/libfoo.so:" + IOMP.path, "OMP_NUM_THREADS": "1", "KMP_BLOCKTIME": "200"}
    env = CpuRuntime(TCMALLOC, IOMP, cores=(0, 1), bind=False).environment(users)
    assert env["LD_PRELOAD"] == f"{TCMALLOC.path} {IOMP.path} /mine/libfoo.so"
    assert env["OMP_NUM_THREADS"] == "1" and env["KMP_BLOCKTIME"] == "200" and "KMP_AFFINITY" not in env
    # asking again from the environment it produced asks for nothing new (no restart loop)
    assert CpuRuntime(TCMALLOC, IOMP, cores=(0, 1), bind=False).environment({**users, **env}) == env


def test_a_sharded_engine_is_not_bound(monkeypatch):
    monkeypatch.setattr(runtime, "find_allocator", lambda: None)
    monkeypatch.setattr(runtime, "find_intel_openmp", lambda: None)
    assert not runtime.plan_runtime(sharded=True, cpus={0, 1}).bind
    assert runtime.plan_runtime(sharded=False, cpus={0, 1}).bind


def test_cpu_backend_asks_for_the_runtime_unless_plain(monkeypatch):
    plan = lambda sharded=False: CpuRuntime(TCMALLOC, IOMP, cores=(0,), bind=not sharded)  # noqa: E731
    monkeypatch.setattr(cpu_backend_module, "this_machine", plan)
    monkeypatch.setattr(os, "environ", {"PATH": "/bin"})
    backend = CpuBackend()
    env = backend.process_environment(EngineConfig())
    assert env["LD_PRELOAD"] == f"{TCMALLOC.path} {IOMP.path}" and "KMP_AFFINITY" in env
    assert backend.process_environment(EngineConfig(runtime="plain")) == {}
    assert "tcmalloc" in backend.capabilities().runtime and "bound" in backend.capabilities().runtime
    sharded = backend.process_environment(EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2)))
    assert "LD_PRELOAD" in sharded and "KMP_AFFINITY" not in sharded


def test_cpu_flags_choose_the_preferred_dtype(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n")
    assert runtime.cpu_flags(str(cpuinfo)) >= {"avx512_bf16", "amx_tile"}
    assert runtime.cpu_flags(str(tmp_path / "missing")) == frozenset()
    assert runtime.prefers_bfloat16(frozenset({"amx_bf16"})) and runtime.prefers_bfloat16(frozenset({"avx512_bf16"}))
    assert not runtime.prefers_bfloat16(frozenset({"avx512f", "avx2", "amx_tile"}))
    assert cpu_backend_module.preferred_dtype(frozenset({"avx2", "fma"})) == "float32"
    import torch

    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_backend_module.preferred_dtype(frozenset({"amx_bf16"})) == ("bfloat16" if bf16 else "float32")


def test_switchyard_backends_says_what_the_cpu_runtime_chose(capsys, monkeypatch):
    from switchyard.gateway import cli

    monkeypatch.setattr(cpu_backend_module, "this_machine", lambda sharded=False: CpuRuntime(TCMALLOC, IOMP, (0, 1), True))
    monkeypatch.setattr(cpu_backend_module, "preferred_dtype", lambda flags=None: "bfloat16")
    monkeypatch.setattr(cpu_backend_module, "isa_levels", lambda: ("portable", "avx2"))
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "dtype auto = bfloat16 (of float32, bfloat16); float32 for gguf, int4 (integer products)" in out
    assert "instruction sets (--cpu-isa): portable, avx2 (auto: avx2)" in out
    assert "KV cache (--kv-cache-dtype): auto, int8, fp8_e4m3fn, fp8_e5m2" in out
    assert (f"runtime (serve --runtime tuned): allocator tcmalloc ({TCMALLOC.path}); OpenMP Intel OpenMP "
            f"({IOMP.path}); 2 threads on cores 0,1, bound") in out
