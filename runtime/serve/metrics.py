"""The server's Prometheus metrics, in vLLM's names and buckets.

:class:`ServerMetrics` counts what only the server sees (tokens streamed, requests finished and
why, their latencies in a :class:`Histogram` each); the engine's gauges and counters are read
from its ``EngineStats`` at scrape time, so nothing is counted twice. ``render`` writes
Prometheus text format 0.0.4 with vLLM's metric names and bucket bounds, so a dashboard built for
vLLM reads ``GET /metrics`` unchanged. Request threads update the counts under one lock; a
scrape reads them under the same lock.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.engine.metrics import EngineStats, RequestMetrics

# vLLM's buckets, so that a vLLM dashboard's quantiles mean the same here.
# fmt: off
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on


class Histogram:
    """Observation counts per upper bound (``le``), plus their sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class ServerMetrics:
    """What the server counts itself; the engine's gauges and counters are read at scrape time.

    Prompt tokens count when a request is admitted and generated tokens as they stream, so the
    counters move during long replies; the latency histograms take a request's engine metrics
    when it finishes. A request the client abandoned counts as ``finished_reason="abort"``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.request_success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.inter_token = Histogram(ITL_BUCKETS_S)
        self.e2e = Histogram(REQUEST_BUCKETS_S)
        self.queue = Histogram(REQUEST_BUCKETS_S)

    def count_prompt(self, num_tokens: int) -> None:
        with self._lock:
            self.num_prompt_tokens += num_tokens

    def count_generated(self, num_tokens: int) -> None:
        with self._lock:
            self.num_generation_tokens += num_tokens

    def finish(self, reason: str, metrics: RequestMetrics | None, e2e_s: float) -> None:
        with self._lock:
            self.request_success[reason] = self.request_success.get(reason, 0) + 1
            self.e2e.observe(e2e_s)
            if metrics is not None:
                self.ttft.observe(metrics.ttft_ms / 1000)
                self.queue.observe(metrics.queue_ms / 1000)
                for ms in metrics.inter_token_ms:
                    self.inter_token.observe(ms / 1000)

    def render(self, stats: EngineStats, model_name: str) -> str:
        """Prometheus text format 0.0.4, named as vLLM names the same quantities."""
        out = _Exposition({"model_name": model_name})
        out.gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running
        )
        out.gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting
        )
        out.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)
        out.counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_queried_tokens,
        )
        out.counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_hit_tokens,
        )
        out.counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.num_preemptions
        )
        # Speculative decoding, as vLLM's SpecDecodingProm names it (0 while nothing speculates).
        out.counter(
            "vllm:spec_decode_num_drafts",
            "Number of spec decoding drafts.",
            stats.spec_num_drafts,
        )
        out.counter(
            "vllm:spec_decode_num_draft_tokens",
            "Number of draft tokens.",
            stats.spec_num_draft_tokens,
        )
        out.counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            stats.spec_num_accepted_tokens,
        )
        out.gauge(
            "liubai:kv_cache_bytes_in_use",
            "Bytes of the KV blocks live requests hold.",
            stats.kv_bytes_in_use,
        )
        out.gauge("liubai:kv_cache_pool_bytes", "Bytes of the whole KV pool.", stats.kv_pool_bytes)
        out.info(
            "liubai:weights",
            "How the model's weights are stored, as the format label.",
            "format",
            stats.weight_format,
        )
        out.gauge(
            "liubai:decode_compiled",
            "1 while decode steps run through compiled graphs, 0 when eager.",
            int(stats.compiled),
        )
        if stats.kv_disk_limit_bytes:
            out.gauge(
                "liubai:kv_disk_blocks", "Block files in the prefix cache's disk tier.", stats.kv_disk_blocks
            )
            out.gauge("liubai:kv_disk_bytes", "Bytes of the disk tier's block files.", stats.kv_disk_bytes)
            out.gauge("liubai:kv_disk_limit_bytes", "The disk tier's size limit.", stats.kv_disk_limit_bytes)
            out.counter(
                "liubai:kv_disk_hits",
                "Prefix cache hits served from the disk tier, in tokens.",
                stats.kv_disk_hit_tokens,
            )
            out.counter(
                "liubai:kv_disk_evictions",
                "Block files evicted by the size limit.",
                stats.kv_disk_evicted_blocks,
            )
        with self._lock:
            out.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.num_prompt_tokens)
            out.counter(
                "vllm:generation_tokens", "Number of generation tokens processed.", self.num_generation_tokens
            )
            out.counter_by(
                "vllm:request_success",
                "Count of successfully processed requests.",
                "finished_reason",
                self.request_success,
            )
            out.histogram(
                "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft
            )
            out.histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                self.inter_token,
            )
            out.histogram(
                "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e
            )
            out.histogram(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                self.queue,
            )
        return out.text()


class _Exposition:
    """Prometheus text lines: ``# HELP`` and ``# TYPE`` before each family's samples; counters get
    their ``_total`` suffix in both, as vLLM's exporter writes them."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.lines: list[str] = []

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self._family(name, "gauge", help_text)
        self._sample(name, value)

    def info(self, name: str, help_text: str, label: str, value: str) -> None:
        """A constant 1 carrying ``value`` as a label: Prometheus' way to expose a name."""
        self._family(f"{name}_info", "gauge", help_text)
        self._sample(f"{name}_info", 1, {label: value})

    def counter(self, name: str, help_text: str, value: float) -> None:
        self._family(f"{name}_total", "counter", help_text)
        self._sample(f"{name}_total", value)

    def counter_by(self, name: str, help_text: str, label: str, values: dict[str, int]) -> None:
        self._family(f"{name}_total", "counter", help_text)
        for label_value, value in values.items():
            self._sample(f"{name}_total", value, {label: label_value})

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        self._family(name, "histogram", help_text)
        cumulative = 0
        for bound, count in zip((*hist.bounds, math.inf), hist.counts, strict=True):
            cumulative += count
            self._sample(f"{name}_bucket", cumulative, {"le": _format_number(float(bound))})
        self._sample(f"{name}_sum", hist.sum)
        self._sample(f"{name}_count", hist.count)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def _family(self, name: str, kind: str, help_text: str) -> None:
        escaped = help_text.replace("\\", "\\\\").replace("\n", "\\n")
        self.lines += [f"# HELP {name} {escaped}", f"# TYPE {name} {kind}"]

    def _sample(self, name: str, value: float, extra: dict[str, str] | None = None) -> None:
        labels = {**self.labels, **(extra or {})}
        body = ",".join(f'{key}="{_escape_label(text)}"' for key, text in labels.items())
        self.lines.append(f"{name}{{{body}}} {_format_number(value)}")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _format_number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(value)
