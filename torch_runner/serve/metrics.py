"""Prometheus metrics for `/metrics`.

Each app owns its registry (no process-global state, so tests can build several apps). Counters
and histograms are fed by the request handlers; the engine gauges (running, waiting, KV use) are
read from `AsyncEngine.stats()` at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "torch_runner"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# stats() key -> (metric name, help)
ENGINE_GAUGES = {
    "num_running": ("num_requests_running", "Requests being processed by the engine."),
    "num_waiting": ("num_requests_waiting", "Requests queued for admission."),
    "kv_usage": (
        "kv_cache_usage_ratio",
        "Fraction of the KV pool held by requests (0..1); evictable prefix-cache blocks apart.",
    ),
    "kv_used_tokens": ("kv_cache_used_tokens", "KV pool tokens held by queued/running requests."),
    "kv_cached_tokens": (
        "kv_cache_cached_tokens",
        "KV pool tokens held only by the prefix cache (evicted on demand, so reusable).",
    ),
    "kv_total_tokens": ("kv_cache_total_tokens", "KV pool capacity in tokens."),
}
# stats() key -> (counter name without _total, help): cumulative engine events
ENGINE_COUNTERS = {
    "num_preemptions": ("preemptions", "Requests preempted (KV freed, recomputed later)."),
    "num_non_finite_requests": (
        "non_finite_requests",
        "Requests ended because the model produced non-finite logits for them.",
    ),
}


class _EngineCollector:
    """Reads the engine's live stats at every scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self):
        stats = self._stats() or {}
        for key, (name, help_text) in ENGINE_GAUGES.items():
            if key in stats and stats[key] is not None:
                family = GaugeMetricFamily(f"{PREFIX}_{name}", help_text)
                family.add_metric([], float(stats[key]))
                yield family
        for key, (name, help_text) in ENGINE_COUNTERS.items():
            if stats.get(key) is not None:
                counter = CounterMetricFamily(f"{PREFIX}_{name}", help_text)
                counter.add_metric([], float(stats[key]))
                yield counter


class ServerMetrics:
    """Request, token and latency metrics of one server."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model"]
        self.requests = Counter(
            f"{PREFIX}_requests", "HTTP requests finished, by endpoint and status.",
            ["model", "endpoint", "status"], registry=self.registry,
        )  # fmt: skip
        self.finished = Counter(
            f"{PREFIX}_request_finished", "Generation choices finished, by finish reason.",
            ["model", "finish_reason"], registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry
        )
        self.cached_prompt_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", labels,
            registry=self.registry,
        )  # fmt: skip
        self.aborted = Counter(
            f"{PREFIX}_aborted_requests", "Generation choices ended early, by reason.",
            ["model", "reason"], registry=self.registry,
        )  # fmt: skip
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated.", labels, registry=self.registry
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time from request arrival to the first token.",
            labels, buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Time between consecutive output tokens.",
            labels, buckets=TPOT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Time from request arrival to its last token.",
            labels, buckets=E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineCollector(stats))

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model_name, endpoint, str(status)).inc()

    def observe_choice(self, tracker: ChoiceTracker) -> None:
        """Record one finished choice (one engine request)."""
        model = self.model_name
        self.generation_tokens.labels(model).inc(tracker.num_tokens)
        if tracker.first_token_at is not None:
            self.time_to_first_token.labels(model).observe(
                tracker.first_token_at - tracker.arrived_at
            )
        for gap in tracker.token_gaps:
            self.time_per_output_token.labels(model).observe(gap)
        if tracker.last_token_at is not None:
            self.e2e_latency.labels(model).observe(tracker.last_token_at - tracker.arrived_at)
        self.finished.labels(model, tracker.finish_reason or "abort").inc()
        if tracker.abort_reason is not None:
            self.aborted.labels(model, tracker.abort_reason).inc()

    def observe_prompt(self, num_tokens: int, num_cached: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)
        self.cached_prompt_tokens.labels(self.model_name).inc(num_cached)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ChoiceTracker:
    """Per-choice timing: arrival, first token, gaps between token arrivals."""

    def __init__(self, arrived_at: float):
        self.arrived_at = arrived_at
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_gaps: list[float] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None
        # why it ended early: client_disconnected, server_shutdown, non_finite_logits, ...
        self.abort_reason: str | None = None

    def on_tokens(self, now: float, num_new: int) -> None:
        if num_new <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None:
            # Several tokens in one increment share the gap (one step may yield more than one).
            gap = (now - self.last_token_at) / num_new
            self.token_gaps.extend([gap] * num_new)
        self.last_token_at = now
        self.num_tokens += num_new
