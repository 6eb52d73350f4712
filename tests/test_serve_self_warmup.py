"""The start-up warm-up request (serve/self_warmup.py): it reaches both routes through the real
app, is counted in /metrics, and leaves the engine's sampling stream where it was: an unseeded
sampled request afterwards gets the tokens a server that never warmed up gives it."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_fixtures import API_KEY, MODEL_NAME, ThreadedServer, save_serve_checkpoint

from torch_runner.serve.app import create_app
from torch_runner.serve.self_warmup import warm_up_routes, warm_up_server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_serve_checkpoint(tmp_path_factory.mktemp("self_warmup") / "tiny")[0]


def _unseeded_sample(server: ThreadedServer) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 12, "temperature": 1.0,
            "ignore_eos": True, "logprobs": 1}  # fmt: skip
    answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["tokens"]


def _requests_total(server: ThreadedServer) -> dict[str, float]:
    text = server.state.metrics.render().decode()
    return {
        s.labels["endpoint"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "torch_runner_requests_total" and s.labels.get("status") == "200"
    }


def test_warm_up_reaches_both_routes_and_leaves_unseeded_sampling_alone(checkpoint):
    cold = ThreadedServer(checkpoint)
    try:
        want = _unseeded_sample(cold)
    finally:
        cold.stop()
    warm = ThreadedServer(checkpoint)
    try:
        statuses = warm_up_routes(create_app(warm.state), MODEL_NAME, API_KEY)
        assert statuses == {"/v1/chat/completions": 200, "/v1/completions": 200}
        counted = _requests_total(warm)
        assert counted.get("/v1/chat/completions") == 1 and counted.get("/v1/completions") == 1
        assert _unseeded_sample(warm) == want
    finally:
        warm.stop()


def test_a_failing_warm_up_is_logged_and_does_not_raise(checkpoint, caplog):
    server = ThreadedServer(checkpoint)
    try:  # a wrong key: both routes answer 401, the server must still come up
        warm_up_server(create_app(server.state), MODEL_NAME, api_key="not-the-key")
    finally:
        server.stop()
    assert "start-up warm-up" in caplog.text and "401" in caplog.text
