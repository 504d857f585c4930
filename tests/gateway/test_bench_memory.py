"""`switchyard bench serve` reports each local server's peak RSS: VmHWM summed over the
process that listens on the URL's port and every process below it (gateway/bench/memory.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from bench_stub import StubConfig, StubServer

from switchyard.gateway.bench.figures import RunResult
from switchyard.gateway.bench.memory import ServerMemory, local_port, process_tree
from switchyard.gateway.bench.report import comparison_table, from_json, read_results, run_line
from switchyard.gateway.cli import main

MB = 10**6

# A "server": listens on a free port, holds 200 MB, and starts a child that holds 100 MB.
_SERVER = textwrap.dedent("""
    import socket, subprocess, sys, time
    held = bytearray(200 * 10**6)
    child = subprocess.Popen([sys.executable, "-c",
        "import sys, time; held = bytearray(100 * 10**6); print('child', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    print(listener.getsockname()[1], child.pid, flush=True)
    time.sleep(120)
""")


@pytest.fixture
def fat_server():
    process = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        port, child = (int(v) for v in process.stdout.readline().split())
        yield process.pid, child, f"http://127.0.0.1:{port}"
    finally:
        import os
        import signal

        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def test_the_server_behind_a_url_and_its_children_are_measured(fat_server):
    pid, child, url = fat_server
    memory = ServerMemory.find(url)
    assert memory.root == pid and child in process_tree(pid)
    peak = memory.peak_rss_bytes()
    assert 300 * MB < peak < 600 * MB  # both processes' 200 + 100 MB, plus two interpreters


def test_a_server_on_another_machine_has_no_figure():
    assert local_port("http://192.0.2.7:8080") is None  # TEST-NET-1: never this machine's
    assert ServerMemory.find("http://192.0.2.7:8080").peak_rss_bytes() is None
    assert local_port("http://127.0.0.1:8080") == 8080 and local_port("http://localhost") == 80


def test_the_table_the_line_and_the_results_file_carry_peak_rss(tmp_path, capsys):
    output = tmp_path / "runs.jsonl"
    with StubServer(StubConfig(first_delay_s=0.0, gap_s=0.0)) as stub:  # in this process: measures pytest
        rc = main(["bench", "serve", "--url", f"stub={stub.url}", "--concurrency", "1", "--output-len", "2",
                   "--num-prompts", "2", "--output", str(output)])
    assert rc == 0
    [result] = read_results([output])
    assert result.peak_rss_bytes is not None and result.peak_rss_bytes > 50 * MB
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| server |"))
    assert header.endswith("| errors | peak RSS GB |")
    assert f"| {result.peak_rss_bytes / 1e9:.2f} |" in out
    assert f"peak RSS {result.peak_rss_bytes / 1e9:.2f} GB" in out


def test_results_without_the_figure_still_read_and_show_a_dash():
    line = json.dumps(dict(label="old", url="http://x", model="m", concurrency=1, output_len=4, requests=1,
                           errors=0, wall_s=1.0, output_tokens=4, output_tok_s=4.0, request_s=1.0,
                           tokens_source="usage"))
    result = from_json(line)
    assert result.peak_rss_bytes is None
    assert comparison_table([result]).splitlines()[-1].endswith("| 0/1 | - |")
    assert "peak RSS - GB" in run_line(result)
    assert RunResult(**{**json.loads(line), "peak_rss_bytes": 123}).peak_rss_bytes == 123
