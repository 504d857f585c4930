"""One run's figures: a server at one concurrency, summed over its records.

Throughput is output tokens (of the requests that succeeded) over the run's wall time;
TTFT is per request, ITL per gap between text chunks, both pooled over the run's requests.
Percentiles interpolate linearly between the two nearest ranks."""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .loadgen import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms_percentiles(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": None if (v := percentile(values, q)) is None else round(v * 1000.0, 3) for q in PERCENTILES}


@dataclass(frozen=True)
class RunResult:
    """A server at one concurrency: what was asked, what came back, the figures (a line of
    the results file; the field names are the file's format)."""

    label: str
    url: str
    model: str
    concurrency: int
    output_len: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    request_s: float
    tokens_source: str
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    itl_ms: dict[str, float | None] = field(default_factory=dict)
    first_error: str = ""
    time: str = ""
    # the server's peak RSS so far, read after the run (memory.py); None where it was not found
    peak_rss_bytes: int | None = None

    @property
    def forced(self) -> bool:
        """Whether every successful request produced exactly `output_len` tokens."""
        completed = self.requests - self.errors
        return completed > 0 and self.output_tokens == completed * self.output_len


def summarize(label: str, url: str, model: str, concurrency: int, output_len: int,
              records: Sequence[RequestRecord], wall_s: float, peak_rss_bytes: int | None = None) -> RunResult:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    sources = sorted({r.tokens_source for r in ok})
    return RunResult(
        label=label, url=url, model=model, concurrency=concurrency, output_len=output_len,
        requests=len(records), errors=len(failed), wall_s=round(wall_s, 4), output_tokens=tokens,
        output_tok_s=round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        request_s=round(len(ok) / wall_s, 4) if wall_s > 0 else 0.0,
        tokens_source=",".join(sources) or "none",
        ttft_ms=_ms_percentiles(ttfts), itl_ms=_ms_percentiles(itls),
        first_error=failed[0].error if failed else "",
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), peak_rss_bytes=peak_rss_bytes)
