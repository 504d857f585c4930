"""A GGUF conversion that is interrupted leaves no staging folder: an exception or
SIGTERM removes it at once, and the next start sweeps what a SIGKILL left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from switchyard.core.loader import gguf_cache


def _fake_gguf(tmp_path) -> str:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF not really")
    return str(path)


def _leftovers(cache_root) -> list[str]:
    folder = os.path.join(cache_root, "gguf")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_an_exception_during_conversion_leaves_no_staging_folder(tmp_path, monkeypatch):
    def failing(gguf_path, out_dir):
        open(os.path.join(out_dir, "model.safetensors"), "w").write("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_cache, "_convert", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        gguf_cache.converted_directory(_fake_gguf(tmp_path), str(tmp_path / "cache"))
    assert _leftovers(tmp_path / "cache") == []


def test_a_successful_conversion_is_renamed_into_place(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "_convert", lambda src, out: open(os.path.join(out, "config.json"), "w").close())
    target = gguf_cache.converted_directory(_fake_gguf(tmp_path), str(tmp_path / "cache"))
    assert _leftovers(tmp_path / "cache") == [os.path.basename(target)]
    assert os.path.isfile(os.path.join(target, "config.json"))


_SLOW_CONVERSION = textwrap.dedent("""
    import sys, time
    from switchyard.core.loader import gguf_cache

    def slow(gguf_path, out_dir):
        open(out_dir + "/model.safetensors", "w").write("partial")
        print("converting", flush=True)
        time.sleep(60)

    gguf_cache._convert = slow
    gguf_cache.converted_directory(sys.argv[1], sys.argv[2])
""")


def _start_slow_conversion(tmp_path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERSION, _fake_gguf(tmp_path), str(tmp_path / "cache")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "converting", proc.stderr.read()
    assert len(_leftovers(tmp_path / "cache")) == 1  # the staging folder, mid-conversion
    return proc


def test_sigterm_during_conversion_removes_the_staging_folder(tmp_path):
    proc = _start_slow_conversion(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert _leftovers(tmp_path / "cache") == []
    assert "Traceback" not in proc.stderr.read()


def test_the_next_start_sweeps_a_staging_folder_of_a_killed_process(tmp_path, monkeypatch):
    proc = _start_slow_conversion(tmp_path)
    proc.kill()  # SIGKILL: nothing runs in the process
    proc.wait(30)
    (stale,) = _leftovers(tmp_path / "cache")
    live = os.path.join(tmp_path / "cache", "gguf", f".other.staging-{os.getpid()}-abc")
    os.makedirs(live)  # a conversion of a live process (this one) is left alone
    time.sleep(0.01)
    monkeypatch.setattr(gguf_cache, "_convert", lambda src, out: None)
    target = gguf_cache.converted_directory(_fake_gguf(tmp_path), str(tmp_path / "cache"))
    assert stale not in _leftovers(tmp_path / "cache")
    assert sorted(_leftovers(tmp_path / "cache")) == sorted([os.path.basename(target), os.path.basename(live)])
