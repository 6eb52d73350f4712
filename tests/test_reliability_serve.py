"""Reliability of the server under bad input and load, over real HTTP (uvicorn in a thread).

Lone surrogates and lax types are 400s naming the field; a fan-out is admitted whole or is a
400 naming the limit; a request whose logits go non-finite ends alone with an error while its
batchmates finish; a storm of dropped streams leaves no KV held; under KV exhaustion every
admitted request finishes with exactly the tokens it gets alone. Oracles: the same engine run
one request at a time, and the byte tokenizer (token id == byte).
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
from serve_fixtures import (
    API_KEY,
    MODEL_NAME,
    ThreadedServer,
    metric_values,
    save_serve_checkpoint,
    wait_for_metrics,
)

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4}
GREEDY = {"temperature": 0.0, "ignore_eos": True}
MAX_WAITING = 6
MAX_CHOICES = 12
POISON = 0x7E  # "~": its embedding output turns NaN in the non-finite test
STORM_STREAMS = int(os.environ.get("TORCH_RUNNER_STORM_STREAMS", "20"))  # operators: 500+


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("reliability") / "tiny")
    threaded = ThreadedServer(
        path,
        max_num_seqs=3,
        max_waiting=MAX_WAITING,
        max_choices=MAX_CHOICES,
        max_total_tokens=512,
        block_size=16,
    )
    yield threaded
    threaded.stop()


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: \\ud800 stays
    return httpx.post(
        f"{server.base_url}{path}", content=content, headers=AUTH, timeout=120, **kwargs
    )


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


SURROGATES = [
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages.0.content.0.text"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "x", "name": "\ud83d"}]}, "messages.0.name"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "\udc00"}}}, "response_format"),
    ("/v1/chat/completions", CHAT | {"user": "\ud800"}, "user"),
    ("/v1/completions", COMPLETION | {"prompt": "\udfff"}, "prompt"),
    ("/v1/completions", COMPLETION | {"prompt": ["ok", "\ud800"]}, "prompt"),
    ("/v1/completions", COMPLETION | {"stop": ["\ud800"]}, "stop"),
    ("/v1/completions", COMPLETION | {"model": "m\ud800"}, "model"),
    ("/v1/completions", COMPLETION | {"logit_bias": {"\ud800": 1}}, "logit_bias"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), SURROGATES)
def test_lone_surrogate_is_400_naming_the_field(server, path, body, param):
    error = error_of(post(server, path, body), 400)
    assert error["param"] == param
    assert "surrogate" in error["message"]


def test_invalid_utf8_body_is_400(server):
    error_of(post(server, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}'), 400)


STRICT = [
    ("/v1/completions", COMPLETION | {"stream": "yes"}, "stream"),
    ("/v1/completions", COMPLETION | {"prompt": [[False, True]]}, "prompt.0.0"),
    ("/v1/completions", COMPLETION | {"prompt": [True]}, "prompt.0"),
    ("/v1/completions", COMPLETION | {"echo": 1}, "echo"),
    ("/v1/completions", COMPLETION | {"max_tokens": "4"}, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"n": 2.0}, "n"),
    ("/v1/chat/completions", CHAT | {"logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", CHAT | {"stream_options": {"include_usage": 1}, "stream": True}, "stream_options.include_usage"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), STRICT)
def test_lax_types_are_rejected_naming_the_field(server, path, body, param):
    assert error_of(post(server, path, body), 400)["param"] == param


def test_fan_out_larger_than_the_queue_is_400_not_503(server):
    error = error_of(post(server, "/v1/completions", COMPLETION | {"n": MAX_WAITING + 1}), 400)
    assert error["param"] == "n" and "max_waiting" in error["message"]


def test_fan_out_beyond_the_cap_is_400_naming_it(server):
    body = COMPLETION | {"prompt": ["a", "b", "c", "d", "e"], "n": 3}  # 15 > 12
    error = error_of(post(server, "/v1/completions", body), 400)
    assert error["code"] == "too_many_choices" and "--max-choices-per-request" in error["message"]


def test_fan_out_that_fits_is_admitted_whole(server):
    body = COMPLETION | GREEDY | {"n": MAX_WAITING, "seed": 3, "max_tokens": 3}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert sorted(c["index"] for c in response.json()["choices"]) == list(range(MAX_WAITING))


def _alone(server, prompt: str, max_tokens: int) -> str:
    body = COMPLETION | GREEDY | {"prompt": prompt, "max_tokens": max_tokens}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_non_finite_logits_end_only_that_request(server):
    healthy = {"prompt": "steady", "max_tokens": 24}
    expected = _alone(server, healthy["prompt"], healthy["max_tokens"])
    model = server.engine.runner.model

    def hook(module, inputs, output):
        return output.masked_fill((inputs[0] == POISON)[..., None], float("nan"))

    handle = model.model.embed_tokens.register_forward_hook(hook)
    try:

        async def scenario():
            async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as c:
                good = c.post("/v1/completions", json=COMPLETION | GREEDY | healthy)
                bad = c.post("/v1/completions", json=COMPLETION | {"prompt": "a~b", "logprobs": 2})
                lines = []
                stream_body = COMPLETION | {"prompt": "x~", "stream": True, "logprobs": 1}
                async with c.stream("POST", "/v1/completions", json=stream_body) as r:
                    assert r.status_code == 200
                    lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
                return await good, await bad, lines

        good, bad, lines = asyncio.run(scenario())
    finally:
        handle.remove()
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == expected
    error = error_of(bad, 500)
    assert error["code"] == "non_finite_logits" and "non-finite" in error["message"]
    events = [json.loads(line[5:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "error"
    assert events[-1]["error"]["code"] == "non_finite_logits"
    text = httpx.get(f"{server.base_url}/metrics").text
    assert (
        'torch_runner_aborted_requests_total{model="tiny-llama",reason="non_finite_logits"} 2.0'
        in text
    )
    assert "torch_runner_non_finite_requests_total 2.0" in text


def _idle_and_free(values) -> bool:
    return (
        values["torch_runner_num_requests_running"] == 0
        and values["torch_runner_num_requests_waiting"] == 0
        and values["torch_runner_kv_cache_used_tokens"] == 0
    )


def test_disconnect_storm_frees_every_block(server):
    """STORM_STREAMS streams at once (the queue refuses some: 503), half of the admitted dropped
    after a few events; afterwards no KV is held by requests and the server still answers
    correctly."""
    expected = _alone(server, "storm", 8)

    async def one(client, i: int):
        body = COMPLETION | GREEDY | {"prompt": f"storm {i}", "max_tokens": 200, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code
            count = 0
            async for line in r.aiter_lines():
                count += line.startswith("data:")
                if i % 2 and count >= 3:
                    return "dropped"
            return 200

    async def storm():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(STORM_STREAMS)))

    outcomes = asyncio.run(storm())
    assert set(outcomes) <= {200, 503, "dropped"} and 200 in outcomes and "dropped" in outcomes
    values = wait_for_metrics(server.base_url, _idle_and_free)
    assert _idle_and_free(values), values
    assert values["torch_runner_kv_cache_cached_tokens"] > 0  # the prefix cache kept what it may
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert _alone(server, "storm", 8) == expected


def test_kv_exhaustion_preempts_and_outputs_equal_running_alone(server):
    """3 running x ~260 tokens need more than the 512-token pool: the scheduler preempts, and
    each admitted request still returns exactly its solo tokens."""
    prompts = [f"exhaust {i}" for i in range(3)]
    alone = [_alone(server, p, 250) for p in prompts]
    before = metric_values(server.base_url).get("torch_runner_preemptions_total", 0.0)

    async def together():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=300) as c:
            bodies = [COMPLETION | GREEDY | {"prompt": p, "max_tokens": 250} for p in prompts]
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(together())
    assert [r.json()["choices"][0]["text"] for r in responses] == alone
    assert metric_values(server.base_url)["torch_runner_preemptions_total"] > before


def test_no_request_here_ended_in_an_unexpected_500(server):
    text = httpx.get(f"{server.base_url}/metrics").text
    fives = [
        ln
        for ln in text.splitlines()
        if ln.startswith("torch_runner_requests_total") and 'status="500"' in ln
    ]
    assert all(ln.endswith(" 1.0") for ln in fives), fives  # only the non-finite request


def test_large_bodies_do_not_stall_health(server):
    """Two 1 MB chat bodies (each tokenized in the worker pool, then a 400: longer than the
    context) keep the event loop free: /health answers in a fraction of their time, where
    on-loop tokenization would hold it for their whole duration."""
    content = "lorem ipsum dolor sit amet " * (1_000_000 // 27)
    body = json.dumps(CHAT | {"messages": [{"role": "user", "content": content}]}).encode()

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=300) as c:
            latencies: list[float] = []
            done = asyncio.Event()

            async def probe():
                while not done.is_set():
                    start = asyncio.get_running_loop().time()
                    await c.get("/health")
                    latencies.append(asyncio.get_running_loop().time() - start)
                    await asyncio.sleep(0.02)

            prober = asyncio.create_task(probe())
            start = asyncio.get_running_loop().time()
            responses = await asyncio.gather(
                *(c.post("/v1/chat/completions", content=body) for _ in range(2))
            )
            elapsed = asyncio.get_running_loop().time() - start
            done.set()
            await prober
            return responses, elapsed, latencies

    responses, elapsed, latencies = asyncio.run(scenario())
    assert all(error_of(r, 400)["code"] == "context_length_exceeded" for r in responses)
    assert len(latencies) >= 5, (elapsed, latencies)
    assert max(latencies) < 0.5 * elapsed, (elapsed, max(latencies))
