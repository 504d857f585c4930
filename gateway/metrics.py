"""Prometheus metrics: TGI's `tgi_*` names exactly as TGI exports them, plus ours.

A small text-format writer rather than prometheus_client: that library appends
`_total` to every counter, and TGI dashboards query `tgi_request_count`, not
`tgi_request_count_total`. Thread-safe: the engine thread records step metrics.
"""
from __future__ import annotations

import bisect
import threading

from switchyard.core.engine.client import EngineLoad, StepStats

_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                     60.0, 120.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, lock: threading.Lock):
        self.name = name
        self.help = help_text
        self._lock = lock

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help_text, lock):
        super().__init__(name, help_text, lock)
        self._values: dict[tuple, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        values = self._values or {(): 0.0}
        return self.header() + [f"{self.name}{_labels(k)} {_number(v)}" for k, v in sorted(values.items())]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[tuple(sorted(labels.items()))] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, lock, buckets):
        super().__init__(name, help_text, lock)
        self.buckets = tuple(buckets)
        self._counts: dict[tuple, list[int]] = {}
        self._sums: dict[tuple, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        return sum(self._counts.get(tuple(sorted(labels.items())), ()))

    def render(self) -> list[str]:
        lines = self.header()
        for key in sorted(self._counts):
            cumulative = 0
            for bound, n in zip(self.buckets + (float("inf"),), self._counts[key]):
                cumulative += n
                le = "+Inf" if bound == float("inf") else _number(bound)
                lines.append(f"{self.name}_bucket{_labels(key + (('le', le),))} {cumulative}")
            lines.append(f"{self.name}_sum{_labels(key)} {_number(self._sums[key])}")
            lines.append(f"{self.name}_count{_labels(key)} {cumulative}")
        return lines


class Metrics:
    """Every metric the gateway exports. One instance per app."""

    def __init__(self):
        self._lock = threading.Lock()
        self._all: list[_Metric] = []
        self._refreshers: list = []  # run before each render (register)
        self._block_size = 16  # KV tokens per block; the engine's, once it reports a step
        c, g, h = self._counter, self._gauge, self._histogram
        self.request_count = c("tgi_request_count", "requests received")
        self.request_success = c("tgi_request_success", "requests that finished successfully")
        self.request_failure = c("tgi_request_failure", "requests that failed, by error kind")
        self.queue_size = g("tgi_queue_size", "requests waiting for a batch slot")
        self.batch_current_size = g("tgi_batch_current_size", "requests in the running batch")
        self.batch_current_max_tokens = g("tgi_batch_current_max_tokens", "KV tokens held by the running batch")
        self.batch_max_total_tokens = g("tgi_batch_max_total_tokens", "KV capacity in tokens")
        self.batch_inference_count = c("tgi_batch_inference_count", "engine steps, by method")
        self.batch_inference_success = c("tgi_batch_inference_success", "engine steps that succeeded")
        self.batch_forward_duration = h("tgi_batch_forward_duration", "engine step time (s)", _DURATION_BUCKETS)
        self.batch_next_size = h("tgi_batch_next_size", "requests per engine step", _TOKEN_BUCKETS)
        self.request_duration = h("tgi_request_duration", "request end-to-end time (s)", _DURATION_BUCKETS)
        self.request_validation_duration = h("tgi_request_validation_duration", "validation time (s)",
                                             _DURATION_BUCKETS)
        self.request_queue_duration = h("tgi_request_queue_duration", "time queued (s)", _DURATION_BUCKETS)
        self.request_inference_duration = h("tgi_request_inference_duration", "time in the batch (s)",
                                            _DURATION_BUCKETS)
        self.request_mean_time_per_token_duration = h(
            "tgi_request_mean_time_per_token_duration", "mean time per generated token (s)", _DURATION_BUCKETS)
        self.request_input_length = h("tgi_request_input_length", "prompt tokens", _TOKEN_BUCKETS)
        self.request_max_new_tokens = h("tgi_request_max_new_tokens", "max new tokens asked", _TOKEN_BUCKETS)
        self.request_generated_tokens = h("tgi_request_generated_tokens", "generated tokens", _TOKEN_BUCKETS)
        self.time_to_first_token = h("switchyard_time_to_first_token_seconds", "time to first token (s)",
                                     _DURATION_BUCKETS)
        self.inter_token_latency = h("switchyard_inter_token_latency_seconds", "time between tokens (s)",
                                     _DURATION_BUCKETS)
        self.kv_cache_usage = g("switchyard_kv_cache_usage_ratio", "fraction of KV blocks in use")
        self.prompt_tokens = c("switchyard_prompt_tokens", "prompt tokens processed")
        self.generation_tokens = c("switchyard_generation_tokens", "tokens generated")
        self.requests_aborted = c("switchyard_requests_aborted", "requests aborted (client gone)")
        self.requests_in_flight = g("switchyard_requests_in_flight", "HTTP generation requests being served")
        self.prefix_cache_queried_tokens = c("switchyard_prefix_cache_queried_tokens",
                                             "prompt tokens looked up in the prefix cache")
        self.prefix_cache_hit_tokens = c("switchyard_prefix_cache_hit_tokens",
                                         "prompt tokens served from the prefix cache (not computed)")
        self.prefix_cache_hit_rate = g("switchyard_prefix_cache_hit_rate",
                                       "hit tokens / queried tokens since start")
        self.spec_proposed_tokens = c("switchyard_spec_proposed_tokens",
                                      "speculative tokens proposed and verified (--speculate)")
        self.spec_accepted_tokens = c("switchyard_spec_accepted_tokens",
                                      "speculative tokens accepted (generated without a step of their own)")
        self.spec_acceptance_rate = g("switchyard_spec_acceptance_rate",
                                      "accepted / proposed speculative tokens since start")

    def _counter(self, name, help_text) -> Counter:
        return self._add(Counter(name, help_text, self._lock))

    def _gauge(self, name, help_text) -> Gauge:
        return self._add(Gauge(name, help_text, self._lock))

    def _histogram(self, name, help_text, buckets) -> Histogram:
        return self._add(Histogram(name, help_text, self._lock, buckets))

    def _add(self, metric):
        self._all.append(metric)
        return metric

    def observe_step(self, stats: StepStats, block_size: int) -> None:
        """Called from the engine client's reader thread after every step."""
        method = "decode" if stats.num_prefill_tokens == 0 else "prefill"
        self.batch_inference_count.inc(method=method)
        self.batch_inference_success.inc(method=method)
        self.batch_forward_duration.observe(stats.duration_s, method=method)
        self.batch_next_size.observe(stats.load.num_running)
        self._block_size = block_size
        self.observe_load(stats.load)
        if stats.num_prefix_queried_tokens:
            self.prefix_cache_queried_tokens.inc(stats.num_prefix_queried_tokens)
            self.prefix_cache_hit_tokens.inc(stats.num_prefix_hit_tokens)
            self.prefix_cache_hit_rate.set(self.prefix_cache_hit_tokens.value()
                                           / self.prefix_cache_queried_tokens.value())
        if stats.num_spec_proposed_tokens:
            self.spec_proposed_tokens.inc(stats.num_spec_proposed_tokens)
            self.spec_accepted_tokens.inc(stats.num_spec_accepted_tokens)
            self.spec_acceptance_rate.set(self.spec_accepted_tokens.value() / self.spec_proposed_tokens.value())

    def observe_load(self, load: EngineLoad, block_size: int | None = None) -> None:
        """The load gauges: after each step, and from the engine's latest load at each
        scrape (the engine may be idle, with no step to report its aborts)."""
        block_size = block_size or self._block_size
        self.queue_size.set(load.num_waiting)
        self.batch_current_size.set(load.num_running)
        self.batch_current_max_tokens.set(load.num_kv_blocks_used * block_size)
        self.batch_max_total_tokens.set(load.num_kv_blocks_total * block_size)
        self.kv_cache_usage.set(load.num_kv_blocks_used / max(1, load.num_kv_blocks_total))

    def register(self, metrics: list[_Metric], refresh=None) -> None:
        """Export metrics kept elsewhere (gateway/replicas.py's per-replica series);
        `refresh()`, if given, brings them up to date before each render."""
        self._all.extend(metrics)
        if refresh is not None:
            self._refreshers.append(refresh)

    def render(self) -> str:
        for refresh in self._refreshers:
            refresh()
        with self._lock:
            lines = [line for metric in self._all for line in metric.render()]
        return "\n".join(lines) + "\n"
