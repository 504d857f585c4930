"""`switchyard bench serve`'s load generator and figures, against a stub streaming server."""
from __future__ import annotations

import asyncio
import io
import subprocess
import sys

import pytest
from bench_stub import StubConfig, StubServer

from switchyard.gateway.bench.command import CHAT_PATH, BenchError, bench_server
from switchyard.gateway.bench.figures import percentile, summarize
from switchyard.gateway.bench.loadgen import RequestRecord, drive, make_client
from switchyard.gateway.bench.progress import Progress
from switchyard.gateway.bench.workload import PROMPTS, Server, Workload, chat_bodies

FAST = dict(first_delay_s=0.0, gap_s=0.0)


def _bench(stub: StubServer, **workload) -> list:
    results = []
    server = Server("stub", stub.url)
    asyncio.run(bench_server(server, Workload(**workload), None, results.append))
    return results


def test_percentiles_interpolate_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(v) for v in range(1, 101)], 90) == pytest.approx(90.1)


def test_ttft_itl_and_tokens_from_the_records():
    records = [
        RequestRecord(start=10.0, end=10.5, chunk_times=(10.1, 10.2, 10.4), usage_tokens=6),
        RequestRecord(start=11.0, end=11.4, chunk_times=(11.3, 11.35)),  # no usage: counted chunks
        RequestRecord(start=12.0, end=12.1, error="HTTP 500: boom"),
    ]
    result = summarize("s", "http://x", "m", 2, 6, records, wall_s=2.0)
    assert (result.requests, result.errors, result.first_error) == (3, 1, "HTTP 500: boom")
    assert result.output_tokens == 6 + 2 and result.output_tok_s == 4.0 and result.request_s == 1.0
    assert result.tokens_source == "chunks,usage"
    assert result.ttft_ms["p50"] == pytest.approx(200.0)  # TTFTs 100 and 300 ms
    assert result.ttft_ms["p99"] == pytest.approx(298.0)
    assert result.itl_ms["p50"] == pytest.approx(100.0)  # gaps 100, 200 and 50 ms
    assert result.itl_ms["p90"] == pytest.approx(180.0)
    assert not result.forced


@pytest.mark.parametrize("send_usage", [True, False])
def test_tokens_counted_from_usage_else_from_chunks(send_usage):
    # two tokens per chunk: usage says 8, the chunks count 4
    with StubServer(StubConfig(tokens_per_chunk=2, send_usage=send_usage, **FAST)) as stub:
        (result,) = _bench(stub, concurrencies=(2,), output_len=8, num_prompts=4, warmup=0)
    assert result.tokens_source == ("usage" if send_usage else "chunks")
    assert result.output_tokens == (4 * 8 if send_usage else 4 * 4)
    assert result.forced == send_usage


def test_ttft_and_itl_follow_the_servers_chunk_timing():
    config = StubConfig(first_delay_s=0.15, gap_s=0.05)
    with StubServer(config) as stub:
        (result,) = _bench(stub, concurrencies=(1,), output_len=5, num_prompts=3, warmup=0)
    # lower bounds are exact (the server sleeps that long); upper bounds leave room for a busy machine
    assert 150 <= result.ttft_ms["p50"] < 150 + 120
    assert 50 <= result.itl_ms["p50"] < 50 + 40
    assert result.output_tokens == 15 and result.forced and result.errors == 0


def test_requests_force_the_length_resolve_the_model_and_repeat_the_same_prompts():
    with StubServer(StubConfig(model="served-name", **FAST)) as stub:
        first = _bench(stub, concurrencies=(1, 3), output_len=4, warmup=2)
        sent = [r.body for r in stub.received]
    assert [r.requests for r in first] == [8, 12]  # default: 4 x concurrency, at least 8
    assert len(sent) == 2 + 8 + 12  # the warm-up is sent but not counted
    measured = sent[2:]
    for body in measured:
        assert body["model"] == "served-name" and body["stream"] is True
        assert body["max_tokens"] == body["min_tokens"] == 4 and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    prompts = [body["messages"][0]["content"] for body in measured]
    assert sorted(prompts[:8]) == sorted(PROMPTS[:8])
    assert sorted(prompts[8:]) == sorted(PROMPTS[:12])
    assert [b["messages"] for b in chat_bodies("m", 12, 4)] == [b["messages"] for b in chat_bodies("m", 12, 4)]


def test_errors_are_counted_and_add_no_tokens():
    with StubServer(StubConfig(fail_every=3, **FAST)) as stub:
        (result,) = _bench(stub, concurrencies=(2,), output_len=4, num_prompts=9, warmup=0)
    assert (result.requests, result.errors) == (9, 3)
    assert result.output_tokens == 6 * 4
    assert result.first_error.startswith("HTTP 500")


def test_warm_up_waits_while_the_server_is_loading(monkeypatch):
    monkeypatch.setattr("switchyard.gateway.bench.command.LOADING_POLL_S", 0.01)
    with StubServer(StubConfig(loading_for=5, **FAST)) as stub:
        (result,) = _bench(stub, concurrencies=(1,), output_len=2, num_prompts=3, warmup=2)
        statuses = [r.status for r in stub.received]
    assert statuses[:4] == [503] * 4 and statuses[-3:] == [200] * 3
    assert (result.requests, result.errors) == (3, 0)


def test_warm_up_failing_otherwise_stops_the_server():
    with StubServer(StubConfig(fail_every=1, **FAST)) as stub:
        with pytest.raises(BenchError, match="every warm-up request failed: HTTP 500"):
            _bench(stub, concurrencies=(1,), output_len=2, warmup=2)
        assert len(stub.received) == 2


def test_concurrency_caps_the_requests_in_flight():
    with StubServer(StubConfig(first_delay_s=0.05, gap_s=0.01)) as stub:
        async def go():
            async with make_client(stub.url, 3, 30) as client:
                return await drive(client, CHAT_PATH, chat_bodies("m", 9, 3), 3)
        records, wall = asyncio.run(go())
        spans = [(r.start, r.end) for r in stub.received]
    assert len(records) == 9 and all(r.ok for r in records)
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most == 3


def test_progress_is_a_plain_line_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    out = io.StringIO()
    progress = Progress("stub c=2", 3, stream=out)
    progress.advance()
    progress.advance(ok=False)
    progress.close()
    assert not progress.uses_tqdm
    assert "\rstub c=2: 2/3 requests, 1 errors" in out.getvalue() and out.getvalue().endswith("\n")


def test_the_bench_client_imports_no_torch():
    code = ("import sys; import switchyard.gateway.bench.command, switchyard.gateway.bench.plot; "
            "from switchyard.gateway.cli import build_parser; "
            "build_parser({}).parse_args(['bench', 'serve', '--compare', 'http://a:1', 'b=http://b:2']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_server_specs_take_a_label_or_name_themselves_by_address():
    assert Server.parse("vllm=http://127.0.0.1:8102/v1/") == Server("vllm", "http://127.0.0.1:8102")
    assert Server.parse("http://127.0.0.1:8080") == Server("127.0.0.1:8080", "http://127.0.0.1:8080")
    with pytest.raises(ValueError, match="not an http"):
        Server.parse("ours=127.0.0.1:8080")
