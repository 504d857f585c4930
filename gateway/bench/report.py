"""Tables and the results file.

The results file is JSON lines, one RunResult per line (`--output` writes it as the runs
finish, `--results` reads one or more back). Tables are Markdown, so that a terminal shows
them aligned enough and the README takes them as they are. Servers keep the order in which
they first appear; the first one is the baseline of the ratio column."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from .figures import PERCENTILES, RunResult

_FIELDS = {f.name for f in dataclasses.fields(RunResult)}


def to_json(result: RunResult) -> str:
    return json.dumps(dataclasses.asdict(result), sort_keys=True)


def from_json(line: str) -> RunResult:
    data = json.loads(line)
    missing = {f.name for f in dataclasses.fields(RunResult) if f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING} - data.keys()
    if missing:
        raise ValueError(f"not a bench result line (missing {', '.join(sorted(missing))})")
    return RunResult(**{k: v for k, v in data.items() if k in _FIELDS})


def read_results(paths: Iterable[str | Path]) -> list[RunResult]:
    """Every result of the files, in file order."""
    results = []
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                try:
                    results.append(from_json(line))
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from None
    return results


def labels_in_order(results: Sequence[RunResult]) -> list[str]:
    return list(dict.fromkeys(r.label for r in results))


def _ms(values: dict) -> str:
    def one(v):
        return "-" if v is None else (f"{v:.1f}" if v < 100 else f"{v:.0f}")
    return " / ".join(one(values.get(f"p{q}")) for q in PERCENTILES)


def comparison_table(results: Sequence[RunResult]) -> str:
    """One row per server and concurrency, by concurrency then server; the ratio column is
    output tok/s over the first server's at the same concurrency; peak RSS is the server's so
    far (memory.py), "-" where it was not found."""
    labels = labels_in_order(results)
    if not labels:
        return "(no results)"
    baseline = {r.concurrency: r.output_tok_s for r in results if r.label == labels[0]}
    pct = "/".join(f"p{q}" for q in PERCENTILES)
    lines = [f"| server | c | output tok/s | vs {labels[0]} | req/s | tok/req | TTFT {pct} ms | ITL {pct} ms | errors "
             "| peak RSS GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for result in sorted(results, key=lambda r: (r.concurrency, labels.index(r.label))):
        base = baseline.get(result.concurrency)
        ratio = f"{result.output_tok_s / base:.2f}x" if base else "-"
        completed = result.requests - result.errors
        per_request = f"{result.output_tokens / completed:.1f}" if completed else "-"
        lines.append(f"| {result.label} | {result.concurrency} | {result.output_tok_s:.1f} | {ratio} | "
                     f"{result.request_s:.2f} | {per_request} | {_ms(result.ttft_ms)} | {_ms(result.itl_ms)} | "
                     f"{result.errors}/{result.requests} | {_gb(result.peak_rss_bytes)} |")
    return "\n".join(lines)


def throughput_matrix(results: Sequence[RunResult]) -> str:
    """Output tok/s, a row per server and a column per concurrency (the issue's table)."""
    labels = labels_in_order(results)
    concurrencies = sorted({r.concurrency for r in results})
    cell = {(r.label, r.concurrency): r.output_tok_s for r in results}
    lines = ["| output tok/s | " + " | ".join(f"c={c}" for c in concurrencies) + " |",
             "|---|" + "---|" * len(concurrencies)]
    for label in labels:
        values = (f"{cell[label, c]:.1f}" if (label, c) in cell else "" for c in concurrencies)
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def run_line(result: RunResult) -> str:
    """One finished run, as printed while the benchmark goes on."""
    errors = f", {result.errors} errors (first: {result.first_error})" if result.errors else ""
    return (f"{result.label} c={result.concurrency}: {result.output_tok_s:.1f} output tok/s, "
            f"{result.request_s:.2f} req/s, TTFT p50 {_fmt(result.ttft_ms.get('p50'))} ms, "
            f"ITL p50 {_fmt(result.itl_ms.get('p50'))} ms, peak RSS {_gb(result.peak_rss_bytes)} GB, "
            f"tokens from {result.tokens_source}{errors}")


def _gb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
