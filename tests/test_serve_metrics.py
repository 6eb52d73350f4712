"""/metrics contract: Prometheus text that parses, live engine gauges, token and latency series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from torch_runner.serve.metrics import ChoiceTracker, ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    families = text_string_to_metric_families(metrics.render().decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_engine_gauges_are_read_at_scrape_time():
    stats = {
        "num_running": 3,
        "num_waiting": 1,
        "kv_used_tokens": 48,
        "kv_total_tokens": 64,
        "kv_usage": 0.75,
    }
    metrics = ServerMetrics(lambda: stats, "m")
    first = _samples(metrics)
    assert first[("torch_runner_num_requests_running", ())] == 3
    assert first[("torch_runner_kv_cache_usage_ratio", ())] == 0.75
    stats.update(num_running=0, kv_used_tokens=0, kv_usage=0.0)
    second = _samples(metrics)
    assert second[("torch_runner_num_requests_running", ())] == 0
    assert second[("torch_runner_kv_cache_used_tokens", ())] == 0
    assert second[("torch_runner_kv_cache_total_tokens", ())] == 64


def test_choice_feeds_tokens_ttft_and_inter_token_histograms():
    metrics = ServerMetrics(dict, "m")
    tracker = ChoiceTracker(arrived_at=10.0)
    tracker.on_tokens(10.5, 1)  # first token after 0.5 s
    tracker.on_tokens(10.6, 1)  # gap 0.1 s
    tracker.on_tokens(10.8, 2)  # two tokens in one step: 0.1 s each
    tracker.finish_reason = "length"
    metrics.observe_choice(tracker)
    metrics.observe_prompt(num_tokens=7, num_cached=4)
    metrics.observe_request("/v1/completions", 200)
    samples = _samples(metrics)
    model = (("model", "m"),)
    assert samples[("torch_runner_generation_tokens_total", model)] == 4
    assert samples[("torch_runner_prompt_tokens_total", model)] == 7
    assert samples[("torch_runner_cached_prompt_tokens_total", model)] == 4
    assert samples[("torch_runner_time_to_first_token_seconds_count", model)] == 1
    assert abs(samples[("torch_runner_time_to_first_token_seconds_sum", model)] - 0.5) < 1e-9
    assert samples[("torch_runner_time_per_output_token_seconds_count", model)] == 3
    assert abs(samples[("torch_runner_time_per_output_token_seconds_sum", model)] - 0.3) < 1e-9
    assert abs(samples[("torch_runner_e2e_request_latency_seconds_sum", model)] - 0.8) < 1e-9
    assert (
        samples[
            ("torch_runner_request_finished_total", (("finish_reason", "length"), ("model", "m")))
        ]
        == 1
    )
    key = (("endpoint", "/v1/completions"), ("model", "m"), ("status", "200"))
    assert samples[("torch_runner_requests_total", key)] == 1


def test_each_server_has_its_own_registry():
    first, second = ServerMetrics(dict, "a"), ServerMetrics(dict, "b")
    first.observe_prompt(5, 0)
    assert all(dict(labels).get("model") != "a" for _, labels in _samples(second))
    assert _samples(first)[("torch_runner_prompt_tokens_total", (("model", "a"),))] == 5
