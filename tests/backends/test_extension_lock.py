"""Starts and the CPU kernels' build cache (backends/cpu/extension.py): a first start says what
it costs and shows each compile; a cached start loads the stamped binary without waiting for
any lock or recompiling a touched source; a stale lock cannot stall a start; a start that waits
for a live build says for whom. Built from a one-op source, so that a compile stays short."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from switchyard.backends.cpu import extension
from switchyard.core.engine import heartbeat
from switchyard.core.engine.heartbeat import Heartbeat

TINY = textwrap.dedent("""
    // one op, registered under the build's name (csrc/extension_library.h's expanding macro)
    #include <torch/library.h>
    #define TINY_LIBRARY_IN(ns, m) TORCH_LIBRARY(ns, m)
    #define TINY_LIBRARY(m) TINY_LIBRARY_IN(TORCH_EXTENSION_NAME, m)
    at::Tensor same(const at::Tensor& x) { return x; }
    TINY_LIBRARY(m) {
      m.def("same(Tensor x) -> Tensor");
      m.impl("same", c10::DispatchKey::CPU, &same);
    }
""")
ARGS = ("tiny kernel", "plain torch", ("same",))

_BUILD = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    from switchyard.backends.cpu.extension import build_extension
    build = build_extension(sys.argv[1], sys.argv[2], "tiny kernel", "plain torch", ("same",))
    import torch
    ok = build.available and build.ops.same(torch.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
    print(json.dumps(dict(ok=ok, cache_hit=build.cache_hit, seconds=build.seconds, reason=build.reason)))
""")


def _build(cache_root, source, timeout: float = 300) -> tuple[dict, str]:
    """build_extension in a fresh process (a start): its result and its log."""
    done = subprocess.run([sys.executable, "-c", _BUILD, str(cache_root), str(source)], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


class Built:
    def __init__(self, root, source):
        self.root, self.source = root, source
        self.name = extension.build_name(str(source), str(root))
        self.directory = extension.build_directory(str(root), self.name)
        self.binary = os.path.join(self.directory, f"{self.name}.so")
        self.stamp = extension.stamp_path(self.directory, self.name)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if extension._missing_tools():
        pytest.skip(f"no kernel build here: {extension._missing_tools()}")
    folder = tmp_path_factory.mktemp("tiny")
    source = folder / "tiny.cpp"
    source.write_text(TINY)
    result, log = _build(folder / "cache", source)
    assert result["ok"] and not result["cache_hit"], log
    assert "first start: building CPU kernels, about a minute or two, cached afterwards" in log  # before it compiles
    assert log.index("first start") < log.index("tiny kernel: compiling tiny.cpp") < log.index("kernel compiled")
    return Built(folder / "cache", source)


def _holding_the_lock(directory: str, seconds: float) -> subprocess.Popen:
    """Another process that holds the build lock (writing its pid, as a builder does) for `seconds`."""
    script = textwrap.dedent(f"""
        import fcntl, os, sys, time
        with open({os.path.join(directory, '.build.lock')!r}, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            lock.truncate(0); lock.write(f"{{os.getpid()}}\\n"); lock.flush()
            print("holding", flush=True)
            time.sleep({seconds})
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_cached_start_loads_the_stamped_build_even_while_another_process_holds_the_lock(built):
    """Before, every start took the lock and ran ninja: a start waited for whoever held it."""
    assert os.path.isfile(built.stamp)
    holder = _holding_the_lock(built.directory, 300)
    try:
        began = time.monotonic()
        result, log = _build(built.root, built.source, timeout=120)
        assert time.monotonic() - began < 60
    finally:
        holder.kill()
        holder.wait()
    assert result["ok"] and result["cache_hit"] and result["seconds"] < 5, log
    assert "waiting" not in log and "first start" not in log and "kernel reused" in log


def test_a_source_whose_mtime_alone_changed_is_not_recompiled(built):
    """ninja rebuilds a source newer than its object; the digest in the name says it is the same."""
    built_at = os.stat(built.binary).st_mtime_ns
    later = time.time() + 3600
    os.utime(built.source, (later, later))
    result, log = _build(built.root, built.source)
    assert result["ok"] and result["cache_hit"], log
    assert os.stat(built.binary).st_mtime_ns == built_at and "compiling" not in log


def test_a_stale_lock_cannot_stall_a_start(built):
    """An interrupted build leaves torch's `lock` file (torch's own build waits for it forever)
    and a pid in ours, and no stamp: the next start still builds at once."""
    os.remove(built.stamp)
    with open(os.path.join(built.directory, "lock"), "w"):
        pass
    with open(os.path.join(built.directory, ".build.lock"), "w") as lock:
        lock.write("999999999\n")  # no such process, and it holds nothing
    result, log = _build(built.root, built.source, timeout=120)
    assert result["ok"] and result["cache_hit"], log
    assert "removed the lock file" in log and "waiting" not in log
    assert not os.path.exists(os.path.join(built.directory, "lock")) and os.path.isfile(built.stamp)


def test_a_start_that_waits_for_a_live_build_says_for_whom(built, monkeypatch, caplog):
    os.remove(built.stamp)  # as while the first start still builds: the binary is not known good
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.3)
    holder = _holding_the_lock(built.directory, 2.0)
    try:
        with caplog.at_level(logging.INFO, logger=extension.__name__):
            build = extension.build_extension.__wrapped__(str(built.root), str(built.source), *ARGS)
    finally:
        holder.wait(30)
    assert build.available and build.cache_hit
    messages = caplog.messages
    waiting = next(m for m in messages if "waiting for" in m)
    assert waiting.startswith(f"tiny kernel: waiting for process {holder.pid} (") and built.directory in waiting
    assert any(m.startswith(f"tiny kernel: still waiting for process {holder.pid}'s build (") for m in messages)
    assert any("waiting for another process's build" in m and "kernel reused" in m for m in messages)


def test_a_heartbeat_speaks_every_few_seconds_only_while_its_block_runs():
    said = []
    with Heartbeat(said.append, every_s=0.05):
        time.sleep(0.32)
    count = len(said)
    assert 3 <= count <= 7 and said == sorted(said) and said[0] >= 0.05
    time.sleep(0.15)
    assert len(said) == count  # stopped with the block
    quiet = []
    with Heartbeat(quiet.append, every_s=5):
        pass
    assert quiet == []
