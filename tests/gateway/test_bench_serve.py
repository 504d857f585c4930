"""`switchyard bench serve` against a real server of the default model (the gateway tests'
shared server: the app `switchyard serve` runs, on a free port)."""
from __future__ import annotations

import pytest

from switchyard.gateway.bench.report import read_results
from switchyard.gateway.cli import main


@pytest.mark.slow
def test_bench_against_the_default_model_forces_the_output_length(server, tmp_path, capsys):
    output = tmp_path / "ours.jsonl"
    rc = main(["bench", "serve", "--url", f"switchyard={server.base_url}", "--concurrency", "1,2",
               "--output-len", "4", "--num-prompts", "2", "--warmup", "1", "--output", str(output)])
    assert rc == 0
    results = read_results([output])
    assert [r.concurrency for r in results] == [1, 2]
    for result in results:
        assert result.model == "HuggingFaceTB/SmolLM2-135M-Instruct"  # taken from /v1/models
        assert result.errors == 0 and result.tokens_source == "usage"
        assert result.output_tokens == 2 * 4  # ignore_eos and min_tokens honoured: every request ran to 4
        assert result.output_tok_s > 0 and result.ttft_ms["p50"] > 0 and result.itl_ms["p50"] > 0
    assert "| switchyard | 2 |" in capsys.readouterr().out
    server.wait_idle()
