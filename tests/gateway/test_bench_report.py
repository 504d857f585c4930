"""`switchyard bench serve` end to end against stub servers: --compare order and ratio table,
the results file round trip, plots, and the one line without matplotlib."""
from __future__ import annotations

import socket
import sys

import pytest
from bench_stub import StubConfig, StubServer

from switchyard.gateway.bench.figures import RunResult
from switchyard.gateway.bench.report import comparison_table, read_results, throughput_matrix
from switchyard.gateway.cli import main

FAST = dict(first_delay_s=0.0, gap_s=0.0)


def _result(label: str, concurrency: int, tok_s: float) -> RunResult:
    return RunResult(label=label, url=f"http://{label}", model="m", concurrency=concurrency, output_len=4,
                     requests=8, errors=0, wall_s=1.0, output_tokens=32, output_tok_s=tok_s, request_s=8.0,
                     tokens_source="usage", ttft_ms={"p50": 12.5, "p90": 20.0, "p99": 150.0},
                     itl_ms={"p50": 1.0, "p90": 2.0, "p99": None})


def _row(table: str, label: str, concurrency: int) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:2] == [label, str(concurrency)]:
            return cells
    raise AssertionError(f"no row for {label} c={concurrency} in\n{table}")


def test_ratio_column_is_against_the_first_server_at_the_same_concurrency():
    results = [_result("ours", 1, 50.0), _result("ours", 8, 200.0), _result("peer", 1, 100.0), _result("peer", 8, 100.0)]
    table = comparison_table(results)
    assert "vs ours" in table.splitlines()[0]
    assert _row(table, "ours", 1)[3] == "1.00x" and _row(table, "peer", 1)[3] == "2.00x"
    assert _row(table, "peer", 8)[3] == "0.50x"
    assert _row(table, "peer", 8)[6:9] == ["12.5 / 20.0 / 150", "1.0 / 2.0 / -", "0/8"]
    rows = [line.split("|")[1].strip() + line.split("|")[2].strip() for line in table.splitlines()[2:]]
    assert rows == ["ours1", "peer1", "ours8", "peer8"]  # by concurrency, then server order
    assert "| peer | 100.0 | 100.0 |" in throughput_matrix(results)


def test_compare_runs_servers_one_after_another_and_writes_every_run(tmp_path, capsys):
    output = tmp_path / "runs.jsonl"
    with StubServer(StubConfig(first_delay_s=0.02, gap_s=0.01)) as slow, StubServer(StubConfig(**FAST)) as fast:
        rc = main(["bench", "serve", "--compare", f"slow={slow.url}", f"fast={fast.url}", "--concurrency", "2,1",
                   "--output-len", "4", "--num-prompts", "4", "--output", str(output)])
        slow_spans = [(r.start, r.end) for r in slow.received]
        fast_spans = [(r.start, r.end) for r in fast.received]
    assert rc == 0
    assert max(end for _, end in slow_spans) <= min(start for start, _ in fast_spans)  # never at once
    results = read_results([output])
    assert [(r.label, r.concurrency) for r in results] == [("slow", 1), ("slow", 2), ("fast", 1), ("fast", 2)]
    assert all(r.output_tokens == 16 and r.forced for r in results)
    table = capsys.readouterr().out
    for r in results:
        expected = r.output_tok_s / next(s.output_tok_s for s in results if s.label == "slow"
                                         and s.concurrency == r.concurrency)
        assert _row(table, r.label, r.concurrency)[3] == f"{expected:.2f}x"
    assert expected > 1  # the stub without delays is the faster one


def test_results_files_print_the_same_table_without_running(tmp_path, capsys):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with StubServer(StubConfig(**FAST)) as a, StubServer(StubConfig(**FAST)) as b:
        assert main(["bench", "serve", "--url", f"a={a.url}", "--concurrency", "1", "--output-len", "3",
                     "--output", str(first)]) == 0
        assert main(["bench", "serve", "--url", f"b={b.url}", "--concurrency", "1", "--output-len", "3",
                     "--output", str(second)]) == 0
    printed = capsys.readouterr().out
    measured = [line for line in printed.splitlines() if line.startswith(("| a |", "| b |"))]
    assert main(["bench", "serve", "--results", str(first), str(second)]) == 0
    table = capsys.readouterr().out
    assert _row(table, "a", 1)[:3] == [c.strip() for c in measured[0].strip("|").split("|")][:3]
    assert _row(table, "b", 1)[2] == [c.strip() for c in measured[1].strip("|").split("|")][2]
    assert read_results([first, second])[1].label == "b"
    (tmp_path / "bad.jsonl").write_text('{"label": "x"}\n')
    assert main(["bench", "serve", "--results", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1: not a bench result line (missing" in capsys.readouterr().err


def test_errors_and_an_unreachable_server_make_a_failing_exit(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    with StubServer(StubConfig(fail_every=2, **FAST)) as flaky:
        rc = main(["bench", "serve", "--compare", f"dead={dead}", f"flaky={flaky.url}", "--concurrency", "1",
                   "--output-len", "2", "--num-prompts", "4", "--warmup", "0"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "dead: cannot list the models" in captured.err  # skipped, the next one still runs
    assert _row(captured.out, "flaky", 1)[8] == "2/4"  # the errors column


def test_plot_writes_pngs_per_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = tmp_path / "r.jsonl"
    results.write_text("".join(line + "\n" for line in _results_lines()))
    assert main(["bench", "serve", "--results", str(results), "--plot", str(tmp_path / "plots")]) == 0
    for name in ("throughput", "ttft", "itl"):
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_plot_without_matplotlib_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    results = tmp_path / "r.jsonl"
    results.write_text("".join(line + "\n" for line in _results_lines()))
    assert main(["bench", "serve", "--results", str(results), "--plot", str(tmp_path / "plots")]) == 2
    captured = capsys.readouterr()
    assert captured.err == "switchyard: error: --plot needs matplotlib: pip install 'switchyard[bench]'\n"
    assert captured.out == "" and not (tmp_path / "plots").exists()


def _results_lines() -> list[str]:
    from switchyard.gateway.bench.report import to_json

    return [to_json(_result(label, c, tok_s)) for label, c, tok_s in
            (("ours", 1, 30.0), ("ours", 8, 180.0), ("peer", 1, 90.0), ("peer", 8, 170.0))]
