"""Errors and limits over real HTTP: status, OpenAI error JSON with `param`, never a 500.

The server here (uvicorn on a socket, in a thread of this process) runs one sequence at a time
with a one-slot waiting queue (so over-capacity is reachable), a small body limit, and the prefix
cache off, so a request's KV blocks are exactly what /metrics reports in use: after a client
disconnects that figure must fall back to zero.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_fixtures import (
    API_KEY,
    MAX_POSITIONS,
    MODEL_NAME,
    ThreadedServer,
    metric_values,
    save_serve_checkpoint,
    wait_for_metrics,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_LIMIT = 16384
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4}
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("serve_errors") / "tiny")
    threaded = ThreadedServer(
        path,
        max_body_bytes=BODY_LIMIT,
        max_num_seqs=1,
        max_waiting=1,
        enable_prefix_caching=False,
        max_total_tokens=4096,
    )
    yield threaded
    threaded.stop()


def _post(server, path: str, body, headers=AUTH) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, str | bytes) else {"json": body}
    return httpx.post(
        f"{server.base_url}{path}",
        headers={**headers, "Content-Type": "application/json"},
        timeout=60,
        **kwargs,
    )


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


INVALID = [
    ("/v1/chat/completions", CHAT | {"temperature": 5}, "temperature"),
    ("/v1/chat/completions", CHAT | {"top_p": 0}, "top_p"),
    ("/v1/chat/completions", CHAT | {"n": 0}, "n"),
    ("/v1/chat/completions", CHAT | {"top_k": 0}, "top_k"),
    ("/v1/chat/completions", CHAT | {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", CHAT | {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", CHAT | {"seed": -1}, "seed"),
    ("/v1/chat/completions", CHAT | {"stop": [""]}, "stop"),
    ("/v1/chat/completions", CHAT | {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", CHAT | {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", CHAT | {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", CHAT | {"min_tokens": 9}, "min_tokens"),
    (
        "/v1/chat/completions",
        CHAT | {"response_format": {"type": "yaml"}},
        "response_format.type",
    ),
    (
        "/v1/chat/completions",
        CHAT | {"tools": [{"type": "function", "function": {"name": "f g"}}]},
        "tools.0.function.name",
    ),
    ("/v1/chat/completions", CHAT | {"frobnicate": True}, "frobnicate"),
    ("/v1/chat/completions", {"model": MODEL_NAME}, "messages"),
    ("/v1/chat/completions", CHAT | {"messages": []}, "messages"),
    (
        "/v1/chat/completions",
        CHAT | {"messages": [{"role": "robot", "content": "x"}]},
        "messages.0.role",
    ),
    ("/v1/completions", COMPLETION | {"logprobs": 21}, "logprobs"),
    ("/v1/completions", COMPLETION | {"prompt": [1, 2, 300]}, "prompt"),
    ("/v1/completions", COMPLETION | {"prompt": []}, "prompt"),
    ("/v1/completions", COMPLETION | {"prompt": ""}, "prompt"),
    ("/v1/completions", COMPLETION | {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", COMPLETION | {"suffix": "x"}, "suffix"),
    ("/v1/completions", COMPLETION | {"best_of": 3}, "best_of"),
    ("/v1/completions", {"model": MODEL_NAME}, "prompt"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), INVALID, ids=[f"{p.rsplit('/', 1)[1]}-{n}" for p, _, n in INVALID]
)
def test_invalid_parameter_is_400_naming_it(server, path, body, param):
    error = _error(_post(server, path, body), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", ["{not json", "[1, 2]", '"text"'])
def test_malformed_body_is_400(server, body):
    _error(_post(server, "/v1/chat/completions", body), 400)


@pytest.mark.parametrize(
    ("field", "literal"),
    [("temperature", "NaN"), ("presence_penalty", "Infinity"), ("top_p", "-Infinity")],
)
def test_non_finite_numbers_are_400_naming_the_field(server, field, literal):
    # Python's JSON parser accepts these literals, so they reach validation and must stop there.
    body = f'{{"model": "{MODEL_NAME}", "prompt": "Hi", "{field}": {literal}}}'
    error = _error(_post(server, "/v1/completions", body), 400)
    assert error["param"] == field


def test_openai_client_raises_bad_request_with_param(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", temperature=-1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"


def test_unknown_model_is_404(server):
    error = _error(_post(server, "/v1/chat/completions", CHAT | {"model": "gpt-17"}), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"


def test_prompt_longer_than_context_is_400_with_both_numbers(server):
    num_prompt = MAX_POSITIONS + 50
    error = _error(
        _post(server, "/v1/completions", COMPLETION | {"prompt": [65] * num_prompt}), 400
    )
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert str(MAX_POSITIONS) in error["message"] and str(num_prompt) in error["message"]


def test_max_tokens_beyond_context_is_400_with_both_numbers(server):
    error = _error(
        _post(server, "/v1/chat/completions", CHAT | {"max_completion_tokens": MAX_POSITIONS}), 400
    )
    assert error["param"] == "max_completion_tokens"
    assert str(MAX_POSITIONS) in error["message"]


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]
)
def test_missing_or_wrong_api_key_is_401(server, headers):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        _error(_post(server, path, body, headers=headers), 401)
    assert httpx.get(f"{server.base_url}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def test_body_over_the_limit_is_413(server):
    big = CHAT | {"messages": [{"role": "user", "content": "x" * BODY_LIMIT}]}
    _error(_post(server, "/v1/chat/completions", big), 413)

    def chunks():  # no Content-Length: the limit must hold for chunked bodies too
        yield b'{"model": "tiny-llama", "prompt": "'
        yield b"y" * BODY_LIMIT
        yield b'"}'

    response = httpx.post(
        f"{server.base_url}/v1/completions", headers=AUTH, content=chunks(), timeout=60
    )
    _error(response, 413)


def test_valid_request_still_succeeds(server):
    response = _post(server, "/v1/chat/completions", CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 4


def _idle(values) -> bool:
    return (
        values["torch_runner_num_requests_running"] == 0
        and values["torch_runner_num_requests_waiting"] == 0
    )


def _aborted(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    line = next(
        (
            ln
            for ln in text.splitlines()
            if ln.startswith("torch_runner_request_finished_total") and '"abort"' in ln
        ),
        None,
    )
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_streaming_disconnect_aborts_and_frees_kv(server):
    assert wait_for_metrics(server.base_url, _idle)["torch_runner_kv_cache_used_tokens"] == 0
    aborted = _aborted(server)
    body = COMPLETION | LONG | {"stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        [next(lines) for _ in range(6)]
        assert metric_values(server.base_url)["torch_runner_kv_cache_used_tokens"] > 0
    values = wait_for_metrics(
        server.base_url, lambda v: _idle(v) and v["torch_runner_kv_cache_used_tokens"] == 0
    )
    assert _idle(values) and values["torch_runner_kv_cache_used_tokens"] == 0
    assert _aborted(server) == aborted + 1


def test_non_streaming_disconnect_aborts_and_frees_kv(server):
    """The client hangs up while its (non-streaming) request runs: no wall-clock race, the
    connection is closed once the metrics show the request running."""
    wait_for_metrics(server.base_url, _idle)
    aborted = _aborted(server)
    body = CHAT | LONG | {"max_tokens": MAX_POSITIONS - 64}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:
            task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(
                None,
                lambda: wait_for_metrics(
                    server.base_url, lambda v: v["torch_runner_num_requests_running"] == 1
                ),
            )
            assert not task.done(), "the request ended before the client could hang up"
            task.cancel()  # closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(scenario())
    values = wait_for_metrics(
        server.base_url, lambda v: _idle(v) and v["torch_runner_kv_cache_used_tokens"] == 0
    )
    assert _idle(values) and values["torch_runner_kv_cache_used_tokens"] == 0
    assert _aborted(server) == aborted + 1


def test_full_waiting_queue_is_503_with_retry_after(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:

            async def hold(body):  # a streaming request kept open until cancelled
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass

            async def until(predicate):
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(
                    None, lambda: wait_for_metrics(server.base_url, predicate)
                )

            running = asyncio.create_task(hold(COMPLETION | LONG | {"stream": True}))
            await until(lambda v: v["torch_runner_num_requests_running"] == 1)
            waiting = asyncio.create_task(hold(COMPLETION | LONG | {"stream": True}))
            values = await until(lambda v: v["torch_runner_num_requests_waiting"] == 1)
            assert values["torch_runner_num_requests_running"] == 1
            assert values["torch_runner_num_requests_waiting"] == 1
            refused = await client.post("/v1/chat/completions", json=CHAT)
            running.cancel()
            waiting.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
            return refused

    refused = asyncio.run(scenario())
    error = _error(refused, 503)
    assert int(refused.headers["Retry-After"]) >= 1
    assert error["code"] == "over_capacity"
    values = wait_for_metrics(
        server.base_url, lambda v: _idle(v) and v["torch_runner_kv_cache_used_tokens"] == 0
    )
    assert _idle(values) and values["torch_runner_kv_cache_used_tokens"] == 0
    statuses = _statuses(server)
    assert (
        statuses.get("499", 0) >= 1
    )  # the queued request whose client left before its first token
    assert "500" not in statuses


def _statuses(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "torch_runner_requests_total":
                status = sample.labels["status"]
                totals[status] = totals.get(status, 0.0) + sample.value
    return totals


def test_no_request_in_this_module_ended_in_a_500(server):
    # Runs last here: every bad input above got a 4xx, every disconnect a 499, never a 500.
    statuses = _statuses(server)
    assert "500" not in statuses
    assert statuses["400"] >= len(INVALID)


def test_health_is_503_once_the_engine_stops(tmp_path):
    path, _ = save_serve_checkpoint(tmp_path / "tiny")
    threaded = ThreadedServer(path, max_total_tokens=256)
    try:
        assert httpx.get(f"{threaded.base_url}/health").json()["status"] == "ok"
        threaded.async_engine.shutdown()
        _error(httpx.get(f"{threaded.base_url}/health"), 503)
    finally:
        threaded.stop()
